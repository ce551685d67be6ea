"""The calibration runner on real gloo ranks (world sizes 1 and 2) against unsharded references."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after
from torch import nn

from shardcal.calib.attach import quantize_modules
from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.calib.report import CalibrationReport, LayerReport
from shardcal.calib.runner import calibrate
from shardcal.errors import DataError, ModelLayoutError
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.quant.session import begin_pass_all, end_pass_all, finish_calibration_all, start_calibration_all
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _numerics import FLOAT_RTOL, ROUNDING_RTOL, assert_close_but_for_rounding_flips
from _tiny_models import TINY_CONFIGS, randomize_, starve_experts_2_and_3

pytestmark = pytest.mark.numerics

LLAMA = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)


def _model(cfg: dict = LLAMA, seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=seed)
    return model.eval()


def _data(n: int = 7, seq: int = 16, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _amax_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None}


# ------------------------------------------------------------ layer-wise == whole-model reference
def _whole_model_reference(
    recipe: str, data: torch.Tensor, batch_size: int, cfg: dict = LLAMA
) -> dict[str, torch.Tensor]:
    """Observers on everywhere, one full forward per batch, in one process: what layer-wise must reproduce."""
    model = _model(cfg)
    quantize_modules(model, load_recipe(recipe))
    quantizers = [q for n, q in iter_quantizers(model) if not n.endswith("weight_quantizer")]
    for n, q in iter_quantizers(model):
        if n.endswith("weight_quantizer"):
            q.calibrate_from(q_weight(model, n))
            q.mode = "disabled"
    start_calibration_all(quantizers)
    begin_pass_all(quantizers, 0)
    with torch.no_grad():
        for s in range(0, data.shape[0], batch_size):
            model(data[s : s + batch_size])
    end_pass_all(quantizers, None)
    finish_calibration_all(quantizers)
    return _amax_state(model)


def q_weight(model: nn.Module, quantizer_name: str) -> torch.Tensor:
    return model.get_submodule(quantizer_name.rsplit(".", 1)[0]).weight


TWO_PASS = """
name = "two-pass"
[weight]
format = "int4"
granularity = "group"
group_size = 32
observer = "mse"
[input]
format = "int8"
granularity = "tensor"
observer = { name = "percentile", percentile = 99.9 }
"""


def _recipe(name: str):
    from shardcal.calib.recipes import parse_recipe

    return parse_recipe(TWO_PASS, "two-pass.toml") if name == "two-pass" else name


def _layerwise(
    recipe: str, data: torch.Tensor, batch_size: int, wrap: bool, shard_root: bool = True, propagate: str = "fp"
):
    model = _model()
    if wrap:
        fsdp2_wrap(model, shard_root=shard_root)
    report = calibrate(model, data, _recipe(recipe), batch_size=batch_size, progress=False, propagate=propagate)
    with torch.no_grad():
        logits = model(data[:2])
    return _amax_state(model), [layer_report.sqnr_db for layer_report in report.layers], logits


def test_layerwise_equals_whole_model_forward():
    data = _data()
    want = _whole_model_reference("w8a8-int8", data, batch_size=3)
    ((got, sqnr, _),) = run_on_ranks(1, _layerwise, "w8a8-int8", data, 3, False)
    assert set(got) == set(want) and len(got) == 4 * 7 * 2
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert all(s is not None and s > 20 for s in sqnr)


@pytest.mark.parametrize("shard_root", [True, False])
def test_world_size_two_equals_one_bit_exact(shard_root):
    data = _data(n=7)  # 3 batches of 3, 3, 1 rows: uneven over 2 ranks
    (single,) = run_on_ranks(1, _layerwise, "w8a8-int8", data, 3, True, shard_root)
    for amax, sqnr, logits in run_on_ranks(2, _layerwise, "w8a8-int8", data, 3, True, shard_root):
        assert amax.keys() == single[0].keys()
        for name in amax:
            assert torch.equal(amax[name], single[0][name]), name
        assert sqnr == single[1]
        assert torch.equal(logits, single[2])


def test_rank_without_batches_and_two_pass_observers():
    data = _data(n=2)  # one batch of 2 on 2 ranks: rank 1 has none and must not hang
    (single,) = run_on_ranks(1, _layerwise, "two-pass", data, 4, True, True, "qdq")
    for amax, _, logits in run_on_ranks(2, _layerwise, "two-pass", data, 4, True, True, "qdq"):
        for name in amax:
            assert torch.equal(amax[name], single[0][name]), name
        assert torch.equal(logits, single[2])


ASYMMETRIC_MSE = """
name = "asym-mse"
[weight]
format = "int4"
granularity = "group"
group_size = 32
symmetric = false
observer = { name = "mse", grid = 40, max_shrink = 0.3 }
"""


def _weight_search_counts(recipe_text: str | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Calibrate with a counting ``calibrate_from``; return this rank's count and every quantizer's amax / amin."""
    from shardcal.quant.quantizer import TensorQuantizer

    calls = []
    original = TensorQuantizer.calibrate_from
    TensorQuantizer.calibrate_from = lambda self, *a, **k: calls.append(self.name) or original(self, *a, **k)
    try:
        model = _model()
        fsdp2_wrap(model)
        recipe = parse_recipe(recipe_text, "r.toml") if recipe_text else _recipe("two-pass")
        calibrate(model, _data(n=4), recipe, batch_size=2, progress=False)
    finally:
        TensorQuantizer.calibrate_from = original
    ranges = {n + ".amax": q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}
    ranges |= {n + ".amin": q.amin.clone() for n, q in iter_quantizers(model) if q.amin is not None}
    return len(calls), ranges


