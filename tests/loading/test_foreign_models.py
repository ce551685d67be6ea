"""Models shardcal did not write: transformers' classes and a user's module, calibrated and exported by duck typing.

References are independent of the runner: each quantizer's amax is what hooks on the plain model's own forward see
(max |x| of a Linear's input, per-channel max |w|, and for fused experts the routed tokens and the intermediate
computed here); 2 ranks are compared with 1; exports are loaded by transformers + compressed-tensors.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _hf_models import HF_FAMILIES, hf_logits, hf_model, register_tiny_lm, tiny_lm
from safetensors import safe_open
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import ModelLayoutError
from shardcal.export import export_checkpoint
from shardcal.quant.session import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

BATCH = 3


def _data(n: int = 6, length: int = 12, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _amax(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None}


def _reference_amax(
    model: nn.Module, data: torch.Tensor, names: list[str], all_experts: bool
) -> dict[str, torch.Tensor]:
    """The amax of every named quantizer, observed on the plain model's own forward with plain-torch hooks."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, value: torch.Tensor) -> None:
        seen[name] = value if name not in seen else torch.maximum(seen[name], value)

    hooks = []
    for name in names:
        owner, _, kind = name.rpartition(".")
        if kind == "input_quantizer" and owner in modules:
            hooks.append(modules[owner].register_forward_pre_hook(
                lambda m, args, name=name: keep(name, args[0].detach().abs().amax().reshape(1).float())
            ))  # fmt: skip
    experts = {n: m for n, m in modules.items() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)}

    def expert_hook(prefix: str):
        def observe(m: nn.Module, args: tuple) -> None:
            x, index = args[0], args[1]
            inter = m.down_proj.shape[-1]
            for e in range(m.gate_up_proj.shape[0]):
                tokens = x if all_experts else x[(index == e).any(dim=-1)]
                if tokens.shape[0] == 0:
                    continue
                h = m.act_fn(tokens @ m.gate_up_proj[e, :inter].T) * (tokens @ m.gate_up_proj[e, inter:].T)
                for proj, value in (("gate_proj", tokens), ("up_proj", tokens), ("down_proj", h)):
                    keep(f"{prefix}.{e}.{proj}.input_quantizer", value.detach().abs().amax().reshape(1).float())

        return observe

    for prefix, m in experts.items():
        hooks.append(m.register_forward_pre_hook(expert_hook(prefix)))
    extra = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with torch.no_grad():
        for s in range(0, data.shape[0], BATCH):
            model(data[s : s + BATCH], **extra)
    for h in hooks:
        h.remove()
    for name in names:  # weights: per output channel (w8a8-int8: channel, max)
        owner, _, kind = name.rpartition(".")
        if kind != "weight_quantizer":
            continue
        if owner in modules:
            w = modules[owner].weight
        else:  # fused experts: <experts>.<e>.<proj>
            exp_name, e, proj = owner.rsplit(".", 2)
            m, e = modules[exp_name], int(e)
            inter = m.down_proj.shape[-1]
            w = {
                "gate_proj": m.gate_up_proj[e, :inter],
                "up_proj": m.gate_up_proj[e, inter:],
                "down_proj": m.down_proj[e],
            }[proj]
        seen[name] = w.detach().abs().amax(dim=1, keepdim=True).float()
    return seen


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_layerwise_equals_the_models_own_forward(family):
    data = _data()
    model = hf_model(family)
    calibrate(model, data, "w8a8-int8", batch_size=BATCH, progress=False, calibrate_all_experts=False)
    got = _amax(model)
    want = _reference_amax(hf_model(family), data, list(got), all_experts=False)
    assert got.keys() == want.keys()
    bad = [n for n in got if not torch.equal(got[n], want[n])]
    assert not bad, (len(bad), bad[:3])
    if family == "qwen3_moe":
        assert sum(".mlp.experts." in n for n in got) == 2 * 4 * 3 * 2  # layers x experts x projections x (w, in)


def test_fused_experts_all_experts_mode_sees_every_token():
    data = _data()
    model = hf_model("qwen3_moe")
    calibrate(model, data, "w8a8-int8", batch_size=BATCH, progress=False)  # default: all experts observe all tokens
    got = {n: a for n, a in _amax(model).items() if ".experts." in n}
    want = _reference_amax(hf_model("qwen3_moe"), data, list(got), all_experts=True)
    assert all(torch.equal(got[n], want[n]) for n in got)


