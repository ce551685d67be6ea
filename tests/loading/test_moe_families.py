"""DeepSeek-V3 and GPT-OSS through transformers' own classes: loaded, calibrated, exported and reloaded.

DeepSeek-V3: MLA attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj), a sigmoid router holding a
persistent buffer (``e_score_correction_bias``), shared experts, fused experts in the standard layout. GPT-OSS: fused
experts transposed ([E, H, 2I] / [E, I, H]), gate and up interleaved, with biases and a clamped gate.

The amax references come from hooks on the model's own forward, run with transformers' eager experts (each
expert's tokens at the experts' pre-hook; the down_proj input where the forward computes it: GPT-OSS's
``_apply_gate`` output, DeepSeek's ``F.linear`` call on a ``down_proj`` slice); the weight references slice the fused
parameters as transformers' modeling code does (``chunk`` of the output dim; ``[..., ::2]`` / ``[..., 1::2]``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from _hf_models import HF_MOE_FAMILIES, hf_logits, hf_model
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.export import export_checkpoint
from shardcal.quant.session import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _numerics import FLOAT_RTOL

pytest.importorskip("transformers")
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

BATCH = 3
WEIGHT_ONLY = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 16\n'
FP8_DENSE = '[targets]\nexclude = ["*.mlp.experts.*"]\n[weight]\nformat = "fp8_e4m3"\n[input]\nformat = "fp8_e4m3"\n'


def _data(n: int = 6, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def _amax(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None}


def _hf_weight(experts: nn.Module, e: int, proj: str) -> torch.Tensor:
    """Expert ``e``'s ``proj`` weight [out, in], sliced as transformers' modeling code uses it."""
    if getattr(experts, "is_transposed", False):  # GPT-OSS: x @ W; gate_up[..., ::2], gate_up[..., 1::2]
        cols = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
        return experts.down_proj[e].T if proj == "down_proj" else experts.gate_up_proj[e][:, cols[proj]].T
    gate, up = experts.gate_up_proj[e].chunk(2, dim=0)  # F.linear(x, W).chunk(2, dim=-1)
    return {"gate_proj": gate, "up_proj": up, "down_proj": experts.down_proj[e]}[proj]


class _ForwardObserver:
    """Max |x| of every Linear input and of each expert's gate/up and down_proj inputs, seen on the model's forward."""

    def __init__(self, model: nn.Module):
        self.seen: dict[str, torch.Tensor] = {}
        self.hooks = []
        self.experts = {
            n: m for n, m in model.named_modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
        }
        self.pending: dict[str, list[int]] = {}  # GPT-OSS: the experts hit, in the order the eager loop visits them
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                self.hooks.append(
                    m.register_forward_pre_hook(lambda m, a, n=name: self.keep(f"{n}.input_quantizer", a[0]))
                )
        for name, m in self.experts.items():
            self.hooks.append(m.register_forward_pre_hook(lambda m, a, n=name: self.routed(n, m, a)))
            if getattr(m, "is_transposed", False):
                self.wrap_gate(name, m)
        model.config._experts_implementation = "eager"  # the per-expert loop of the modeling file

    def keep(self, name: str, x: torch.Tensor) -> None:
        value = x.detach().abs().amax().reshape(1).float()
        self.seen[name] = value if name not in self.seen else torch.maximum(self.seen[name], value)

    def routed(self, name: str, m: nn.Module, args: tuple) -> None:
        x, index = args[0], args[1]
        hit = []
        for e in range(m.gate_up_proj.shape[0]):
            tokens = x[(index == e).any(dim=-1)]
            if tokens.shape[0]:
                hit.append(e)
                for proj in ("gate_proj", "up_proj"):
                    self.keep(f"{name}.{e}.{proj}.input_quantizer", tokens)
        self.pending[name] = hit

    def wrap_gate(self, name: str, m: nn.Module) -> None:
        original = m._apply_gate

        def recorded(gate_up: torch.Tensor) -> torch.Tensor:
            out = original(gate_up)
            self.keep(f"{name}.{self.pending[name].pop(0)}.down_proj.input_quantizer", out)
            return out

        m._apply_gate = recorded

    def linear_spy(self, original):
        """``F.linear`` recording its input when the weight is a slice of some experts' ``down_proj`` (DeepSeek)."""
        storages = {m.down_proj.untyped_storage().data_ptr(): (n, m) for n, m in self.experts.items()}

        def spy(x, weight, bias=None):
            found = storages.get(weight.untyped_storage().data_ptr())
            if found is not None:
                name, m = found
                self.keep(f"{name}.{weight.storage_offset() // m.down_proj[0].numel()}.down_proj.input_quantizer", x)
            return original(x, weight, bias)

        return spy