@pytest.mark.parametrize("recipe_text", [None, ASYMMETRIC_MSE], ids=["mse-symmetric", "mse-asymmetric"])
def test_ranks_share_the_weight_search_and_get_one_ranks_bits(recipe_text):
    ((alone, want),) = run_on_ranks(1, _weight_search_counts, recipe_text)
    shared = run_on_ranks(2, _weight_search_counts, recipe_text)
    assert alone == 4 * 7  # every Linear's weight, once
    assert sum(n for n, _ in shared) == alone and all(0 < n < alone for n, _ in shared)  # each searched once
    for _, got in shared:
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


# ------------------------------------------------------------ one gather per step
def _count_gathers(propagate: str) -> dict:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    model = _model()
    fsdp2_wrap(model)
    calls = []
    original = fpg.foreach_all_gather

    def counting(fsdp_params, *args, **kwargs):
        calls.append(fsdp_params[0]._param_fqn if hasattr(fsdp_params[0], "_param_fqn") else "?")
        return original(fsdp_params, *args, **kwargs)

    fpg.foreach_all_gather = counting
    try:
        calibrate(model, _data(n=8), "w8a8-int8", batch_size=2, progress=False, propagate=propagate)
    finally:
        fpg.foreach_all_gather = original
    return dict(count=len(calls), names=calls)


@pytest.mark.parametrize("propagate", ["fp", "qdq"])
def test_each_layer_gathered_once(propagate):
    for r in run_on_ranks(2, _count_gathers, propagate):
        # one gather of the root (embeddings) + one per decoder layer; lm_head is never gathered
        assert r["count"] == 1 + 4, r


# ------------------------------------------------------------ checkpoint / resume
def _resume_run(directory: str, interrupt: int | None) -> dict:
    model = _model()
    fsdp2_wrap(model)
    data = _data(n=6)
    try:
        with interrupt_after(interrupt):
            report = calibrate(
                model, data, "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=directory, propagate="qdq"
            )
    except CalibrationInterrupted:
        return dict(interrupted=True)
    with torch.no_grad():
        logits = model(data[:2])
    return dict(
        interrupted=False,
        amax=_amax_state(model),
        sqnr=[layer_report.sqnr_db for layer_report in report.layers],
        logits=logits,
        resumed=report.resumed_from_layer,
    )


def test_kill_and_resume_bit_identical(tmp_path):
    (tmp_path / "a").mkdir()
    full = run_on_ranks(2, _resume_run, str(tmp_path / "a"), None)
    first = run_on_ranks(2, _resume_run, str(tmp_path / "b"), 2)
    assert all(r["interrupted"] for r in first)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["completed_layers"] == 2
    second = run_on_ranks(2, _resume_run, str(tmp_path / "b"), None)
    for want, got in zip(full, second):
        assert got["resumed"] == 2
        assert want["amax"].keys() == got["amax"].keys()
        for name in want["amax"]:
            assert torch.equal(want["amax"][name], got["amax"][name]), name
        assert want["sqnr"] == got["sqnr"]
        assert torch.equal(want["logits"], got["logits"])
    # A finished checkpoint resumes to the end at once, on any world size.
    for world_size in (2, 1):
        again = run_on_ranks(world_size, _resume_run, str(tmp_path / "b"), None)
        assert again[0]["resumed"] == 4 and torch.equal(again[0]["logits"], full[0]["logits"])


