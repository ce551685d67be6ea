"""The fused-layer conventions vLLM applies on load (docs/reference/vllm-conventions.md), each written out here in plain torch
from the stored tensors — nvfp4's one global scale (the largest), fp8 per-tensor weights requantized to the largest
scale, one input scale per fused layer (the largest), an MoE expert's w13 computed with w1's global scale, int4
zero points packed per member along the output dim — and compared with shardcal's reload of the same export (its
fake-quant model). vLLM itself runs in tests/export/test_vllm.py (``make test-vllm``); these run everywhere.

Each convention also gets an export made with the rule broken on purpose (``shares_range`` says nothing is shared:
what shardcal wrote before issue 44), which the model of vLLM must tell apart.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardcal.calib.runner import calibrate
from shardcal.errors import ExportError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import fused
from shardcal.quant.linear import QuantLinear
from shardcal.quant.spec import QuantizerSpec
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)
MOE = dict(TINY_CONFIGS["qwen2_moe"], num_hidden_layers=2)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _model(cfg: dict) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=0)
    with torch.no_grad():  # v_proj and up_proj 8x larger than their siblings: ranges that differ, as in real models
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(8.0)
            if hasattr(layer.mlp, "up_proj"):
                layer.mlp.up_proj.weight.mul_(8.0)
    return model.eval()


def _data() -> torch.Tensor:
    return torch.randint(3, 256, (6, 16), generator=torch.Generator().manual_seed(1))


def _export(tmp_path: Path, recipe: str, cfg: dict = LLAMA, broken: bool = False) -> tuple[Path, dict]:
    """The export of a calibrated tiny model (``broken``: made with the fused-layer rule off) and its tensors, read
    with safetensors alone."""
    out = tmp_path / f"{Path(recipe).stem}{'-broken' if broken else ''}-export"
    model = _model(cfg)
    with pytest.MonkeyPatch.context() as patch:
        if broken:
            patch.setattr(fused, "shares_range", lambda spec, role: False)
        calibrate(model, _data(), recipe, batch_size=2, progress=False)
        export_checkpoint(model, out)
    return out, _tensors(out)


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _reload(path: Path) -> torch.nn.Module:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = from_pretrained(path)
    model.vllm_warnings = [str(w.message) for w in caught if "vLLM loads them as one fused layer" in str(w.message)]
    return model


def _members(prefix: str, block: str, names: tuple[str, ...]) -> list[str]:
    return [f"{prefix}.{block}.{n}" for n in names]


def _fused_groups(model: torch.nn.Module) -> list[list[str]]:
    return [
        _members(f"model.layers.{i}", block, names)
        for i, layer in enumerate(model.model.layers)
        for block, names in GROUPS.items()
        if all(hasattr(getattr(layer, block), n) for n in names)
    ]


# ------------------------------------------------------------------------------------- vLLM's load, written out


def _nvfp4_values(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values of packed codes: element 2k in the low nibble of byte k, sign in bit 3."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    return E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)


def vllm_nvfp4_fused(tensors: dict, members: list[str], global_scale_of: str | None = None) -> torch.Tensor:
    """vLLM's fused nvfp4 weight (CompressedTensorsW4A4Fp4.process_weights_after_loading and the emulation kernel's
    dequantization): the members' codes and FP8 block scales concatenated, and one global scale for all — the
    largest stored one (a linear layer), or one member's (``global_scale_of``: an MoE expert's w13 takes w1's)."""
    scales = torch.stack([tensors[f"{m}.weight_global_scale"].float().reshape(()) for m in members])
    gs = tensors[f"{global_scale_of}.weight_global_scale"].float().reshape(()) if global_scale_of else scales.max()
    rows = []
    for m in members:
        values = _nvfp4_values(tensors[f"{m}.weight_packed"])
        block = tensors[f"{m}.weight_scale"].float()
        rows.append((values.unflatten(-1, (-1, 16)) * (block / gs).unsqueeze(-1)).flatten(-2))
    return torch.cat(rows)