def _reference_amax(family: str, data: torch.Tensor, names: list[str], monkeypatch) -> dict[str, torch.Tensor]:
    model = hf_model(family)
    observer = _ForwardObserver(model)
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", observer.linear_spy(F.linear))
        with torch.no_grad():
            for s in range(0, data.shape[0], BATCH):
                model(data[s : s + BATCH], use_cache=False)
    seen = {n: v for n, v in observer.seen.items() if n in names}
    modules = dict(model.named_modules())
    for name in names:  # weights: per output channel (w8a8-int8)
        owner, _, kind = name.rpartition(".")
        if kind == "weight_quantizer":
            if owner in modules:
                w = modules[owner].weight
            else:
                experts, e, proj = owner.rsplit(".", 2)
                w = _hf_weight(modules[experts], int(e), proj)
            seen[name] = w.detach().abs().amax(dim=1, keepdim=True).float()
    return seen


def _agree(name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    if name.endswith("weight_quantizer"):
        return torch.equal(got, want)
    return got.shape == want.shape and bool(((got - want).abs() <= FLOAT_RTOL * want.abs()).all())


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_amax_equals_hooks_on_the_models_own_forward(family, monkeypatch):
    data = _data()
    model = hf_model(family)
    calibrate(model, data, "w8a8-int8", batch_size=BATCH, progress=False, calibrate_all_experts=False)
    got = _amax(model)
    want = _reference_amax(family, data, list(got), monkeypatch)
    assert got.keys() == want.keys()
    # Exact where shardcal runs the model's own shapes. Expert inputs, and everything after the first MoE layer, come
    # through per-expert matmuls where the model's forward multiplies the fused gate_up: the same products summed
    # in another kernel's order, exact on some CPUs only (AVX-512), so those agree to float32 rounding.
    bad = [n for n in got if not _agree(n, got[n], want[n])]
    assert not bad, (len(bad), bad[:3], [float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in bad[:3]])
    # GPT-OSS: 2 MoE layers; DeepSeek: 3 layers, the first dense (first_k_dense_replace=1)
    assert sum(".mlp.experts." in n for n in got) == 2 * 4 * 3 * 2  # layers x experts x projections x (w, in)
    assert not [n for n in got if ".mlp.gate." in n or ".mlp.router." in n]  # routers are never quantized
    if family == "deepseek_v3":  # MLA
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert f"model.layers.1.self_attn.{proj}.weight_quantizer" in got


def _calibrated_on_ranks(family: str) -> dict[str, torch.Tensor]:
    model = hf_model(family)
    fsdp2_wrap(model)
    calibrate(model, _data(n=7), "w8a8-int8", batch_size=BATCH, progress=False)
    return _amax(model)


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_two_ranks_equal_one_rank(family):
    (single,) = run_on_ranks(1, _calibrated_on_ranks, family)
    for result in run_on_ranks(2, _calibrated_on_ranks, family):
        assert result.keys() == single.keys()
        assert all(torch.equal(result[n], single[n]) for n in single)


# ---------------------------------------------------------------------------------------------- export


@contextlib.contextmanager
def gpt_oss_per_expert_mapping() -> Iterator[None]:
    """While active, transformers reads GPT-OSS experts stored per expert (what vLLM's compressed-tensors MoE loader
    reads; transformers 5.24 reads them fused only): halves concatenated, interleaved, transposed. Restored on exit
    (also a save_pretrained would use it, in reverse)."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Concatenate, Interleave, MergeModulelist, Transpose, WeightConverter

    pair = [MergeModulelist(dim=0), Concatenate(dim=1), Interleave(dim=1, inverse=True)]
    mapping = [
        WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
                        operations=[*pair, Transpose(1, 2)]),
        WeightConverter(["mlp.experts.*.gate_proj.bias", "mlp.experts.*.up_proj.bias"], "mlp.experts.gate_up_proj_bias",
                        operations=pair),
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj",
                        operations=[MergeModulelist(dim=0), Transpose(1, 2)]),
        WeightConverter("mlp.experts.*.down_proj.bias", "mlp.experts.down_proj_bias", operations=[MergeModulelist(dim=0)]),
    ]  # fmt: skip
    cm.get_checkpoint_conversion_mapping("gpt_oss")  # builds the cache
    before = cm._checkpoint_conversion_mapping_cache.get("gpt_oss")
    cm.register_checkpoint_conversion_mapping("gpt_oss", mapping, overwrite=True)
    try:
        yield
    finally:
        if before is None:
            cm._checkpoint_conversion_mapping_cache.pop("gpt_oss", None)
            cm.USER_REGISTERED_MAPPINGS.discard("gpt_oss")
        else:
            cm._checkpoint_conversion_mapping_cache["gpt_oss"] = before


def _reload(folder) -> nn.Module:
    import transformers

    with gpt_oss_per_expert_mapping():
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize(
    ("family", "recipe"),
    [
        ("deepseek_v3", "weight-only"),
        ("deepseek_v3", "fp8-dense"),  # MLA and shared experts with static fp8 inputs; routed experts unquantized
        ("gpt_oss", "weight-only"),
        ("gpt_oss", "fp8-dense"),
    ],
)
def test_export_loads_in_transformers_with_the_fake_quant_logits(tmp_path, family, recipe):
    """Weight-only: every expert quantized, reloaded exactly (transformers keeps fused experts dense: it applies
    their weights, not input scales). fp8 with the routed experts excluded: static input scales too, exactly."""
    from safetensors import safe_open

    kind, recipe = recipe, parse_recipe(WEIGHT_ONLY if recipe == "weight-only" else FP8_DENSE, f"{recipe}.toml")
    data = _data()
    model = hf_model(family)
    calibrate(model, data, recipe, batch_size=BATCH, progress=False)
    want = hf_logits(model, data)
    out = export_checkpoint(model, tmp_path / "out", recipe=recipe)
    keys = set()
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    reloaded = _reload(out)
    assert torch.equal(hf_logits(reloaded, data), want)
    if family == "deepseek_v3":
        assert "model.layers.2.mlp.gate.e_score_correction_bias" in keys and "model.layers.2.mlp.gate.weight" in keys
        assert not any(k.startswith("model.layers.2.mlp.gate.") and "scale" in k for k in keys)
        bias = reloaded.model.layers[2].mlp.gate.e_score_correction_bias
        assert torch.equal(bias, model.model.layers[2].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    if family == "gpt_oss" and kind == "weight-only":
        assert {f"model.layers.1.mlp.experts.3.{p}.{s}" for p in ("gate_proj", "up_proj", "down_proj")
                for s in ("weight_packed", "weight_scale", "bias")} <= keys  # fmt: skip
        assert not any(k.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")) for k in keys)
    if family == "gpt_oss" and kind != "weight-only":  # unquantized GPT-OSS experts stay as its checkpoints
        assert "model.layers.1.mlp.experts.gate_up_proj_bias" in keys


# ---------------------------------------------------------------------------------------------- loading


def _load_sharded(family: str, folder: str) -> dict:
    import transformers

    from shardcal.loading.build import meta_parameters
    from shardcal.loading.sharded import load_pretrained

    cls = type(hf_model(family))
    with meta_parameters():
        model = cls._from_config(transformers.AutoConfig.from_pretrained(folder))
    model = load_pretrained(folder, model=model)
    buffers = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    return {"logits": hf_logits(model, _data(n=2)), "buffers": buffers}


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_load_pretrained_reads_buffers_and_fused_experts(tmp_path, family):
    """Sharded over 2 ranks from transformers' own save_pretrained: the persistent buffers as stored (replicated:
    every rank reads them whole), the logits equal to transformers' own load."""
    original = hf_model(family)
    original.save_pretrained(tmp_path)
    want = hf_logits(type(original).from_pretrained(tmp_path).eval(), _data(n=2))
    for r in run_on_ranks(2, _load_sharded, family, str(tmp_path)):
        assert torch.equal(r["logits"], want)
        stored = {n: b for n, b in original.named_buffers() if n.endswith("e_score_correction_bias")}
        assert r["buffers"].keys() == stored.keys() and all(torch.equal(r["buffers"][n], stored[n]) for n in stored)


