"""Each algorithm class owns its memory model: a registered algorithm that states none is refused by the planner
(never planned at zero), and one that states its own is planned with its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardcal.algorithms import ALGORITHMS, GPTQ, LayerAlgorithm, SmoothQuant
from shardcal.algorithms.autoround import TUNE_BYTES_PER_WEIGHT, AutoRound
from shardcal.algorithms.awq import AWQ
from shardcal.algorithms.memory import AlgorithmMemory, LayerPlanContext, memory_model_of
from shardcal.calib.recipes import recipe_from_dict
from shardcal.errors import PlanError
from shardcal.layerwise.options import CalibrationOptions
from shardcal.plan.planner import PlanSettings, plan_calibration

from _tiny_models import TINY_CONFIGS


class NoModel(LayerAlgorithm):
    """A user's algorithm that says nothing about its memory."""

    name = "no-model"


class OwnModel(LayerAlgorithm):
    """A user's algorithm holding 1000 bytes per quantized Linear while it collects."""

    name = "own-model"

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params) -> AlgorithmMemory:
        return AlgorithmMemory(cls.name, collect=1000 * len(context.linears))


def _recipe(name: str, **params):
    algorithm = {"name": name, **params}
    return recipe_from_dict({"name": f"int8-{name}", "weight": {"format": "int8"}, "algorithm": algorithm})


def _plan(tmp_path: Path, recipe):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIGS["llama"], "torch_dtype": "float32"}))
    settings = PlanSettings(num_samples=4, seq_len=8, options=CalibrationOptions(batch_size=2))
    return plan_calibration(folder, recipe, settings)


def test_the_built_in_classes_state_their_own_models():
    for cls in (LayerAlgorithm, SmoothQuant, AWQ, GPTQ, AutoRound):
        assert memory_model_of(cls) is not None, cls
    assert memory_model_of(NoModel) is None  # inheriting round to nearest's zero is not stating a model


def test_an_algorithm_without_a_memory_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(ALGORITHMS, NoModel.name, NoModel)
    with pytest.raises(
        PlanError, match=r"algorithm 'no-model' .*has no memory model.*define the classmethod planned_memory"
    ):
        _plan(tmp_path, _recipe(NoModel.name))


def test_an_algorithm_with_its_own_model_is_planned_with_it(tmp_path, monkeypatch):
    monkeypatch.setitem(ALGORITHMS, OwnModel.name, OwnModel)
    plan = _plan(tmp_path, _recipe(OwnModel.name))
    assert plan.ranks[0].parts["algorithm_state"] == 1000 * 7  # q, k, v, o, gate, up, down
    assert _plan(tmp_path, _recipe("rtn")).ranks[0].parts["algorithm_state"] == 0


def test_autoround_plans_its_targets_tuned_state_and_graph(tmp_path):
    """The full-precision targets of the rank's tokens, the tuned state per quantized weight element and the
    autograd graph of one step's batches: more batches per step, more memory."""
    cfg = TINY_CONFIGS["llama"]
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    weights = h * q + 2 * h * kv + q * h + 3 * h * f
    one = _plan(tmp_path, _recipe("autoround")).ranks[0].parts["algorithm_state"]
    four = _plan(tmp_path, _recipe("autoround", batches_per_iter=4)).ranks[0].parts["algorithm_state"]
    targets = 4 * 8 * h * 4  # one rank: 4 sequences of 8 tokens, float32
    assert one > targets + TUNE_BYTES_PER_WEIGHT * weights
    assert four > one


def test_smoothquant_plans_the_rows_it_keeps_for_rotated_consumers(tmp_path):
    """With rotated consumers behind static per-tensor max input quantizers, SmoothQuant keeps every token row of
    their pairs (float32, this rank's tokens) to take the rotated inputs' amax: at least 4 bytes per token and
    channel of the q/k/v and down_proj inputs more than without the rotation; none with dynamic inputs, nor with
    ``rotated_amax = "observe"``."""
    cfg = TINY_CONFIGS["llama"]
    h, f = cfg["hidden_size"], cfg["intermediate_size"]

    def state(rotation: bool, dynamic: bool = False, source: str = "kept-rows") -> int:
        table = {
            "name": "sq",
            "weight": {"format": "int8"},
            "input": {"format": "int8", "granularity": "token" if dynamic else "tensor", "dynamic": dynamic},
            "algorithm": {"name": "smoothquant", "alpha": 0.8, "rotated_amax": source},
        }
        if rotation:
            table["rotation"] = {"type": "hadamard", "block": 16}
        return _plan(tmp_path, recipe_from_dict(table)).ranks[0].parts["algorithm_state"]

    tokens = 4 * 8  # one rank: 4 sequences of 8 tokens
    assert state(True) - state(False) >= 4 * tokens * (h + f)
    assert state(True, dynamic=True) == state(False, dynamic=True)
    assert state(True, source="observe") == state(False)