def _nonfinite_runs(directory: str) -> dict:
    """Non-finite layer outputs: one batch's (an infinite embedding row, only in batch 2), and a corrupt layer 2's
    (every batch, checkpointed); then that run again, resumed from its checkpoint."""
    import os

    from shardcal.errors import NumericsError

    def attempt(model: nn.Module, data: torch.Tensor, folder: str | None = None) -> str:
        fsdp2_wrap(model)
        try:
            calibrate(model, data, "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=folder)
        except NumericsError as exc:
            return str(exc)
        return "no error"

    def corrupt_model() -> CausalLM:
        model = _model()
        with torch.no_grad():
            model.model.layers[2].mlp.down_proj.weight[0, 0] = float("nan")
        return model

    data = _data(n=6).clamp(max=254)
    poisoned = data.clone()
    poisoned[4, 3] = 255  # row 4: global batch 2, which rank 1 owns on 2 ranks
    model = _model()
    with torch.no_grad():
        model.model.embed_tokens.weight[255] = float("inf")
    one_batch = attempt(model, poisoned)
    folder = f"{directory}/ckpt"
    corrupt_layer = attempt(corrupt_model(), data, folder)
    manifest = json.loads(Path(folder, "manifest.json").read_text())
    stray = sorted(set(os.listdir(folder)) - set(manifest["files"]) - {"manifest.json"})
    model = corrupt_model()
    calls = {0: 0, 2: 0}
    for i in calls:
        model.model.layers[i].register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    again = attempt(model, data, folder)
    return dict(
        one_batch=one_batch,
        corrupt_layer=corrupt_layer,
        completed=manifest["completed_layers"],
        stray=stray,
        again=again,
        calls=calls,
    )


def test_non_finite_outputs_stop_every_rank_naming_layer_and_batch(tmp_path):
    """NaN/inf in a layer's output stops every rank with the same line naming the layer and the (global) batch;
    the checkpoint stays valid at the previous layer: a rerun resumes there (layers 0 and 1 are not run again)."""
    for world_size in (1, 2):
        for r in run_on_ranks(world_size, _nonfinite_runs, str(tmp_path / str(world_size))):
            on = " on rank 1" if world_size == 2 else ""
            assert r["one_batch"].startswith(
                f"model.layers.0: the layer's output holds NaN or infinite values (batch 2{on})"
            )
            on = " on rank 0" if world_size == 2 else ""
            assert r["corrupt_layer"].startswith(
                f"model.layers.2: the layer's output holds NaN or infinite values (batch 0{on})"
            )
            assert r["completed"] == 2 and r["stray"] == []
            assert r["again"] == r["corrupt_layer"] and r["calls"][0] == 0 and r["calls"][2] > 0


@pytest.mark.parametrize(("written_on", "resumed_on"), [(2, 1), (1, 2)])
def test_elastic_resume_on_another_world_size(tmp_path, written_on, resumed_on):
    """A checkpoint written by N ranks resumes on M ranks to the same amax and logits as an uninterrupted run."""
    (full,) = run_on_ranks(1, _resume_run, str(tmp_path / "full"), None)
    assert all(r["interrupted"] for r in run_on_ranks(written_on, _resume_run, str(tmp_path / "ckpt"), 2))
    for got in run_on_ranks(resumed_on, _resume_run, str(tmp_path / "ckpt"), None):
        assert got["resumed"] == 2
        assert all(torch.equal(full["amax"][n], got["amax"][n]) for n in full["amax"])
        assert torch.equal(full["logits"], got["logits"])


def _resume_errors(directory: str) -> str:
    from shardcal.errors import CalibrationCheckpointError

    model = _model(seed=5)  # other weights than the checkpoint's
    try:
        calibrate(model, _data(n=6), "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=directory)
    except CalibrationCheckpointError as exc:
        return str(exc)
    return "no error"


def test_checkpoint_from_other_model_or_corrupt_is_refused(tmp_path):
    run_on_ranks(1, _resume_run, str(tmp_path), 2)
    assert "different model weights" in run_on_ranks(1, _resume_errors, str(tmp_path))[0]
    acts = next(tmp_path.glob("activations-*"))
    acts.write_bytes(acts.read_bytes()[:-3] + b"xyz")
    (result,) = run_on_ranks(1, _resume_run_expect_error, str(tmp_path))
    assert "SHA-256" in result and acts.name in result
    (tmp_path / "manifest.json").write_text("{not json")
    (result,) = run_on_ranks(1, _resume_run_expect_error, str(tmp_path))
    assert "corrupt manifest" in result


def _resume_run_expect_error(directory: str) -> str:
    from shardcal.errors import CalibrationCheckpointError

    try:
        _resume_run(directory, None)
    except CalibrationCheckpointError as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------ MoE
MOE = dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=2)


def _moe_model_with_dead_expert() -> CausalLM:
    """Experts 2 and 3 never get a token: a constant positive residual feature makes the router pick 0 and 1."""
    model = _model(MOE)
    starve_experts_2_and_3(model)
    return model


def _moe_run(all_experts: bool, recipe: str = "w8a8-int8") -> dict:
    model = _moe_model_with_dead_expert()
    fsdp2_wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = parse_recipe(recipe, "r.toml") if recipe.startswith("[") else recipe
        report = calibrate(model, _data(n=4), recipe, batch_size=2, progress=False, calibrate_all_experts=all_experts)
    observed = {
        n: q.num_observed for n, q in iter_quantizers(model) if "experts" in n and n.endswith("input_quantizer")
    }
    return dict(
        observed=observed,
        fallbacks=[f for layer_report in report.layers for f in layer_report.fallbacks],
        warned=any("saw no calibration tokens" in str(w.message) for w in caught),
        amax=_amax_state(model),
        moe={layer_report.name: layer_report.moe for layer_report in report.layers},
        summary=report.moe_summary(),
    )


def _expected_moe(sources: list[str]) -> dict:
    tokens = 4 * 16  # every real token goes to experts 0 and 1 (top-2 of a router that always ranks them first)
    block = {"routed_tokens": [tokens, tokens, 0, 0], "scales_from": sources}
    return {f"model.layers.{i}": {f"model.layers.{i}.mlp": block} for i in range(2)}


def test_moe_all_experts_calibrated_and_dead_expert_fallback():
    """Dead experts get their siblings' scales (or every token's); the report counts each expert's routed tokens
    (summed over ranks), says where its scales came from, and the CLI's one line sums it up."""
    line = "MoE: 4 of 8 experts got no routed calibration token; their input scales come from "
    for r in run_on_ranks(2, _moe_run, True):
        assert r["observed"] and all(v > 0 for v in r["observed"].values())
        assert not r["fallbacks"] and not r["warned"]
        assert r["moe"] == _expected_moe(["all tokens"] * 4) and r["summary"] == line + "all tokens (4)"
    for r in run_on_ranks(2, _moe_run, False):
        dead = {n for n, v in r["observed"].items() if v == 0}
        assert dead and all(".experts.2." in n or ".experts.3." in n for n in dead)
        assert len(dead) == 2 * 2 * 3  # 2 layers x 2 experts x (gate, up, down) inputs
        assert sorted(r["fallbacks"]) == sorted(dead) and r["warned"]
        for n in dead:  # sibling max: finite, positive
            assert torch.isfinite(r["amax"][n]).all() and (r["amax"][n] > 0).all()
        assert r["moe"] == _expected_moe(["routed tokens"] * 2 + ["sibling fallback"] * 2)
        assert r["summary"] == line + "sibling fallback (4)"


WEIGHT_ONLY = '[weight]\nformat = "int8"\ngranularity = "channel"\n'


@pytest.mark.parametrize("recipe", [WEIGHT_ONLY, "w8a8-int8-dynamic"], ids=["weights-only", "dynamic-inputs"])
def test_moe_experts_without_input_scales_are_reported_so(recipe):
    """A recipe that gives the experts' inputs no static scale (weights only, or dynamic inputs): the report and the
    CLI's line say so instead of naming a source of input scales the export does not have."""
    line = "MoE: 4 of 8 experts got no routed calibration token; 4 have no input scale to calibrate"
    for all_experts in (True, False):
        for r in run_on_ranks(2, _moe_run, all_experts, recipe):
            assert not r["fallbacks"] and not r["warned"]
            assert r["moe"] == _expected_moe(["no input scales"] * 4) and r["summary"] == line


def test_moe_summary_names_each_source_of_the_unrouted_experts_scales():
    """One unrouted expert of a block with input scales, two of a block without: each counted under its source."""
    layer = LayerReport(index=0, name="model.layers.0", seconds=0.0, sqnr_db=None, moe={
        "model.layers.0.mlp": {"routed_tokens": [3, 0], "scales_from": ["routed tokens", "sibling fallback"]},
        "model.layers.0.mlp.experts": {"routed_tokens": [0, 0, 5], "scales_from": ["no input scales"] * 3},
    })  # fmt: skip
    report = CalibrationReport(recipe="r", propagate="fp", world_size=1, num_batches=1, num_tokens=8, layers=[layer])
    assert report.moe_summary() == (
        "MoE: 3 of 5 experts got no routed calibration token; their input scales come from sibling fallback (1); "
        "2 have no input scale to calibrate"
    )
    layer.moe["model.layers.0.mlp"]["routed_tokens"] = [3, 1]
    layer.moe["model.layers.0.mlp.experts"]["routed_tokens"] = [0, 4, 5]
    assert (
        report.moe_summary() == "MoE: 1 of 5 experts got no routed calibration token; 1 has no input scale to calibrate"
    )


# ------------------------------------------------------------ bad input: clear errors, nothing written
def test_bad_input_clear_errors_nothing_written(tmp_path):
    model = _model()
    ckpt = tmp_path / "ckpt"
    cases = [
        (torch.zeros(0, 16, dtype=torch.long), DataError, "empty"),
        (torch.full((2, 8), 256), DataError, "token id 256 is outside the model's vocabulary [0, 256)"),
        (torch.zeros(1, 300, dtype=torch.long), DataError, "300 tokens exceed the model's max_position_embeddings=256"),
        (torch.zeros(2, 8), DataError, "must be integers"),
        ([[[1, 2, 3], [1, 2]]], DataError, "calibration data item 0 input_ids: not a rectangular array"),
        ([{"ids": [1, 2]}], DataError, "needs an 'input_ids' entry"),
    ]
    for data, error, message in cases:
        with pytest.raises(error) as info:
            calibrate(model, data, "w8a8-int8", checkpoint_dir=ckpt, report_path=tmp_path / "r.json", progress=False)
        assert message in str(info.value)
    with pytest.raises(ModelLayoutError, match="Sequential.*register"):
        calibrate(nn.Sequential(nn.Linear(2, 2)), _data(), "w8a8-int8", checkpoint_dir=ckpt, progress=False)
    assert not ckpt.exists() and not (tmp_path / "r.json").exists()
    assert not any(isinstance(m, nn.Module) and type(m).__name__ == "QuantLinear" for m in model.modules())


def test_report_json_and_plot(tmp_path):
    model = _model()
    report = calibrate(model, _data(), "fp8", batch_size=4, progress=False, report_path=tmp_path / "report.json")
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["recipe"] == "fp8" and len(saved["layers"]) == 4
    q = saved["layers"][0]["quantizers"]["model.layers.0.mlp.down_proj.input_quantizer"]
    assert q["amax"] > 0 and q["shape"] == [1]
    plot = report.save_plot(tmp_path / "sqnr.png")
    if plot is not None:
        import os

        assert plot.read_bytes()[:4] == b"\x89PNG"
        mask = os.umask(0)
        os.umask(mask)
        assert plot.stat().st_mode & 0o777 == 0o666 & ~mask  # as every other file, not mkstemp's 0600
        report.layers = report.layers[:2]  # a 2-layer model: ticks 0 and 1, never 0.25, 0.5 ...
        figure = report.sqnr_figure()
        assert all(float(t).is_integer() for t in figure.axes[0].get_xticks())


# ------------------------------------------------------------ padding never counts
PAD_ROWS = [torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 7, 10, 12, 5, 9)]