@pytest.mark.parametrize("recipe", ["w8a8-int8", "weight-only"])
def test_fused_experts_report_where_their_input_scales_come_from(recipe):
    """Every fused expert's tokens counted per block (the routing the model's own router makes), and its input scales
    from all tokens in all-experts mode; a recipe without input scales gives them none and the report says so."""
    data = _data()
    spec = (
        parse_recipe('[weight]\nformat = "int8"\ngranularity = "channel"\n', "r.toml")
        if recipe == "weight-only"
        else recipe
    )
    report = calibrate(hf_model("qwen3_moe"), data, spec, batch_size=BATCH, progress=False)
    source = "no input scales" if recipe == "weight-only" else "all tokens"
    blocks = {b: entry for layer in report.layers for b, entry in layer.moe.items()}
    assert sorted(blocks) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    top_k = hf_model("qwen3_moe").config.num_experts_per_tok
    for entry in blocks.values():
        assert entry["scales_from"] == [source] * 4
        assert sum(entry["routed_tokens"]) == data.numel() * top_k  # every real token to its top-k experts


def _calibrated_on_ranks(families: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    register_tiny_lm()
    out = {}
    for family in families:
        model = tiny_lm() if family == "tiny_lm" else hf_model(family)
        fsdp2_wrap(model)
        vocab = 64 if family == "tiny_lm" else 256
        calibrate(model, _data(n=7, vocab=vocab), "w8a8-int8", batch_size=BATCH, progress=False)
        out[family] = _amax(model)
    return out


def test_two_ranks_equal_one_rank():
    families = (*HF_FAMILIES, "tiny_lm")
    (single,) = run_on_ranks(1, _calibrated_on_ranks, families)
    for result in run_on_ranks(2, _calibrated_on_ranks, families):
        for family in families:
            assert result[family].keys() == single[family].keys()
            assert all(torch.equal(result[family][n], single[family][n]) for n in single[family]), family


def _wrapped_forward(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = hf_model(family)
    plain = hf_logits(model, _data(n=2))
    fsdp2_wrap(model)
    return plain, hf_logits(model, _data(n=2))


def test_plain_transformers_model_wraps_and_forward_is_unchanged():
    for plain, wrapped in run_on_ranks(2, _wrapped_forward, "llama"):
        assert torch.equal(plain, wrapped)


def _tensor_parallel_refused(folder: str) -> str:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, tp_plan="auto")
    try:
        fsdp2_wrap(model)
    except ModelLayoutError as exc:
        return str(exc)
    return "wrapped"


def test_tensor_parallel_loaded_model_is_refused(tmp_path):
    pytest.importorskip("accelerate")
    hf_model("llama").save_pretrained(tmp_path)
    for message in run_on_ranks(2, _tensor_parallel_refused, str(tmp_path)):
        assert "distributed by transformers' loader" in message or "device mesh" in message, message


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize(
    ("family", "recipe"),
    [("llama", "w8a8-int8"), ("qwen3", "fp8"), ("gemma3", "w8a8-int8"), ("phi3", "fp8"), ("qwen3_moe", "weight-only")],
)
def test_export_loads_in_transformers_with_the_fake_quant_logits(tmp_path, family, recipe):
    import transformers

    if recipe == "weight-only":  # transformers keeps fused experts dense: it applies their weights, not input scales
        recipe = parse_recipe('[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 16\n', "w4a16-g16.toml")
    data = _data()
    model = hf_model(family)
    calibrate(model, data, recipe, batch_size=BATCH, progress=False)
    want = hf_logits(model, data)
    out = export_checkpoint(model, tmp_path / "out", recipe=recipe)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors" and config["architectures"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(hf_logits(reloaded, data), want)
    if family == "qwen3_moe":
        scales = _stored(out, "mlp.experts.")
        assert {f"model.layers.1.mlp.experts.3.{p}.weight_scale" for p in ("gate_proj", "up_proj", "down_proj")} <= set(
            scales
        )
        assert all(bool(torch.isfinite(t).all() and (t > 0).all()) for k, t in scales.items() if k.endswith("_scale"))


def _stored(folder, needle: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if needle in k})
    return out