def vllm_fp8_fused(tensors: dict, members: list[str]) -> torch.Tensor:
    """vLLM's fused fp8 per-tensor weight (requantize_with_max_scale): each member dequantized with its own scale
    and quantized again with the largest, ``fp8(clamp(w * s_i / s_max))``; the layer computes with ``q * s_max``."""
    scales = [tensors[f"{m}.weight_scale"].float().reshape(()) for m in members]
    top = torch.stack(scales).max()
    rows = []
    for m, s in zip(members, scales, strict=True):
        requantized = torch.clamp(tensors[f"{m}.weight"].float() * s / top, -448.0, 448.0).to(torch.float8_e4m3fn)
        rows.append(requantized.float() * top)
    return torch.cat(rows)


def vllm_input_scale(tensors: dict, members: list[str], key: str) -> torch.Tensor:
    """One input scale per fused layer: the largest stored (``input_scale``; ``input_global_scale`` too)."""
    return torch.stack([tensors[f"{m}.{key}"].float().reshape(()) for m in members]).max()


def _weights(model: torch.nn.Module, members: list[str]) -> torch.Tensor:
    return torch.cat([model.get_submodule(m).weight.detach().float() for m in members])


# ------------------------------------------------------------------------------------- the conventions


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-sq-gptq"])
def test_nvfp4_fused_layers_share_one_global_scale(tmp_path, recipe):
    out, tensors = _export(tmp_path, recipe)
    reload = _reload(out)
    assert reload.vllm_warnings == []
    for members in _fused_groups(reload):
        assert torch.equal(vllm_nvfp4_fused(tensors, members), _weights(reload, members)), members
        gs = vllm_input_scale(tensors, members, "input_global_scale")
        for m in members:  # the input quantizer vLLM applies to the fused layer is each member's
            assert torch.equal(tensors[f"{m}.input_global_scale"].float().reshape(()), gs), m
    broken_out, broken = _export(tmp_path, "nvfp4", broken=True)
    broken_reload = _reload(broken_out)
    assert any(
        not torch.equal(vllm_nvfp4_fused(broken, m), _weights(broken_reload, m)) for m in _fused_groups(broken_reload)
    )
    assert broken_reload.vllm_warnings  # shardcal's reload says so


@pytest.mark.parametrize("recipe", ["fp8", "fp8-gptq"])
def test_fp8_per_tensor_fused_weights_need_no_requantization(tmp_path, recipe):
    out, tensors = _export(tmp_path, recipe)
    reload = _reload(out)
    for members in _fused_groups(reload):
        assert torch.equal(vllm_fp8_fused(tensors, members), _weights(reload, members)), members
        scale = vllm_input_scale(tensors, members, "input_scale")
        assert all(torch.equal(tensors[f"{m}.input_scale"].reshape(()), scale) for m in members)
    broken_out, broken = _export(tmp_path, "fp8", broken=True)
    broken_reload = _reload(broken_out)
    assert any(
        not torch.equal(vllm_fp8_fused(broken, m), _weights(broken_reload, m)) for m in _fused_groups(broken_reload)
    )


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-int8-sq"])
def test_int8_fused_layers_share_one_static_input_scale(tmp_path, recipe):
    """Per-channel int8 weight scales are concatenated by vLLM (nothing to share); its one input scale per fused
    layer is the largest member's, which is every member's."""
    out, tensors = _export(tmp_path, recipe)
    reload = _reload(out)
    for members in _fused_groups(reload):
        scale = vllm_input_scale(tensors, members, "input_scale")
        for m in members:
            assert torch.equal(tensors[f"{m}.input_scale"].reshape(()), scale), m
            assert tensors[f"{m}.weight_scale"].shape == (reload.get_submodule(m).out_features, 1)


