"""The runner's options against what they promise: sqnr_batches, checkpoint_every, offload_activations, and the
activation memory bound ("at most two layers' worth of activations are alive").

* ``sqnr_batches``: each layer's reported SQNR equals ``10 log10(sum x^2 / sum (x - x_hat)^2)`` computed here, over
  the first ``sqnr_batches`` global batches, from the calibrated layer run with its quantizers off and on (also on
  two ranks, where those batches are split over both);
* ``checkpoint_every``: commits happen after exactly every that many layers, and a run interrupted at one resumes
  to the uninterrupted result;
* ``offload_activations``: the cache lives on the CPU when asked, and the result does not depend on it;
* memory: when a layer first runs, no tensor that was an input of an earlier layer is still alive (weak references
  taken by hooks on the model's own layers).
"""

from __future__ import annotations

import json
import math
import weakref

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after

from shardcal.faults import armed
from shardcal.fsdp2_utils import fsdp2_wrap
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.quant.session import quantizer_mode
from shardcal.runner import calibrate

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
IDS = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(6))
BATCH = 2  # 4 global batches


def _model(cfg: dict = CFG) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    return model.eval()


def _amax(model) -> dict[str, torch.Tensor]:
    return {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}


# ------------------------------------------------------------------------------------------------ sqnr_batches
def _hand_sqnr(model: CausalLM, batches: int) -> list[float | None]:
    """Per layer, SQNR of the calibrated layer (quantizers on vs off) on the fp inputs of the first batches."""
    if batches == 0:
        return [None] * len(model.model.layers)
    out = []
    with torch.no_grad():
        inputs = [model.model.embed(IDS[s : s + BATCH]) for s in range(0, BATCH * batches, BATCH)]
        hidden = [x.hidden_states for x in inputs]
        for layer in model.model.layers:
            signal = noise = 0.0
            nxt = []
            for h, x in zip(hidden, inputs):
                kwargs = dict(position_embeddings=x.position_embeddings, attention_mask=x.attention_mask)
                with quantizer_mode(layer, "disabled"):
                    ref = layer(h, **kwargs)
                quantized = layer(h, **kwargs)
                signal += float(ref.double().pow(2).sum())
                noise += float((quantized.double() - ref.double()).pow(2).sum())
                nxt.append(ref)
            out.append(10.0 * math.log10(signal / noise))
            hidden = nxt
    return out


def _sqnr_run(sqnr_batches: int, wrap: bool) -> list[float | None]:
    model = _model()
    if wrap:
        fsdp2_wrap(model)
    report = calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, sqnr_batches=sqnr_batches)
    return [entry.sqnr_db for entry in report.layers]


@pytest.mark.parametrize("sqnr_batches", [0, 1, 3])
def test_sqnr_is_measured_on_the_first_sqnr_batches(sqnr_batches):
    model = _model()
    report = calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, sqnr_batches=sqnr_batches)
    want = _hand_sqnr(model, sqnr_batches)
    got = [entry.sqnr_db for entry in report.layers]
    if not sqnr_batches:
        assert got == want == [None] * 3
        return
    assert got == pytest.approx(want, rel=1e-9)
    other = _hand_sqnr(model, 3 if sqnr_batches == 1 else 1)  # the number of batches matters: one is not three
    assert all(abs(a - b) > 1e-6 * abs(b) for a, b in zip(want, other))


def test_sqnr_batches_split_over_two_ranks():
    model = _model()
    calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False)
    want = _hand_sqnr(model, 3)  # batches 0, 1 on rank 0, batch 2 on rank 1
    for got in run_on_ranks(2, _sqnr_run, 3, True):
        assert got == pytest.approx(want, rel=1e-9)


# ------------------------------------------------------------------------------------------------ checkpoint_every
def test_checkpoint_every_commits_after_every_that_many_layers(tmp_path):
    cfg = dict(CFG, num_hidden_layers=5)
    commits: list[int] = []
    with armed("calibrate.committed", lambda completed_layers: commits.append(completed_layers)):
        calibrate(_model(cfg), IDS, "w8a8-int8", batch_size=BATCH, progress=False, checkpoint_dir=tmp_path / "a",
                  checkpoint_every=2)  # fmt: skip
    assert commits == [2, 4]
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["completed_layers"] == 5

    whole = _model(cfg)
    calibrate(whole, IDS, "w8a8-int8", batch_size=BATCH, progress=False)
    with pytest.raises(CalibrationInterrupted), interrupt_after(3):
        calibrate(_model(cfg), IDS, "w8a8-int8", batch_size=BATCH, progress=False, checkpoint_dir=tmp_path / "b",
                  checkpoint_every=3)  # fmt: skip
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["completed_layers"] == 3
    model = _model(cfg)
    report = calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, checkpoint_dir=tmp_path / "b",
                       checkpoint_every=3)  # fmt: skip
    assert report.resumed_from_layer == 3
    want, got = _amax(whole), _amax(model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ------------------------------------------------------------------------------------------------ offload_activations
def test_offload_activations_keeps_the_cache_on_cpu_and_changes_nothing():
    from shardcal import layer_steps
    from shardcal.batches import make_batches

    results = []
    for offload in (True, False, None):
        model = _model()
        calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, offload_activations=offload)
        results.append(_amax(model))
    assert all(r.keys() == results[0].keys() and all(torch.equal(r[k], results[0][k]) for k in r) for r in results)
    for step in layer_steps(_model(), make_batches(IDS, BATCH), offload_activations=True):
        assert step.cache_device == torch.device("cpu")
        assert all(x.hidden_states.device.type == "cpu" for x in step.inputs)
        step.forward_all()


# ------------------------------------------------------------------------------------------------ memory
def _track_layer_inputs(model: CausalLM) -> dict[int, dict[int, int]]:
    """Hooks on the model's layers: at each layer's first call, how many inputs of each earlier layer are alive."""
    refs: dict[int, list[weakref.ref]] = {}
    alive: dict[int, dict[int, int]] = {}

    def hook(index: int):
        def pre(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if index not in alive:
                alive[index] = {j: sum(r() is not None for r in rs) for j, rs in refs.items() if j < index}
            mine = refs.setdefault(index, [])
            if not any(r() is hidden for r in mine):
                mine.append(weakref.ref(hidden))

        return pre

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(hook(i), with_kwargs=True)
    return alive


@pytest.mark.parametrize("propagate", ["fp", "qdq"])
def test_at_most_two_layers_of_activations_alive(propagate):
    """When layer i first runs, the inputs of layer i - 1 are gone: only layer i's inputs and outputs are alive."""
    model = _model(dict(CFG, num_hidden_layers=4))
    alive = _track_layer_inputs(model)
    calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, propagate=propagate)
    assert sorted(alive) == [0, 1, 2, 3]
    assert all(count == 0 for counts in alive.values() for count in counts.values()), alive
    assert alive[3] == {0: 0, 1: 0, 2: 0}
