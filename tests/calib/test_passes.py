"""The layer step's passes: decided by one function (shardcal.calib.passes.plan_layer_passes), executed by the runner.

For every shipped recipe the plan is asserted as written here, and the runner's own calls of each decoder layer are
counted (those inside the algorithm's hooks are the algorithm's): they are the plan's passes times the batches they
cover. The rules themselves are checked on hand-made facts, and an algorithm that does not do what it said it would
(outputs left, amax derived) stops the run: the plan can only change where it is decided.
"""

from __future__ import annotations

import pytest
import torch

from shardcal.algorithms.base import KEEPS_FINAL, KEEPS_FULL_PRECISION, AlgorithmStep
from shardcal.calib import layer_calibration, runner
from shardcal.calib.passes import (
    ALGORITHM,
    OBSERVE,
    PROPAGATE,
    REFERENCE_STREAM,
    SQNR,
    SQNR_FULL_PRECISION,
    SQNR_REFERENCE,
    LayerFacts,
    plan_layer_passes,
)
from shardcal.calib.recipes import shipped_recipes
from shardcal.layerwise.steps import LayerStep
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(TINY_CONFIGS["llama"], hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2)  # fmt: skip
DATA = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))  # 2 batches of 4, all in the SQNR

#: Every shipped recipe's plan for a dense layer (what `describe()` says).
PLANS = {
    "fp8": "observe, sqnr -> next inputs: observe",
    "fp8-block": "observe, sqnr -> next inputs: observe",
    "fp8-dynamic": "observe, sqnr -> next inputs: observe",
    "fp8-dynamic-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "fp8-dynamic-kv": "observe, sqnr -> next inputs: observe",
    "fp8-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "mxfp4": "observe, sqnr -> next inputs: observe",
    "mxfp4a16": "observe, sqnr -> next inputs: observe",
    "mxfp4-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "mxfp4a16-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "mxfp8": "observe, sqnr -> next inputs: observe",
    "nvfp4": "observe, sqnr -> next inputs: observe",
    "nvfp4-gptq": "sqnr-reference, algorithm, observe, sqnr, propagate -> next inputs: propagate",
    "nvfp4-sq-gptq": "reference-stream, sqnr-reference, algorithm, observe, sqnr, propagate -> next inputs: propagate",
    "nvfp4a16": "observe, sqnr -> next inputs: observe",
    "nvfp4a16-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w4a16": "observe, sqnr -> next inputs: observe",
    "w4a16-awq": "sqnr-reference, algorithm, observe, sqnr -> next inputs: observe",
    "w4a16-awq-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w4a16-awq-gptq-asym": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w4a16-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w4a16-gptq-rot": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w4a16-gptq-rot-g64-asym": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w8a8-int8": "observe, sqnr -> next inputs: observe",
    "w8a8-int8-dynamic": "observe, sqnr -> next inputs: observe",
    "w8a8-int8-dynamic-sq": "algorithm, sqnr -> next inputs: algorithm",
    "w8a8-int8-dynamic-sq-rot": "algorithm, sqnr -> next inputs: algorithm",
    "w8a8-int8-sq": "algorithm, sqnr -> next inputs: algorithm",
    "w8a8-int8-sq-gptq": "sqnr-reference, algorithm, observe, sqnr, propagate -> next inputs: propagate",
    "w8a8-int8-sq-rot": "algorithm, sqnr -> next inputs: algorithm",
    "w4afp8-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
    "w8a16": "observe, sqnr -> next inputs: observe",
    "w8a16-gptq": "sqnr-reference, algorithm, sqnr, propagate -> next inputs: propagate",
}


def test_every_shipped_recipe_has_its_plan_here():
    assert sorted(PLANS) == shipped_recipes()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_runner_runs_the_plan(name, monkeypatch):
    """The plan is the one written above, the same for every layer, and the runner calls each layer exactly as often
    as the plan's passes over the batches they cover (the algorithm's own calls apart)."""
    plans, calls, inside = [], {}, [False]
    real_plan, real_forward = layer_calibration.layer_pass_plan, LayerStep.forward

    def plan_spy(step, *args, **kwargs):
        plan = real_plan(step, *args, **kwargs)
        plans.append((step.index, len(step.inputs), plan))
        return plan

    def forward_spy(self, i, rows=None):
        if not inside[0]:
            calls[self.index] = calls.get(self.index, 0) + 1
        return real_forward(self, i, rows)

    def hooked(hook):
        def run(self, *args, **kwargs):
            inside[0] = True
            try:
                return hook(self, *args, **kwargs)
            finally:
                inside[0] = False

        return run

    from shardcal.algorithms import make_algorithm

    algorithm = type(make_algorithm(__import__("shardcal").load_recipe(name).algorithm))
    for hook in ("before_weight_calibration", "after_weight_calibration"):
        monkeypatch.setattr(algorithm, hook, hooked(getattr(algorithm, hook)))
    monkeypatch.setattr(layer_calibration, "layer_pass_plan", plan_spy)
    monkeypatch.setattr(LayerStep, "forward", forward_spy)
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    randomize_(model, seed=1)
    runner.calibrate(model, DATA, name, batch_size=4, progress=False)
    assert {plan.describe() for _, _, plan in plans} == {PLANS[name]}
    for index, batches, plan in plans:
        runs = [p for p in plan.passes if p.kind not in (ALGORITHM, REFERENCE_STREAM)]
        assert calls[index] == batches * len(runs), (index, calls[index], plan.describe())