def test_shardcal_and_transformers_calibrate_the_same_checkpoint_alike(tmp_path):
    """Where shardcal has its own class, the same checkpoint calibrated both ways gives the same amax."""
    from shardcal.models import from_pretrained

    data = _data()
    for family in ("llama", "qwen3", "qwen3_moe"):
        theirs = hf_model(family)
        theirs.save_pretrained(tmp_path / family)
        ours = from_pretrained(tmp_path / family)
        for model in (theirs, ours):
            calibrate(model, data, "w8a8-int8", batch_size=BATCH, progress=False)
        a, b = _amax(theirs), _amax(ours)
        assert a.keys() == b.keys(), family
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"{family} {name}")


# ---------------------------------------------------------------------------------------------- a VLM


def _vlm_run(folder: str) -> dict:
    model = hf_model("llava")
    tower = {k: v.clone() for k, v in model.model.vision_tower.state_dict().items()}
    fsdp2_wrap(model)
    from torch.distributed.fsdp import FSDPModule

    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    calibrate(model, _data(vocab=299), "w8a8-int8", batch_size=BATCH, progress=False)
    quantized = sorted({n.rsplit(".", 1)[0] for n, _ in iter_quantizers(model)})
    out = export_checkpoint(model, f"{folder}/vlm")
    return {"units": units, "quantized": quantized, "tower": tower, "out": str(out)}


def test_vlm_tower_gets_its_own_unit_stays_unquantized_and_round_trips(tmp_path):
    import transformers

    (r,) = run_on_ranks(1, _vlm_run, str(tmp_path))
    assert {"model.vision_tower", "model.multi_modal_projector", "lm_head"} <= set(r["units"])
    assert r["quantized"] and all(n.startswith("model.language_model.layers.") for n in r["quantized"])
    stored = _stored(tmp_path / "vlm", "vision_tower")
    assert stored and all(torch.equal(stored[f"model.vision_tower.{k}"], v) for k, v in r["tower"].items())
    reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(r["out"])
    assert all(torch.equal(reloaded.model.vision_tower.state_dict()[k], v) for k, v in r["tower"].items())


# ---------------------------------------------------------------------------------------------- a user's module


def test_users_own_module_calibrates_and_exports(tmp_path):
    register_tiny_lm()
    data = _data(vocab=64)
    model = tiny_lm()
    report = calibrate(model, data, "w8a8-int8", batch_size=BATCH, progress=False)
    assert [entry.name for entry in report.layers] == ["stack.blocks.0", "stack.blocks.1", "stack.blocks.2"]
    got = _amax(model)
    want = _reference_amax(tiny_lm(), data, list(got), all_experts=False)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    with torch.no_grad():
        fake_quant = model.stack.blocks[1].mix.weight_quantizer(model.stack.blocks[1].mix.weight)
    out = export_checkpoint(model, tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "tiny_lm" and config["architectures"] == ["TinyLM"]
    stored = _stored(out, "stack.blocks.1.mix.")
    assert stored["stack.blocks.1.mix.weight"].dtype == torch.int8
    dequantized = stored["stack.blocks.1.mix.weight"].float() * stored["stack.blocks.1.mix.weight_scale"]
    assert torch.equal(dequantized, fake_quant)
    groups = config["quantization_config"]["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["Linear"]] and config["quantization_config"]["ignore"] == [
        "head"
    ]  # outside the decoder stack


# ---------------------------------------------------------------------------------------------- bad input


class _NoLayersReached(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, input_ids):
        return self.emb(input_ids)  # never calls its layers


class _BadOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(_Pooling() for _ in range(2))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


class _Pooling(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return {"hidden": self.proj(x)}


class _OddExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 16, 48))  # transposed: [E, H, 3I]
        self.down_proj = nn.Parameter(torch.randn(2, 16, 16))

    def forward(self, x):
        return x


class _OddLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = _OddExperts()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x)


