"""Layers kept safe: a recipe's [fallback] recalibrates decoder layers whose output SQNR is under its floor with
another scheme (int8 weight-only, or full precision); exported as their own config group; reload, transformers,
2 ranks = 1 rank, resume."""

from __future__ import annotations

import json

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import RecipeError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import QuantLinear, iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.numerics

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
W8A8 = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
INT8_WEIGHT_ONLY = (
    '[fallback]\nmin_layer_sqnr_db = {floor}\n[fallback.weight]\nformat = "int8"\ngranularity = "channel"\n'
)
FULL = "[fallback]\nmin_layer_sqnr_db = {floor}\nfull_precision = true\n"
SQ = '[algorithm]\nname = "smoothquant"\nalpha = 0.8\n'


def _model() -> CausalLM:
    """Layer 1 has outlier channels 60x larger: per-tensor int8 inputs wreck it, the others are fine."""
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model, seed=0)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[:2] *= 60.0
        model.model.layers[1].post_attention_layernorm.weight[3:5] *= 60.0
    return model.eval()


def _data(n: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _recipe(fallback: str, floor: float, algorithm: str = ""):
    return parse_recipe(W8A8 + algorithm + fallback.format(floor=floor), "mixed.toml")


def _floor() -> float:
    """A floor between layer 1's SQNR under plain W8A8 and the other layers' (so that exactly layer 1 falls back)."""
    report = calibrate(_model(), _data(), parse_recipe(W8A8, "w8a8.toml"), batch_size=2, progress=False)
    sqnr = [x.sqnr_db for x in report.layers]
    assert sqnr[1] + 6 < min(sqnr[0], sqnr[2]), sqnr
    return (sqnr[1] + min(sqnr[0], sqnr[2])) / 2


@pytest.fixture(scope="module")
def floor() -> float:
    return _floor()


def test_layer_under_the_floor_gets_int8_weight_only(floor):
    plain = _model()
    calibrate(plain, _data(), parse_recipe(W8A8, "w8a8.toml"), batch_size=2, progress=False)
    model = _model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = calibrate(model, _data(), _recipe(INT8_WEIGHT_ONLY, floor), batch_size=2, progress=False)
    assert [x.scheme for x in report.layers] == ["recipe", "fallback", "recipe"]
    assert report.fallback_layers == ["model.layers.1"]
    assert report.layers[1].recipe_sqnr_db < floor <= report.layers[1].sqnr_db
    for name, m in model.model.layers[1].named_modules(prefix="model.layers.1"):
        if isinstance(m, nn.Linear):  # int8 weight-only: per-channel max of the original weight, no input quantizer
            assert isinstance(m, QuantLinear) and m.input_quantizer is None, name
            want = original[f"{name}.weight"].abs().amax(dim=1, keepdim=True)
            assert torch.equal(m.weight_quantizer.amax, want), name
    # the other layers are calibrated exactly as without a floor (propagate "fp": their inputs do not change)
    theirs = {n: q.amax for n, q in iter_quantizers(plain) if not n.startswith("model.layers.1.")}
    ours = {n: q.amax for n, q in iter_quantizers(model) if not n.startswith("model.layers.1.")}
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[n], ours[n]) for n in theirs)


def test_weights_are_restored_before_the_fallback(floor):
    """SmoothQuant folded scales into layer 1 under the recipe; the int8 weight-only fallback (no input quantizers,
    nothing to smooth) starts again from the original weights."""
    model = _model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = calibrate(model, _data(), _recipe(INT8_WEIGHT_ONLY, floor + 100, SQ), batch_size=2, progress=False)
    assert report.fallback_layers == [f"model.layers.{i}" for i in range(3)]  # a floor no layer reaches
    for name, p in model.named_parameters():
        assert torch.equal(p, original[name]), name