def _padded(pad_id: int) -> list[dict]:
    """The same rows, in the same batches of 3, padded with ``pad_id`` (255's embedding is made 300x larger)."""
    out = []
    for s in range(0, len(PAD_ROWS), 3):
        chunk = PAD_ROWS[s : s + 3]
        length = max(r.numel() for r in chunk)
        ids = torch.full((3, length), pad_id, dtype=torch.long)
        mask = torch.zeros(3, length, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, : r.numel()], mask[i, : r.numel()] = r, 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


#: The recipes that change weights, with the largest code of their weight format (one quantization step).
ALGORITHM_RECIPES = {"smoothquant+gptq": 127, "awq": 7}
PAD_RECIPES = {
    "max": "w8a8-int8",
    "percentile": '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\nobserver = "percentile"\n',
    "smoothquant+gptq": '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
    '[algorithm]\nname = "gptq"\nsmooth = { name = "smoothquant" }\n',
    "awq": '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\n[algorithm]\nname = "awq"\n',
}


@pytest.mark.parametrize("all_experts", [True, False])
@pytest.mark.parametrize("recipe", list(PAD_RECIPES))
def test_padding_never_counts(recipe, all_experts):
    """Observers, SmoothQuant/GPTQ/AWQ statistics and MoE experts (routed or all) skip padded positions: padding
    the same rows with a token whose activations are huge changes nothing, and counts are real tokens only."""
    text = PAD_RECIPES[recipe]
    spec = load_recipe(text) if not text.startswith("[") else parse_recipe(text, f"{recipe}.toml")
    results = []
    for pad_id in (0, 255):
        model = _model(dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=2))
        with torch.no_grad():
            model.model.embed_tokens.weight[255] *= 300.0
        calibrate(model, _padded(pad_id), spec, batch_size=3, progress=False, calibrate_all_experts=all_experts)
        state = {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}
        state.update({n: p.detach().clone() for n, p in model.named_parameters()})
        results.append((state, model))
    (a, model), (b, _) = results
    assert a.keys() == b.keys()
    quantized_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # Not bit-identical: the pad positions route to other experts, so the experts' matmuls run on other row counts,
    # and the real tokens' float32 results may differ in their last bits (_numerics). GPTQ can then move a weight
    # on a rounding tie by one code. A counted pad position would move an amax by the pad token's 300x.
    for key in a:
        if recipe in ALGORITHM_RECIPES:
            if key in quantized_weights:
                assert_close_but_for_rounding_flips(a[key], b[key], qmax=ALGORITHM_RECIPES[recipe], msg=key)
            else:
                torch.testing.assert_close(a[key], b[key], rtol=ROUNDING_RTOL, atol=0, msg=key)
        else:
            torch.testing.assert_close(a[key], b[key], rtol=FLOAT_RTOL, atol=0, msg=key)
    if recipe == "max":
        q = model.model.layers[0].self_attn.q_proj.input_quantizer
        assert q.num_observed == sum(r.numel() for r in PAD_ROWS) * 64  # real tokens x hidden, not 2 x 3 x 12 x 64