class _OddMoE(_BadOutput):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_OddLayer() for _ in range(2))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_NoLayersReached(), "_NoLayersReached: its forward never called decoder layer layers.0"),
        (_BadOutput(), "layers.0: the decoder layer returned dict, not the hidden states"),
        (_OddMoE(), "layers.0.mlp.experts: a fused-experts layout shardcal does not know"),
    ],
)
def test_bad_models_get_one_line_errors_naming_the_module(model, message):
    with pytest.raises(ModelLayoutError) as info:
        calibrate(model, _data(vocab=64), "w8a8-int8", batch_size=BATCH, progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_padded_batches_use_the_models_own_masks(family):
    """Ragged rows: the model builds 4-D masks from the padding; each layer gets exactly its own, and the statistics
    count real tokens only (the reference takes each Linear's input at the unpadded positions)."""
    rows = [_data(n=1, length=length, seed=length)[0] for length in (12, 7, 10, 12, 5, 9)]
    model = hf_model(family)
    calibrate(model, rows, "w8a8-int8", batch_size=BATCH, progress=False)
    got = _amax(model)
    ref = hf_model(family)
    padded = torch.zeros(len(rows), 12, dtype=torch.long)
    mask = torch.zeros(len(rows), 12, dtype=torch.long)
    for i, r in enumerate(rows):
        padded[i, : r.numel()], mask[i, : r.numel()] = r, 1
    want: dict[str, torch.Tensor] = {}
    current: list[torch.Tensor] = []

    def observe(name: str, x: torch.Tensor) -> None:
        value = x[current[0].bool()].abs().amax().reshape(1)
        want[name] = torch.maximum(want.get(name, torch.zeros(1)), value)

    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: observe(n, a[0]))
        for n, m in ref.named_modules()
        if f"{n}.input_quantizer" in got
    ]
    with torch.no_grad():
        for s in range(0, len(rows), BATCH):
            current[:] = [mask[s : s + BATCH]]
            ref(padded[s : s + BATCH], attention_mask=mask[s : s + BATCH], use_cache=False)
    for h in hooks:
        h.remove()
    assert want and all(torch.equal(got[f"{n}.input_quantizer"], a) for n, a in want.items())


def _count_gathers(family: str, sqnr_tokens: int = 1024) -> int:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    model = hf_model(family)
    fsdp2_wrap(model)
    calls = []
    original = fpg.foreach_all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fpg.foreach_all_gather = counting
    try:
        calibrate(model, _data(n=8), "w8a8-int8", batch_size=2, progress=False, sqnr_tokens=sqnr_tokens)
    finally:
        fpg.foreach_all_gather = original
    return len(calls)


@pytest.mark.parametrize("sqnr_tokens", [1024, 1], ids=["sqnr-on-all-data", "sqnr-on-a-batchs-first-row"])
def test_gathers_root_once_each_layer_once_plus_the_first_batch_pass(sqnr_tokens):
    """One gather of the root, one per step, and layers 0..L-2 once more on the first batch (to learn which layers
    share arguments); the first layer is never gathered just to be skipped. The arguments of a batch's first row
    alone (the SQNR sample) are recorded with the batches: no gather more."""
    for count in run_on_ranks(2, _count_gathers, "llama", sqnr_tokens):
        assert count == 1 + 3 + 2, count


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_sqnr_of_a_batchs_first_row_uses_the_models_arguments_for_it(family):
    """The SQNR sample is the first row of a batch of 2: run alone with the arguments transformers gives it (Gemma 3:
    sliding and full layers, two argument groups; Qwen3-MoE: routed experts), its SQNR equals that of batches of
    one row, where the sample is the whole first batch."""
    data = _data(n=4)
    sqnr = [
        [e.sqnr_db for e in calibrate(hf_model(family), data, "w8a8-int8", batch_size=b, progress=False,
                                      sqnr_tokens=1).layers]
        for b in (2, 1)
    ]  # fmt: skip
    assert all(v is not None and math.isfinite(v) for v in sqnr[0])
    assert sqnr[0] == pytest.approx(sqnr[1], rel=1e-6)


# ---------------------------------------------------------------------------------------------- sharded loading


def _load_sharded(family: str, folder: str) -> dict:
    import transformers

    from shardcal.loading.build import meta_parameters
    from shardcal.loading.sharded import load_pretrained

    cls = type(hf_model(family))
    with meta_parameters():
        model = cls._from_config(transformers.AutoConfig.from_pretrained(folder))
    model = load_pretrained(folder, model=model)
    plan = model._shardcal_distribution_plan
    return {"logits": hf_logits(model, _data(n=2)), "read": plan["bytes_read"], "total": plan["model_bytes"]}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "llava"])