def test_a_buffer_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("deepseek_v3").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(5)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (message,) = run_on_ranks(1, _load_error, str(tmp_path))
    assert "'model.layers.1.mlp.gate.e_score_correction_bias' has shape [5]" in message and "has [4]" in message
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(4)
    tensors["model.layers.1.mlp.gate.stray"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (message,) = run_on_ranks(1, _load_error, str(tmp_path))
    assert "unexpected tensor(s) 'model.layers.1.mlp.gate.stray' (neither parameters nor buffers" in message


def _load_error(folder: str) -> str | None:
    import transformers

    from shardcal.errors import CheckpointError
    from shardcal.loading.build import meta_parameters
    from shardcal.loading.sharded import load_pretrained

    with meta_parameters():
        model = transformers.DeepseekV3ForCausalLM._from_config(transformers.AutoConfig.from_pretrained(folder))
    try:
        load_pretrained(folder, model=model)
    except CheckpointError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(("family", "recipe"), [("deepseek_v3", "fp8"), ("gpt_oss", "w4a16")])
def test_cli_calibrates_and_exports_on_two_ranks(tmp_path, family, recipe):
    """``shardcal calibrate DIR --nproc-per-node 2`` on transformers 5's own save_pretrained checkpoint; the export
    loads in transformers with every expert's weights quantized (fp8 in DeepSeek's MLA, packed int4 experts)."""
    import numpy as np

    # GPT-OSS with I = H: one w4a16 group size (64) fits every Linear (transformers dequantizes fused experts with
    # one scheme; with fitted group sizes that differ between gate/up and down it fails, Qwen3-MoE alike)
    hf_model(family, **({"intermediate_size": 64} if family == "gpt_oss" else {})).save_pretrained(tmp_path / family)
    np.save(tmp_path / "ids.npy", _data(n=4).numpy())
    cmd = [sys.executable, "-m", "shardcal", "calibrate", str(tmp_path / family), "--recipe", recipe, "--out",
           str(tmp_path / "out"), "--data", str(tmp_path / "ids.npy"), "--batch-size", "2", "--nproc-per-node", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = _reload(tmp_path / "out")
    layer = reloaded.model.layers[1]
    if family == "deepseek_v3":
        assert layer.self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.gate.e_score_correction_bias.abs().sum() > 0
    else:
        assert torch.isfinite(hf_logits(reloaded, _data(n=1))).all()
    from safetensors import safe_open

    keys = set()
    for file in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" in keys
