"""KV-cache quantization ([kv_cache]): k/v scales equal to the amax of the keys and values transformers caches
(after RoPE and q/k norms, padding left out), for shardcal's models and transformers' own; 2 ranks = 1 rank; resume;
export with compressed-tensors' kv_cache_scheme; exact reload; transformers + compressed-tensors load it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after
from safetensors import safe_open

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import ModelLayoutError, RecipeError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import iter_quantizers, set_quantizer_mode
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint, randomize_

pytestmark = pytest.mark.numerics

KV = '[kv_cache]\nformat = "fp8_e4m3"\n'
FP8_KV = '[weight]\nformat = "fp8_e4m3"\ngranularity = "channel"\n' + KV  # weight-only + KV cache
W8A8_KV = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n' + KV


def _recipe(text: str = FP8_KV):
    return parse_recipe(text, "kv.toml")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows of 12 tokens; rows 1 and 3 right-padded (their last tokens are padding)."""
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    return ids, mask


def _batches() -> list[dict[str, torch.Tensor]]:
    ids, mask = _data()
    return [{"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]} for i in range(4)]


def _reference_amax(hf: torch.nn.Module, layers: int) -> torch.Tensor:
    """[layers, 2]: max |key| and |value| over the real tokens transformers caches (DynamicCache), batches of 2."""
    transformers = pytest.importorskip("transformers")
    import inspect

    ids, mask = _data()
    out = torch.zeros(layers, 2)
    keyword = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    for b in (0, 2):
        cache = transformers.DynamicCache(config=hf.config)
        with torch.no_grad():
            hf(ids[b : b + 2], attention_mask=mask[b : b + 2], use_cache=True, **{keyword: cache})
        real = mask[b : b + 2].bool()
        for i, layer in enumerate(cache.layers):  # [batch, kv_heads, seq, head_dim]
            for j, t in enumerate((layer.keys, layer.values)):
                out[i, j] = torch.maximum(out[i, j], t.transpose(1, 2)[real].abs().max())
    return out


def _kv_amax(model: torch.nn.Module) -> torch.Tensor:
    qs = [q for n, q in iter_quantizers(model) if ".kv_cache_quantizer." in n]
    return torch.stack([q.amax.reshape(()) for q in qs]).reshape(-1, 2)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_scales_are_the_amax_of_the_cached_keys_and_values(tmp_path, model_type):
    """shardcal's model and transformers' own, calibrated by shardcal, against transformers' DynamicCache contents
    (qwen3: keys after its k_norm and RoPE). Padding positions are left out."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_checkpoint(tmp_path, model_type, num_hidden_layers=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = _reference_amax(hf, 2)
    ours = from_pretrained(path)
    calibrate(ours, _batches(), _recipe(), batch_size=2, progress=False)
    torch.testing.assert_close(_kv_amax(ours), want, rtol=1e-6, atol=0)
    calibrate(hf, _batches(), _recipe(), batch_size=2, progress=False)  # transformers' layers take cache=...
    assert torch.equal(_kv_amax(hf), want)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_sqnr_of_a_padded_sequence_run_alone_with_the_kv_cache(tmp_path, model_type):
    """The SQNR sample is the first (padded) sequence, part of a batch of 2: run on its own, with the arguments the
    model gives it alone (transformers' own mask and rotary tables) and its own KV cache, its SQNR equals that of a
    run whose batches hold one sequence each (where the sample is the whole first batch)."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny_checkpoint(tmp_path, model_type, num_hidden_layers=2)
    data = [_batches()[i] for i in (1, 0, 2, 3)]  # row 1 first: 8 real tokens, 4 of padding
    for model in (from_pretrained(path), transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)):
        sqnr = [
            [e.sqnr_db for e in calibrate(model.eval(), data, _recipe(W8A8_KV), batch_size=b, progress=False,
                                          sqnr_tokens=1).layers]
            for b in (2, 1)
        ]  # fmt: skip
        assert all(s is not None and math.isfinite(s) for s in sqnr[0])
        assert sqnr[0] == pytest.approx(sqnr[1], rel=1e-6)


def _cfg() -> dict:
    return dict(TINY_CONFIGS["llama"], num_hidden_layers=3)


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(_cfg()))
    randomize_(model)
    return model.eval()


def _run(interrupt: int | None = None, directory: str | None = None) -> dict:
    model = _model()
    fsdp2_wrap(model)
    try:
        with interrupt_after(interrupt):
            report = calibrate(
                model, _batches(), _recipe(W8A8_KV), batch_size=2, progress=False, checkpoint_dir=directory
            )
    except CalibrationInterrupted:
        return {"interrupted": True}
    ids, _ = _data()
    with torch.no_grad():
        logits = model(ids)
    amax = {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}
    return {"interrupted": False, "amax": amax, "logits": logits, "sqnr": [x.sqnr_db for x in report.layers]}


def test_two_ranks_equal_one_rank_and_resume(tmp_path):
    """The k/v amax merge exactly; a checkpoint written by 2 ranks resumes on 2 or on 1 (elastic) to the same."""
    (single,) = run_on_ranks(1, _run)
    assert any(".kv_cache_quantizer.k_quantizer" in n for n in single["amax"])
    two = run_on_ranks(2, _run)
    resumed = []
    for resumed_on in (2, 1):
        folder = str(tmp_path / f"ckpt{resumed_on}")
        assert all(r["interrupted"] for r in run_on_ranks(2, _run, 1, folder))
        resumed += run_on_ranks(resumed_on, _run, None, folder)
    for got in two + resumed:
        assert got["amax"].keys() == single["amax"].keys()
        for name, value in single["amax"].items():
            assert torch.equal(got["amax"][name], value), name
        assert torch.equal(got["logits"], single["logits"]) and got["sqnr"] == single["sqnr"]


def test_export_reload_and_transformers(tmp_path):
    model = _model()
    report = calibrate(model, _batches(), _recipe(W8A8_KV), batch_size=2, progress=False)
    assert "model.layers.0.self_attn.kv_cache_quantizer.v_quantizer" in report.layers[0].quantizers
    out = export_checkpoint(model, tmp_path / "kv", report=report)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    want = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "tensor",
        "dynamic": False,
    }
    assert qc["kv_cache_scheme"] == want
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for i in range(3):
        kv = model.model.layers[i].self_attn.kv_cache_quantizer
        for role, q in (("k", kv.k_quantizer), ("v", kv.v_quantizer)):
            key = f"model.layers.{i}.self_attn.{role}_scale"
            with safe_open(str(out / index[key]), framework="pt") as f:
                stored = f.get_tensor(key)
            assert stored.dtype == torch.float32 and torch.equal(stored, q.amax / 448.0), key
    ids, _ = _data()
    with torch.no_grad():
        calibrated = model(ids)
        reloaded = from_pretrained(out)
        assert torch.equal(reloaded(ids), calibrated)  # the reloaded attention quantizes K/V the same way
        set_quantizer_mode(model.model.layers[0].self_attn.kv_cache_quantizer, "disabled")
        assert not torch.equal(model(ids), calibrated)  # the KV cache quantization is really applied
    ct = pytest.importorskip("compressed_tensors.quantization")
    assert ct.QuantizationArgs(**want).model_dump(mode="json") == want
    parsed = ct.QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.strategy == "tensor" and parsed.kv_cache_scheme.num_bits == 8
    transformers = pytest.importorskip("transformers")
    # compressed-tensors 0.20.1 with transformers 5.24 drops k_scale / v_scale on load (its attention check looks
    # for a past_key_value(s) argument; 5.24's is `cache`), so only loading and the config can be checked here.
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(hf(ids).logits).all()