def test_load_pretrained_shards_any_module_each_rank_reading_its_rows(tmp_path, family):
    """A transformers module built on the meta device, loaded sharded from its own save_pretrained checkpoint
    (per-expert tensors for fused experts, Llava's original prefixes): logits equal transformers' own load."""
    hf_model(family).save_pretrained(tmp_path)
    reference = type(hf_model(family)).from_pretrained(tmp_path).eval()
    want = hf_logits(reference, _data(n=2))
    results = run_on_ranks(2, _load_sharded, family, str(tmp_path))
    for r in results:
        assert torch.equal(r["logits"], want)
    assert abs(sum(r["read"] for r in results) - results[0]["total"]) <= 0.01 * results[0]["total"]
    assert max(r["read"] for r in results) <= 0.55 * results[0]["total"]


def test_load_pretrained_names_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("llama").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["extra.norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (missing,) = run_on_ranks(1, _load_error, str(tmp_path), None)
    assert "1 parameter(s) of LlamaForCausalLM are not in the checkpoint: 'model.norm.weight'" in missing
    assert "name_map" in missing
    renamed = {"model.norm.weight": "extra.norm.weight"}
    (ok,) = run_on_ranks(1, _load_error, str(tmp_path), renamed)
    assert ok is None
    tensors["stray"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (unexpected,) = run_on_ranks(1, _load_error, str(tmp_path), renamed)
    assert "unexpected tensor(s) 'stray'" in unexpected


def _load_error(folder: str, name_map: dict | None) -> str | None:
    import transformers

    from shardcal.errors import CheckpointError
    from shardcal.loading.build import meta_parameters
    from shardcal.loading.sharded import load_pretrained

    with meta_parameters():
        model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.from_pretrained(folder))
    try:
        load_pretrained(folder, model=model, name_map=name_map)
    except CheckpointError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------- the command line


def test_cli_calibrates_a_model_type_shardcal_has_no_class_for(tmp_path):
    """Phi-3 has no shardcal class: --model-impl auto takes transformers' class, sharded over 2 ranks."""
    import subprocess
    import sys

    import numpy as np
    import transformers

    hf_model("phi3").save_pretrained(tmp_path / "phi3")
    np.save(tmp_path / "ids.npy", _data(n=4).numpy())
    cmd = [sys.executable, "-m", "shardcal", "calibrate", str(tmp_path / "phi3"), "--recipe", "fp8", "--out",
           str(tmp_path / "out"), "--data", str(tmp_path / "ids.npy"), "--batch-size", "2", "--nproc-per-node", "2"]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(reloaded).__name__ == "Phi3ForCausalLM"
    assert reloaded.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


def test_cli_model_impl_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from shardcal.cli import main as cli
    from shardcal.loading import foreign

    hf_model("phi3").save_pretrained(tmp_path / "phi3")
    capsys.readouterr()
    argv = ["calibrate", str(tmp_path / "phi3"), "--recipe", "fp8", "--out", str(tmp_path / "out")]
    assert cli.main([*argv, "--model-impl", "shardcal"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type 'phi3' is not supported (supported: llama, mistral" in err and "\n" not in err
    monkeypatch.setattr(foreign, "transformers_available", lambda: False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type 'phi3' has no shardcal class (shardcal has: llama" in err and "pip install transformers" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- algorithms


def _algorithm_recipe(algorithm: str, weight_only: bool, exclude: str = "", **params):
    targets = f'[targets]\nexclude = ["{exclude}"]\n' if exclude else ""
    quant = targets + (
        '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 16\n'
        if weight_only
        else '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
    )
    extra = "".join(f"{k} = {v}\n" for k, v in params.items())
    return parse_recipe(f'{quant}[algorithm]\nname = "{algorithm}"\n{extra}', f"{algorithm}.toml")


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3", "qwen3_moe"])
def test_smoothquant_folds_into_transformers_layers_keeping_their_function(family):
    """Norm -> Linear pairs found by duck typing (a norm whose output scales with its weight; Phi-3's fused qkv and
    gate_up; Gemma's (1 + w) norms, its pre-feedforward norm): folding leaves the full-precision function unchanged."""
    from shardcal.quant.session import set_quantizer_mode

    data = _data()
    model = hf_model(family)
    want = hf_logits(model, data)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "layernorm" in n}
    # fused experts store their quantized weights (disabling quantizers does not undo that): left out here
    recipe = _algorithm_recipe("smoothquant", weight_only=False, exclude="*.experts.*")
    calibrate(model, data, recipe, batch_size=BATCH, progress=False)
    changed = [n for n, p in model.named_parameters() if n in norms and not torch.equal(p, norms[n])]
    assert any("input_layernorm" in n for n in changed), changed
    if (
        family == "gemma3"
    ):  # Gemma norms compute x * (1 + w): 1 + w is divided by the scales; the MLP's is pre_feedforward's
        assert any("pre_feedforward_layernorm" in n for n in changed), changed
        assert not any("post_attention_layernorm" in n for n in changed), changed
    set_quantizer_mode(model, "disabled")
    torch.testing.assert_close(hf_logits(model, data), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family, overrides",
    [("llama", {}), ("gemma3", {"head_dim": 32})],  # Gemma-3-270M's shape: heads x head_dim (128) != hidden (64)
)
@pytest.mark.parametrize("algorithm", ["gptq", "awq", "autoround"])
def test_weight_algorithms_beat_round_to_nearest_on_transformers_models(algorithm, family, overrides):
    """On Gemma no norm can take a scale (x * (1 + w)): AWQ's pairs are v -> o and up -> down only, and the clipping
    of q / k / v reads their own inputs, not o_proj's."""
    data = _data(n=12)
    want = hf_logits(hf_model(family, **overrides), data)
    errors = {}
    for name in ("rtn", algorithm):
        model = hf_model(family, **overrides)
        params = {"iters": 16} if name == "autoround" else {}
        calibrate(model, data, _algorithm_recipe(name, weight_only=True, **params), batch_size=BATCH, progress=False)
        errors[name] = (hf_logits(model, data) - want).pow(2).mean().item()
    assert errors[algorithm] < errors["rtn"], errors


def test_an_exclude_pattern_can_name_fused_experts(tmp_path):
    """``exclude = ["model.layers.*.mlp.experts"]`` names transformers' fused 3-D experts as a whole: the pre-check
    accepts it, and calibration quantizes every Linear of the layers but no expert (the module's own names say)."""
    from shardcal.calib.recipes import parse_recipe
    from shardcal.plan.preflight import check_recipe_fits

    text = '[targets]\nexclude = ["model.layers.*.mlp.experts"]\n[weight]\nformat = "int8"\ngranularity = "channel"\n'
    recipe = parse_recipe(text, "no-experts.toml")
    model = hf_model("qwen3_moe")
    linears = {n for n, m in model.model.layers.named_modules(prefix="model.layers") if isinstance(m, nn.Linear)}
    quantized = check_recipe_fits(hf_model("qwen3_moe"), recipe)
    assert quantized and not any(".experts" in n for n in quantized)
    assert set(quantized) == {n for n in linears if not n.endswith("mlp.gate")}  # the routers never
    calibrate(model, _data(), recipe, batch_size=BATCH, progress=False)
    assert not any(".experts" in n for n in _amax(model))


def test_auto_dtype_is_the_dtype_holding_most_values(tmp_path):
    """``dtype="auto"`` for a module built elsewhere: the floating dtype of at least 16 bits holding most values —
    one bf16 matrix outweighs three small float32 vectors; 8-bit codes (a published FP8 weight) never count."""
    import torch
    from safetensors.torch import save_file

    from shardcal.loading.build import module_dtype
    from shardcal.models.checkpoint import CheckpointReader

    tensors = {
        "w": torch.zeros(64, 64, dtype=torch.bfloat16),
        "a": torch.zeros(8),
        "b": torch.zeros(8),
        "c": torch.zeros(8),
        "q": torch.zeros(128, 128).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        assert module_dtype("auto", reader, list(tensors)) == torch.bfloat16
        assert module_dtype("auto", reader, ["a", "q"]) == torch.float32
        assert module_dtype("auto", reader, ["q"]) == torch.float32  # none of 16 bits: float32
        assert module_dtype("float16", reader, ["w"]) == torch.float16
    assert module_dtype("auto", None, ()) == torch.float32  # no weights
