"""The runner's options against what they promise: sqnr_tokens, checkpoint_every, offload_activations, and the
activation memory bound ("at most two layers' worth of activations are alive").

* ``sqnr_tokens``: each layer's reported SQNR equals ``10 log10(sum x^2 / sum (x - x_hat)^2)`` computed here, over
  the first sequences that hold ``sqnr_tokens`` tokens (run on their own), from the calibrated layer run with its
  quantizers off and on (also on two ranks, where those sequences are split over both, one batch in part);
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

from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.quant.session import quantizer_mode
from shardcal.runtime.faults import armed
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
IDS = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(6))
BATCH = 2  # 4 global batches


def _model(cfg: dict = CFG) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    return model.eval()


def _amax(model) -> dict[str, torch.Tensor]:
    return {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}


# ------------------------------------------------------------------------------------------------ sqnr_tokens
def _hand_sqnr(model: CausalLM, sequences: int) -> list[float | None]:
    """Per layer, SQNR of the calibrated layer (quantizers on vs off) on the fp inputs of the first sequences, run
    on their own, in the runner's batches (the same matmul shapes, so the same bits on every CPU's kernels)."""
    if sequences == 0:
        return [None] * len(model.model.layers)
    signal = [0.0] * len(model.model.layers)
    noise = [0.0] * len(model.model.layers)
    with torch.no_grad():
        for start in range(0, sequences, BATCH):
            x = model.model.embed(IDS[start : min(start + BATCH, sequences)])
            kwargs = dict(position_embeddings=x.position_embeddings, attention_mask=x.attention_mask)
            hidden = x.hidden_states
            for i, layer in enumerate(model.model.layers):
                with quantizer_mode(layer, "disabled"):
                    ref = layer(hidden, **kwargs)
                quantized = layer(hidden, **kwargs)
                signal[i] += float(ref.double().pow(2).sum())
                noise[i] += float((quantized.double() - ref.double()).pow(2).sum())
                hidden = ref
    return [10.0 * math.log10(s / n) for s, n in zip(signal, noise)]


def _sqnr_run(sqnr_tokens: int, wrap: bool) -> list[float | None]:
    model = _model()
    if wrap:
        fsdp2_wrap(model)
    report = calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, sqnr_tokens=sqnr_tokens)
    return [entry.sqnr_db for entry in report.layers]


# tokens -> sequences of 12 tokens: none; the first (part of batch 0); exactly 3 (batch 0, part of 1); all 8
@pytest.mark.parametrize("sqnr_tokens, sequences", [(0, 0), (1, 1), (36, 3), (10**6, 8)])
def test_sqnr_is_measured_on_the_first_sequences_holding_sqnr_tokens(sqnr_tokens, sequences):
    model = _model()
    report = calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, sqnr_tokens=sqnr_tokens)
    want = _hand_sqnr(model, sequences)
    got = [entry.sqnr_db for entry in report.layers]
    if not sequences:
        assert got == want == [None] * 3
        return
    assert got == pytest.approx(want, rel=1e-9)
    other = _hand_sqnr(model, sequences + 1 if sequences < 8 else 1)  # the number of sequences matters
    assert all(abs(a - b) > 1e-6 * abs(b) for a, b in zip(want, other))


def test_the_sqnr_pass_runs_the_sample_alone():
    """With the first sequence as the sample (of batches of 2), each layer runs on 2 rows per batch (the observing
    pass) and once on 1 row (the SQNR pass) — not on the whole first batch again."""
    model = _model()
    rows: dict[int, list[int]] = {i: [] for i in range(3)}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, k, i=i: rows[i].append(a[0].shape[0]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False, sqnr_tokens=1)
    for h in hooks:
        h.remove()
    assert all(sorted(r) == [1, 2, 2, 2, 2] for r in rows.values()), rows


def test_sqnr_sequences_split_over_two_ranks():
    model = _model()
    calibrate(model, IDS, "w8a8-int8", batch_size=BATCH, progress=False)
    want = _hand_sqnr(model, 5)  # 60 tokens: batches 0, 1 on rank 0, the first row of batch 2 on rank 1
    for got in run_on_ranks(2, _sqnr_run, 60, True):
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
    from shardcal.layerwise.batches import make_batches

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