def test_moe_expert_w13_uses_w1s_global_scale(tmp_path):
    """vLLM's fused MoE computes each expert's gate and up (w1, w3) with w1's global scale
    (CompressedTensorsW4A4Nvfp4MoEMethod: w13_weight_global_scale[:, 0]); the shared expert is a fused gate_up."""
    out, tensors = _export(tmp_path, "nvfp4", cfg=MOE)
    reload = _reload(out)
    experts = reload.model.layers[1].mlp.experts
    assert len(experts) == MOE["num_experts"]
    for e in range(len(experts)):
        members = [f"model.layers.1.mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj")]
        assert torch.equal(vllm_nvfp4_fused(tensors, members, global_scale_of=members[0]), _weights(reload, members))
    shared = [f"model.layers.1.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj")]
    assert torch.equal(vllm_nvfp4_fused(tensors, shared), _weights(reload, shared))


def test_asymmetric_int4_zero_points_of_a_fused_layer_concatenate(tmp_path):
    """vLLM loads each member's packed zero points at the member's output offset / 8 (PackedvLLMParameter,
    packed_dim 0): the fused layer's zero points, unpacked, are each member's own in order (every member's
    out_features a multiple of 8, as in every model vLLM fuses)."""
    recipe = tmp_path / "asym.toml"
    recipe.write_text('[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\nsymmetric = false\n')
    out, tensors = _export(tmp_path, str(recipe))
    reload = _reload(out)

    def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
        return ((packed.T.long().unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF).flatten(-2)[:, :rows].T

    for members in _fused_groups(reload):
        fused_packed = torch.cat([tensors[f"{m}.weight_zero_point"] for m in members])  # what vLLM's loader holds
        rows = [reload.get_submodule(m).out_features for m in members]
        own = [unpack(tensors[f"{m}.weight_zero_point"], r) for m, r in zip(members, rows, strict=True)]
        assert torch.equal(unpack(fused_packed, sum(rows)), torch.cat(own)), members
        assert all((o != 8).any() for o in own)  # real zero points, not only the symmetric offset


def test_hadamard_rotations_of_a_fused_layer_are_one_transform(tmp_path):
    """vLLM applies one input transform per fused layer (HadamardTransform shares its matrix across the members'
    partitions): q/k/v and gate/up are rotated by one scheme, with the same block."""
    out, _ = _export(tmp_path, "w4a16-gptq-rot-g64-asym")
    config = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]
    scheme_of = {
        target: (name, scheme["head_dim"])
        for name, scheme in config["config_groups"].items()
        for apply in scheme["apply"]
        if apply["location"] == "input"
        for target in apply["targets"]
    }
    for members in _fused_groups(from_pretrained(out)):
        assert len({scheme_of[m] for m in members}) == 1, members


