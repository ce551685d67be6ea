"""The public layer-stepping primitive, ``shardcal.layer_steps``, used as docs/guides/calibration.md shows.

References are the model's own forward (hooks on its decoder layers) and hand computations of what the next layer
must receive under each ``propagate`` mode when the caller changes a layer's weights during its step.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

from shardcal import layer_steps
from shardcal.layerwise.batches import make_batches, rank_batch_indices
from shardcal.models import CausalLM, ModelConfig
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
IDS = torch.randint(0, 256, (6, 10), generator=torch.Generator().manual_seed(8))
BATCH = 2


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    return model.eval().requires_grad_(False)


def _own_forward_outputs() -> list[list[torch.Tensor]]:
    """``[layer][batch]`` outputs of each decoder layer in the model's own forward."""
    model = _model()
    outputs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, args, out, i=i: outputs[i].append(out))
    for s in range(0, IDS.shape[0], BATCH):
        model(IDS[s : s + BATCH])
    return outputs


def _walk(wrap: bool) -> dict:
    model = _model()
    if wrap:
        fsdp2_wrap(model)
    from shardcal.runtime.distributed import world

    rank, world_size = world()
    batches = make_batches(IDS, batch_size=BATCH)
    mine = rank_batch_indices(len(batches), rank, world_size)
    seen = []
    for step in layer_steps(model, [batches[i] for i in mine], propagate="fp"):
        gathered = not any(isinstance(p, DTensor) for p in step.layer.parameters())
        outputs = step.forward_all()  # kept as the next layer's inputs under propagate="fp"
        seen.append((step.index, step.name, gathered, outputs))
    resharded = all(isinstance(p, DTensor) for p in model.model.layers.parameters()) if wrap else True
    return {"mine": mine, "seen": seen, "resharded": resharded}


def test_steps_reproduce_the_models_own_forward():
    want = _own_forward_outputs()
    result = _walk(False)
    assert [(i, name) for i, name, _, _ in result["seen"]] == [(i, f"model.layers.{i}") for i in range(3)]
    for i, _, _, outputs in result["seen"]:
        assert len(outputs) == 3 and all(torch.equal(a, b) for a, b in zip(outputs, want[i]))


def test_steps_on_two_sharded_ranks():
    """Each rank steps its own batches with every layer gathered for the step and resharded after it."""
    want = _own_forward_outputs()
    results = run_on_ranks(2, _walk, True)
    assert [r["mine"] for r in results] == [[0, 1], [2]]
    for r in results:
        assert r["resharded"]
        for i, _, gathered, outputs in r["seen"]:
            assert gathered
            for b, out in zip(r["mine"], outputs):
                torch.testing.assert_close(out, want[i][b], rtol=1e-5, atol=1e-6)


def _call(step, h: torch.Tensor, b: int) -> torch.Tensor:
    call = step.inputs[b].call_of(step.index)
    return step.layer(h, **call.kwargs)


@pytest.mark.parametrize(
    ("propagate", "keep", "edited"),
    [("fp", True, False), ("fp", False, True), ("qdq", True, True), ("qdq", False, True)],
    ids=["fp-kept", "fp-not-kept", "qdq-kept", "qdq-not-kept"],
)
def test_next_inputs_under_each_propagate_mode(propagate, keep, edited):
    """The caller halves a layer's down_proj after its pass: fp passes on kept outputs as they were (or, when none
    were kept, recomputes them after the caller is done); qdq always recomputes them with the caller's changes."""
    model = _model()
    expected = None
    for step in layer_steps(model, make_batches(IDS, batch_size=BATCH), propagate=propagate):
        if expected is not None:  # what this layer must have been given
            for x, want in zip(step.inputs, expected):
                assert torch.equal(x.hidden_states, want), step.name
        before = [x.hidden_states for x in step.inputs]
        if keep:
            step.forward_all()
        original = [_call(step, h, b) for b, h in enumerate(before)]
        step.layer.mlp.down_proj.weight.mul_(0.5)
        changed = [_call(step, h, b) for b, h in enumerate(before)]
        assert not torch.equal(original[0], changed[0])
        expected = changed if edited else original


def test_activations_of_earlier_layers_are_freed():
    """At most two layers' worth of activations: when step i runs, step i - 1's inputs are gone."""
    model = _model()
    previous: list[weakref.ref] = []
    for step in layer_steps(model, make_batches(IDS, batch_size=BATCH)):
        assert all(r() is None for r in previous), step.name
        previous = [weakref.ref(x.hidden_states) for x in step.inputs]
        step.forward_all()


def test_resume_from_a_layer_with_given_inputs():
    model = _model()
    kept = None
    first = {}
    for step in layer_steps(model, make_batches(IDS, batch_size=BATCH)):
        if step.index == 1:
            kept = list(step.inputs)
        first[step.index] = step.forward_all()
    indices = []
    for step in layer_steps(model, make_batches(IDS, batch_size=BATCH), start=1, initial_inputs=kept):
        indices.append(step.index)
        assert all(torch.equal(a, b) for a, b in zip(step.forward_all(), first[step.index]))
    assert indices == [1, 2]


def test_bad_propagate_is_refused():
    with pytest.raises(ValueError, match="propagate must be one of"):
        next(layer_steps(_model(), make_batches(IDS, batch_size=BATCH), propagate="int8"))


def test_finite_check_is_not_fooled_by_an_overflowing_sum():
    from shardcal.layerwise.steps import _all_finite

    big = torch.full((4, 8), 3e38)  # every value finite, the sum overflows to inf
    assert _all_finite(big) and _all_finite(torch.zeros(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(4, 8)
        x[2, 3] = bad
        assert not _all_finite(x)
    mixed = torch.tensor([float("inf"), float("-inf")])  # sums to NaN, still caught
    assert not _all_finite(mixed)


def test_a_batchs_first_rows_run_alone():
    """``step.forward(i, rows)`` with ``head_rows``: each layer's output on the first row of a batch is the model's
    own forward of that row alone; rows not embedded on their own are a UsageError naming them."""
    from shardcal.errors import UsageError

    alone = _model()
    want: list[torch.Tensor] = []
    for layer in alone.model.layers:
        layer.register_forward_hook(lambda m, args, out: want.append(out))
    alone(IDS[2:3])  # batch 1's first row
    batches = make_batches(IDS, batch_size=BATCH)
    got = []
    for step in layer_steps(_model(), batches, propagate="fp", head_rows={1: 1}):
        got.append(step.forward(1, 1))
        assert torch.equal(step.forward(1, 2), step.forward(1))  # all its rows: the batch itself
        with pytest.raises(UsageError, match=r"model\.layers\.\d: the first 1 rows of batch 0 were not embedded"):
            step.forward(0, 1)
        step.forward_all()
    assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want))
