"""The planner counts the passes the runner runs: it asks the runner for a layer's pass plan
(``shardcal.calib.layer_calibration.predicted_pass_plan``, on the model's skeleton) instead of modelling the step itself.

Every shipped recipe's predicted plan is the one ``tests/calib/test_passes.py`` asserts the runner runs (a dense
layer, default propagation); on an MoE model and under ``propagate = "qdq"`` the prediction is compared with the plans
a real calibration makes; and the memory steps of a layer are the kinds of passes in its plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_passes import CONFIG, PLANS

from shardcal.calib import layer_calibration, runner
from shardcal.calib.recipes import load_recipe
from shardcal.layerwise.options import CalibrationOptions
from shardcal.models import CausalLM, ModelConfig
from shardcal.plan.memory import layer_steps, rank_data
from shardcal.plan.planner import PlanSettings, PreparedModel, read_source
from shardcal.plan.prepared import PlannedRun

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")


def _prepared(tmp_path: Path, raw: dict, recipe: str) -> PreparedModel:
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float32"}))
    return PreparedModel(read_source(folder), load_recipe(recipe))


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_planned_passes_are_the_runners(tmp_path, name):
    """The plan predicted for every decoder layer is the one the runner runs (tests/calib/test_passes.py)."""
    prepared = _prepared(tmp_path, CONFIG, name)
    propagate = prepared.default_propagate
    assert {prepared.pass_plan(i, propagate).describe() for i in range(2)} == {PLANS[name]}


def _runner_plans(raw: dict, recipe: str, propagate: str | None) -> list[str]:
    """The plans a real calibration makes, layer by layer."""
    plans: list[str] = []
    real = layer_calibration.layer_pass_plan

    def spy(step, *args, **kwargs):
        plan = real(step, *args, **kwargs)
        plans.append(plan.describe())
        return plan

    model = CausalLM(ModelConfig.from_dict(raw))
    randomize_(model, seed=1)
    data = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_calibration, "layer_pass_plan", spy)
        runner.calibrate(model, data, recipe, batch_size=2, progress=False, propagate=propagate)
    return plans


@pytest.mark.parametrize(
    ("model", "recipe", "propagate"),
    [
        ("qwen3_moe", "w8a8-int8", None),
        ("qwen3_moe", "fp8-dynamic", None),
        ("qwen3_moe", "fp8-dynamic", "qdq"),
        ("qwen3_moe", "fp8-dynamic-kv", None),
        ("qwen3_moe", "w8a8-int8-dynamic-sq", None),
        ("llama", "w4a16", "qdq"),
        ("llama", "fp8-dynamic-kv", "qdq"),
        ("llama", "w8a8-int8-sq", "qdq"),
    ],
)
def test_the_planned_passes_are_a_real_runs(tmp_path, model, recipe, propagate):
    """On an MoE model and under a quantized propagation, the prediction is what a calibration plans, layer by
    layer."""
    raw = TINY_CONFIGS[model]
    prepared = _prepared(tmp_path, raw, recipe)
    chosen = propagate or prepared.default_propagate
    predicted = [prepared.pass_plan(i, chosen).describe() for i in range(raw["num_hidden_layers"])]
    assert predicted == _runner_plans(raw, recipe, propagate)


def _step_names(tmp_path: Path, recipe: str, propagate: str | None = None) -> list[str]:
    prepared = _prepared(tmp_path, CONFIG, recipe)
    options = CalibrationOptions(batch_size=2, propagate=propagate)
    m = PlannedRun(prepared, PlanSettings(num_samples=4, seq_len=16, options=options))
    return list(layer_steps(m, 0, 0, rank_data(m, 0), m.shards))


def test_a_layers_memory_steps_are_its_passes(tmp_path):
    """Each kind of pass in the layer's plan is a step of its memory, and only those (beside gathering the layer,
    the algorithm's solve, the weights' scales and the SQNR's sums)."""
    assert _step_names(tmp_path, "w8a8-int8") == ["gather", "solve", "weight scales", "observe", "sqnr", "sqnr sums"]
    assert _step_names(tmp_path, "w4a16", "qdq") == [
        "gather", "solve", "weight scales", "sqnr-full-precision", "sqnr", "propagate", "sqnr sums",
    ]  # fmt: skip
    assert _step_names(tmp_path, "w4a16-gptq") == [
        "gather", "sqnr-reference", "algorithm", "solve", "weight scales", "sqnr", "propagate", "sqnr sums",
    ]  # fmt: skip
    assert _step_names(tmp_path, "nvfp4-sq-gptq")[:3] == ["gather", "reference-stream", "sqnr-reference"]


def test_the_full_precision_stream_is_counted_when_the_plan_runs_its_pass(tmp_path):
    """An algorithm that reads the full-precision stream (GPTQ's ``stream_correction``: a ``reference-stream`` pass
    first) holds that stream's inputs and outputs beside the cache: two more hidden-state caches, by hand."""
    from dataclasses import replace

    from shardcal.plan.planner import plan_source

    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIG, "torch_dtype": "float32"}))
    source, recipe = read_source(folder), load_recipe("nvfp4-sq-gptq")
    plain = replace(recipe, algorithm={k: v for k, v in recipe.algorithm.items() if k != "stream_correction"})
    settings = PlanSettings(num_samples=4, seq_len=16, options=CalibrationOptions(batch_size=2))
    caches = [plan_source(source, r, settings).ranks[0].parts["activation_cache"] for r in (recipe, plain)]
    assert caches[0] - caches[1] == 2 * (4 * 16 * CONFIG["hidden_size"] * 4)  # samples x seq x hidden x float32