def test_export_refuses_a_fused_layer_vllm_would_load_otherwise(tmp_path):
    """Members of one fused layer quantized differently (vLLM takes the first member's scheme, or refuses a partly
    ignored layer), or with ranges vLLM takes as one that differ: an ExportError naming them, nothing written."""
    model = _model(LLAMA)
    attention = model.model.layers[0].self_attn
    for p in ("q_proj", "k_proj"):  # v_proj left in full precision
        QuantLinear.from_linear(getattr(attention, p), weight=QuantizerSpec("int8", "channel", axis=0), name=p)
        getattr(attention, p).weight_quantizer.calibrate_from(getattr(attention, p).weight)
    with pytest.raises(ExportError, match=r"self_attn\.v_proj \(not quantized\).*one fused layer .*qkv_proj"):
        export_checkpoint(model, tmp_path / "mixed")
    QuantLinear.from_linear(attention.v_proj, weight=QuantizerSpec("nvfp4"), name="v_proj")
    attention.v_proj.weight_quantizer.calibrate_from(attention.v_proj.weight)
    with pytest.raises(ExportError, match=r"v_proj \(nvfp4, 16-blocks, max\)"):
        export_checkpoint(model, tmp_path / "mixed")
    model = _model(LLAMA)
    for p in ("q_proj", "k_proj", "v_proj"):
        linear = getattr(model.model.layers[1].self_attn, p)
        QuantLinear.from_linear(linear, weight=QuantizerSpec("nvfp4"), name=p)
        linear.weight_quantizer.calibrate_from(linear.weight)  # each its own range: what vLLM cannot compute
    with pytest.raises(ExportError, match=r"model\.layers\.1\.self_attn\.qkv_proj: vLLM computes .* one weight range"):
        export_checkpoint(model, tmp_path / "unshared")
    fused.share_fused_ranges(model, role="weight")  # the documented fix
    export_checkpoint(model, tmp_path / "shared")
    model = _model(LLAMA)
    for p, amax in zip(("gate_proj", "up_proj"), (1.0, 2.0), strict=True):
        linear = getattr(model.model.layers[0].mlp, p)
        int8 = QuantizerSpec("int8", "channel", axis=0)
        QuantLinear.from_linear(linear, weight=int8, input=QuantizerSpec("int8"), name=p)
        linear.weight_quantizer.calibrate_from(linear.weight)
        linear.input_quantizer.set_amax(torch.tensor([amax]))
    with pytest.raises(ExportError, match=r"mlp\.gate_up_proj: vLLM computes .* one input range.*up_proj 2\b"):
        export_checkpoint(model, tmp_path / "inputs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]


def test_weight_only_export_shares_the_ranges_it_calibrates(tmp_path):
    """A plain model exported with a weight-only recipe is calibrated at export: its fused layers share their
    ranges as calibrate() would give them (the same tensors)."""
    recipe = tmp_path / "nvfp4a16.toml"
    recipe.write_text('[weight]\nformat = "nvfp4"\n')
    export_checkpoint(_model(LLAMA), tmp_path / "at-export", recipe=str(recipe))
    calibrated = _model(LLAMA)
    calibrate(calibrated, _data(), str(recipe), batch_size=2, progress=False)
    export_checkpoint(calibrated, tmp_path / "calibrated")
    at_export, want = (_tensors(tmp_path / d) for d in ("at-export", "calibrated"))
    assert at_export.keys() == want.keys()
    assert all(torch.equal(at_export[k], want[k]) for k in want)
    gs = [at_export[f"model.layers.0.self_attn.{p}.weight_global_scale"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(gs[0], gs[2]) and torch.equal(gs[1], gs[2])


# ------------------------------------------------------------------------------------- exact across ranks


def _shared_ranges(recipe: str) -> dict[str, torch.Tensor]:
    model = _model(LLAMA)
    fsdp2_wrap(model)
    calibrate(model, _data(), recipe, batch_size=2, progress=False)
    return {
        n: q.amax.detach().clone() for n, q in model.named_modules() if n.endswith("_quantizer") and q.amax is not None
    }


@pytest.mark.parametrize("recipe", ["nvfp4-sq-gptq", "fp8"])
def test_shared_ranges_are_the_same_bits_on_one_and_two_ranks(recipe):
    """The shared ranges are the members' largest (computed by every rank, or by the solving rank with
    stream_correction and broadcast): 2 ranks give 1 rank's bits, and every fused layer holds one range."""
    (one,) = run_on_ranks(1, _shared_ranges, recipe)
    for got in run_on_ranks(2, _shared_ranges, recipe):
        assert got.keys() == one.keys()
        assert all(torch.equal(got[n], one[n]) for n in one)
    model = _model(LLAMA)
    for members in _fused_groups(model):
        for role in ("weight", "input"):
            values = [one[f"{m}.{role}_quantizer"] for m in members]
            assert all(torch.equal(v, values[0]) for v in values), (members, role)
    assert not torch.equal(
        one["model.layers.0.mlp.gate_proj.weight_quantizer"], one["model.layers.0.mlp.down_proj.weight_quantizer"]
    )