def _facts(**changes) -> LayerFacts:
    return LayerFacts(propagate="fp", **changes)


def _kinds(facts: LayerFacts) -> list[str]:
    return [p.kind for p in plan_layer_passes(facts).passes]


def test_the_rules_on_hand_made_facts():
    # round to nearest, one max observer: one observing pass, its outputs go on
    assert _kinds(_facts(observer_passes=1)) == [OBSERVE, SQNR]
    assert plan_layer_passes(_facts(observer_passes=2)).observing == 2  # percentile / mse observers
    # weight-only under qdq: nothing to observe, the SQNR's full precision side is a pass of its own, then propagate
    plan = plan_layer_passes(LayerFacts(propagate="qdq"))
    assert [p.kind for p in plan.passes] == [SQNR_FULL_PRECISION, SQNR, PROPAGATE] and plan.next_inputs == PROPAGATE
    # the same as an MoE layer: one pass counts the routing only when the next inputs are the full-precision outputs
    assert _kinds(LayerFacts(propagate="qdq", moe=True)) == [SQNR_FULL_PRECISION, SQNR, PROPAGATE]
    assert _kinds(_facts(moe=True)) == [OBSERVE, SQNR]
    # a function-preserving algorithm's full-precision outputs stand in for the observing pass and the SQNR side
    smooth = dict(changes_weights=True, preserves_function=True, algorithm_passes=True,
                  algorithm_keeps=KEEPS_FULL_PRECISION)  # fmt: skip
    assert _kinds(_facts(**smooth)) == [ALGORITHM, SQNR]
    assert _kinds(_facts(**smooth, observer_passes=1)) == [ALGORITHM, OBSERVE, SQNR]
    assert _kinds(LayerFacts(propagate="qdq", **smooth)) == [ALGORITHM, SQNR, PROPAGATE]
    # a weight-changing algorithm: the SQNR's reference first; its full-precision outputs would be stale
    gptq = dict(changes_weights=True, algorithm_passes=True, algorithm_keeps=KEEPS_FULL_PRECISION)
    plan = plan_layer_passes(LayerFacts(propagate="qdq", **gptq))
    assert [p.kind for p in plan.passes] == [SQNR_REFERENCE, ALGORITHM, SQNR, PROPAGATE]
    assert not plan.algorithm_outputs_valid
    # final outputs go on under qdq unless a quantizer is set after the algorithm; a guard may leave none
    final = dict(changes_weights=True, algorithm_passes=True, algorithm_keeps=KEEPS_FINAL)
    plan = plan_layer_passes(LayerFacts(propagate="qdq", **final))
    assert [p.kind for p in plan.passes] == [SQNR_REFERENCE, ALGORITHM, SQNR] and plan.next_inputs == ALGORITHM
    plan = plan_layer_passes(LayerFacts(propagate="qdq", **final, algorithm_may_keep_none=True))
    assert plan.passes[-1].kind == PROPAGATE and plan.passes[-1].unless_kept and plan.next_inputs == ALGORITHM
    plan = plan_layer_passes(LayerFacts(propagate="qdq", **final, set_after_algorithm=True))
    assert plan.next_inputs == PROPAGATE and not plan.passes[-1].unless_kept
    assert plan_layer_passes(_facts(**final)).next_inputs == OBSERVE  # under fp: the full-precision outputs
    assert _kinds(_facts(reference_stream=True, observer_passes=1))[0] == REFERENCE_STREAM
    with pytest.raises(ValueError, match="propagate must be"):
        plan_layer_passes(LayerFacts(propagate="bf16"))


def test_a_plan_runs_the_layer_quantized_in_a_propagate_pass_or_on_sqnr_sequences():
    """Whether a layer runs with its quantizers on: a propagate pass always; the SQNR's quantized side only where
    there are SQNR sequences."""
    observed = plan_layer_passes(_facts(observer_passes=1, moe=True))  # [observe, sqnr]: fp outputs go on
    assert observed.runs_quantized(sqnr_rows=True) and not observed.runs_quantized(sqnr_rows=False)
    propagated = plan_layer_passes(LayerFacts(propagate="qdq", moe=True))
    assert propagated.runs_quantized(sqnr_rows=False) and propagated.runs_quantized(sqnr_rows=True)


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    randomize_(model, seed=1)
    return model


def test_an_algorithm_that_breaks_its_word_stops_the_run(monkeypatch):
    """The plan is made on what the algorithm says before its hooks run; hooks that leave other outputs, or derive
    other amax, stop the run (a bug: the plan would no longer be what runs)."""
    from shardcal.algorithms.smoothquant import SmoothQuant

    monkeypatch.setattr(SmoothQuant, "plan_step", lambda self, step, recipe: AlgorithmStep(passes=True))
    with pytest.raises(RuntimeError, match="said its passes leave None outputs, they left 'full-precision'"):
        runner.calibrate(_model(), DATA, "w8a8-int8-sq", batch_size=4, progress=False)
    monkeypatch.setattr(SmoothQuant, "plan_step", lambda self, step, recipe: AlgorithmStep(
        passes=True, keeps=KEEPS_FULL_PRECISION))  # fmt: skip
    with pytest.raises(RuntimeError, match="are not what was planned"):
        runner.calibrate(_model(), DATA, "w8a8-int8-sq", batch_size=4, progress=False)