def _idle_rank_warning() -> list[str]:
    model = _model(dict(TINY_CONFIGS["llama"], num_hidden_layers=1))
    fsdp2_wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(model, _data(n=3), "fp8", batch_size=4, progress=False)
    return [str(w.message) for w in caught if "get none" in str(w.message)]


def test_a_rank_without_a_batch_is_said_once():
    rank0, rank1 = run_on_ranks(2, _idle_rank_warning)
    assert rank0 == [
        "1 batch(es) of up to 4 sequences for 2 ranks: rank(s) 1 get none and only take part in the gathers (a "
        "smaller batch size, or more samples, gives every rank work)"
    ]
    assert rank1 == []


def test_the_sqnr_plot_draws_the_threshold_and_says_what_propagate_means():
    """The recipe's ``[fallback] min_layer_sqnr_db`` as a labelled line (else the labelled 30 dB reference), the
    title saying what the layers' inputs were, and at 30 layers at most 15 integer layer ticks."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from shardcal.calib.report import REFERENCE_SQNR_DB, CalibrationReport, LayerReport

    layers = [LayerReport(name=f"model.layers.{i}", index=i, seconds=0.0, sqnr_db=30.0 + i % 7) for i in range(30)]
    report = CalibrationReport(recipe="w8a8-int8", propagate="fp", world_size=1, num_batches=1, num_tokens=8)
    report.layers = layers
    for threshold, label in ((25.0, "fallback threshold 25 dB"), (None, f"{REFERENCE_SQNR_DB:g} dB reference")):
        figure = report.sqnr_figure(threshold)
        ax = figure.axes[0]
        (line,) = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [threshold or REFERENCE_SQNR_DB] * 2]
        assert line.get_label().startswith(label)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label()]
        assert "inputs: full-precision outputs of the previous layer (propagate=fp)" in ax.get_title()
        ticks = [t for t in ax.get_xticks() if 0 <= t <= 29]
        assert 2 <= len(ticks) <= 15 and all(float(t).is_integer() for t in ticks)
        plt.close(figure)
    report.propagate = "qdq"
    figure = report.sqnr_figure()
    assert "inputs: quantized outputs of the previous layer (propagate=qdq)" in figure.axes[0].get_title()
    plt.close(figure)