def test_full_precision_fallback_and_export(floor, tmp_path):
    model = _model()
    report = calibrate(model, _data(), _recipe(FULL, floor), batch_size=2, progress=False)
    assert report.fallback_layers == ["model.layers.1"] and report.layers[1].sqnr_db == float("inf")
    assert not any(isinstance(m, QuantLinear) for m in model.model.layers[1].modules())
    out = export_checkpoint(model, tmp_path / "full", recipe=_recipe(FULL, floor))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [f"model.layers.1.{p}" for p in ("self_attn.q_proj", "mlp.down_proj")] <= qc["ignore"]
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(_data(2, seed=3)), model(_data(2, seed=3)))


def test_mixed_export_has_its_own_config_group_and_loads(floor, tmp_path):
    model = _model()
    recipe = _recipe(INT8_WEIGHT_ONLY, floor)
    report = calibrate(model, _data(), recipe, batch_size=2, progress=False)
    out = export_checkpoint(model, tmp_path / "mixed", recipe=recipe, report=report)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    groups = {g["format"]: g for g in qc["config_groups"].values()}
    fallback = groups["pack-quantized"]  # int8 weight-only
    assert fallback["input_activations"] is None and all(t.startswith("model.layers.1.") for t in fallback["targets"])
    assert len(fallback["targets"]) == 7 and len(groups["int-quantized"]["targets"]) == 14
    data = _data(2, seed=3)
    with torch.no_grad():
        want = model(data)
        assert torch.equal(from_pretrained(out)(data), want)
    ct = pytest.importorskip("compressed_tensors.quantization")
    ct.QuantizationConfig.model_validate(qc)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(hf(data).logits, want)


def _run(floor: float, interrupt: int | None = None, directory: str | None = None) -> dict:
    model = _model()
    fsdp2_wrap(model)
    recipe = _recipe(INT8_WEIGHT_ONLY, floor, SQ)
    try:
        with interrupt_after(interrupt):
            report = calibrate(model, _data(n=6), recipe, batch_size=2, progress=False, checkpoint_dir=directory)
    except CalibrationInterrupted:
        return {"interrupted": True}
    state = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    state.update({n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None})
    with torch.no_grad():
        logits = model(_data(2, seed=3))
    return {"state": state, "logits": logits, "schemes": [x.scheme for x in report.layers], "interrupted": False}


def test_two_ranks_equal_one_rank_and_resume(floor, tmp_path):
    (single,) = run_on_ranks(1, _run, floor)
    assert single["schemes"] == ["recipe", "fallback", "recipe"]
    resumed = []
    for resumed_on in (2, 1):  # the fallback layer's quantizers and weights come back on any world size
        folder = str(tmp_path / f"ckpt{resumed_on}")
        assert all(r["interrupted"] for r in run_on_ranks(2, _run, floor, 2, folder))
        resumed += run_on_ranks(resumed_on, _run, floor, None, folder)
    for got in run_on_ranks(2, _run, floor) + resumed:
        assert got["schemes"] == single["schemes"] and got["state"].keys() == single["state"].keys()
        assert all(torch.equal(got["state"][n], v) for n, v in single["state"].items())
        assert torch.equal(got["logits"], single["logits"])


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("[fallback]\nfull_precision = true\n", "fallback.min_layer_sqnr_db"),
        ("[fallback]\nmin_layer_sqnr_db = 20\n", "fallback"),
        ('[fallback]\nmin_layer_sqnr_db = 20\nfull_precision = true\n[fallback.weight]\nformat = "int8"\n', "fallback"),
        ('[fallback]\nmin_layer_sqnr_db = "high"\nfull_precision = true\n', "fallback.min_layer_sqnr_db"),
        ('[fallback]\nmin_layer_sqnr_db = 20\n[fallback.weight]\nformat = "int3"\n', "fallback.weight.format"),
        ("[fallback]\nmin_layer_sqnr_db = 20\nfloor = 3\nfull_precision = true\n", "fallback.floor"),
    ],
)
def test_recipe_errors_name_the_key(table, key):
    with pytest.raises(RecipeError, match=rf"mixed\.toml: key '{key}'"):
        parse_recipe(W8A8 + table, "mixed.toml")