def test_export_refuses_unusable_kv_scales(tmp_path):
    """An infinite k amax (a k_scale no runtime can use) is never written: the error names the tensor."""
    from shardcal.errors import ExportError

    model = _model()
    calibrate(model, _batches(), _recipe(FP8_KV), batch_size=2, progress=False)
    q = model.model.layers[1].self_attn.kv_cache_quantizer.k_quantizer
    q.set_amax(torch.full_like(q.amax, float("inf")))
    with pytest.raises(ExportError, match=r"^model\.layers\.1\.self_attn\.k_scale: 1 of 1 scale value\(s\) are zero"):
        export_checkpoint(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_recipe_and_model_errors():
    with pytest.raises(RecipeError, match=r"kv\.toml: key 'kv_cache\.format'"):
        _recipe('[weight]\nformat = "int8"\n[kv_cache]\nformat = "int8"\n')
    with pytest.raises(RecipeError, match=r"key 'kv_cache\.granularity'"):
        _recipe('[weight]\nformat = "int8"\n[kv_cache]\nformat = "fp8_e4m3"\ngranularity = "channel"\n')
    from _hf_models import register_tiny_lm, tiny_lm

    register_tiny_lm()
    with pytest.raises(ModelLayoutError, match=r"stack\.blocks\.0: \[kv_cache\] found no attention"):
        calibrate(tiny_lm(), torch.randint(0, 64, (2, 8)), _recipe(), batch_size=2, progress=False)
