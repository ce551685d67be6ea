"""Observers: values in one process, and split-over-ranks + merge == all data in one process (gloo, 2 ranks)."""

import math

import pytest
import torch
import torch.distributed as dist

from shardcal.quant import (
    CalibrationSession,
    QuantizerSpec,
    TensorQuantizer,
    begin_pass_all,
    end_pass_all,
    fake_quantize,
    finish_calibration_all,
    start_calibration_all,
)
from shardcal.quant.granularity import Layout

from _dist import run_on_ranks

HIDDEN = 32

#: (id, spec, observed shape) covering every observer, granularity and format.
CONFIGS = [
    ("max-int8-tensor", QuantizerSpec("int8"), (HIDDEN,)),
    ("max-int8-channel", QuantizerSpec("int8", "channel", axis=-1), (HIDDEN,)),
    ("max-int4-group", QuantizerSpec("int4", "group", group_size=8), (HIDDEN,)),
    ("max-nvfp4", QuantizerSpec("nvfp4"), (HIDDEN,)),
    (
        "pct-int8-tensor",
        QuantizerSpec("int8", observer="percentile", observer_params={"percentile": 99.0, "bins": 512}),
        (HIDDEN,),
    ),
    ("pct-fp8-channel", QuantizerSpec("fp8_e4m3", "channel", axis=-1, observer="percentile"), (HIDDEN,)),
    ("mse-int8-tensor", QuantizerSpec("int8", observer="mse"), (HIDDEN,)),
    (
        "mse-int4-group",
        QuantizerSpec("int4", "group", group_size=8, observer="mse", observer_params={"max_shrink": 0.5, "grid": 20}),
        (HIDDEN,),
    ),
    ("mse-fp8-tensor", QuantizerSpec("fp8_e4m3", observer="mse"), (HIDDEN,)),
    ("mse-nvfp4", QuantizerSpec("nvfp4", observer="mse"), (HIDDEN,)),
    ("max-int8-channel-asym", QuantizerSpec("int8", "channel", axis=-1, symmetric=False), (HIDDEN,)),
    ("mse-int4-group-asym", QuantizerSpec("int4", "group", group_size=8, observer="mse", symmetric=False), (HIDDEN,)),
]


def _data(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, HIDDEN, generator=g) * torch.linspace(0.1, 4.0, HIDDEN)
    x[1, 7, 3] = 60.0  # an outlier
    return x


def _calibrate(q: TensorQuantizer, batches, group=None) -> torch.Tensor:
    for _p in CalibrationSession([q], group).passes():
        for b in batches:
            q(b)
    return q.amax.clone()


pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

# ------------------------------------------------------------------------------------------ one process


def test_max_observer_is_the_exact_amax():
    """The reference is ``abs().amax`` over the elements that share a scale, written out per granularity."""
    x = _data()
    references = {
        "tensor": x.abs().amax().reshape(1),
        "channel": x.abs().amax(dim=(0, 1)),  # one per hidden channel, over every token
        "group": x.reshape(-1, HIDDEN // 8, 8).abs().amax(dim=(0, 2)),  # one per group of 8 channels
    }
    for spec in (
        QuantizerSpec("int8"),
        QuantizerSpec("int8", "channel", axis=-1),
        QuantizerSpec("int4", "group", group_size=8),
    ):
        q = TensorQuantizer(spec, (HIDDEN,))
        amax = _calibrate(q, list(x))
        assert torch.equal(amax, references[spec.granularity]), spec.granularity
        assert q.num_observed == x.numel()
    w = torch.randn(6, 16)
    q = TensorQuantizer(QuantizerSpec("int8", "channel", axis=0), w.shape)
    assert torch.equal(q.calibrate_from(w), w.abs().amax(1, keepdim=True))


def test_asymmetric_max_observer_is_the_exact_range():
    """Asymmetric: amax is ``max(x, 0)`` and amin ``min(x, 0)`` over the elements that share a scale."""
    x = _data() + 1.0  # most values positive: amin is the (small) minimum, not -amax
    q = TensorQuantizer(QuantizerSpec("int4", "group", group_size=8, symmetric=False), (HIDDEN,))
    _calibrate(q, list(x))
    groups = x.reshape(-1, HIDDEN // 8, 8)
    assert torch.equal(q.amax, groups.amax(dim=(0, 2)).clamp(min=0))
    assert torch.equal(q.amin, groups.amin(dim=(0, 2)).clamp(max=0))
    assert bool((q.amin > -q.amax).any())
    w = torch.rand(6, 16) + 0.5  # all positive: the range still starts at 0
    wq = TensorQuantizer(QuantizerSpec("int8", "channel", axis=0, symmetric=False), w.shape)
    assert torch.equal(wq.calibrate_from(w), w.amax(1, keepdim=True)) and torch.equal(wq.amin, torch.zeros(6, 1))


def test_asymmetric_mse_observer_picks_the_best_candidate():
    torch.manual_seed(1)
    w = torch.randn(4, 64) + 0.5
    w[0, 0] = 12.0  # an outlier worth clipping
    params = {"grid": 50, "max_shrink": 0.6}
    spec = QuantizerSpec("int4", "channel", axis=0, observer="mse", observer_params=params, symmetric=False)
    q = TensorQuantizer(spec, w.shape)
    amax = q.calibrate_from(w)
    hi, lo = w.amax(1, keepdim=True).clamp(min=0), w.amin(1, keepdim=True).clamp(max=0)
    fractions = torch.tensor([1 - i / 50 for i in range(31)], dtype=torch.float32)
    errs = torch.stack([(fake_quantize(w, hi * f, spec, amin=lo * f) - w).pow(2).sum(1).double() for f in fractions])
    best = fractions[errs.argmin(0)][:, None]
    assert torch.equal(amax, hi * best) and torch.equal(q.amin, lo * best)
    assert amax[0].item() < 12.0


def test_percentile_observer_close_to_quantile():
    x = _data()
    spec = QuantizerSpec("int8", observer="percentile", observer_params={"percentile": 99.0, "bins": 4096})
    q = TensorQuantizer(spec, (HIDDEN,))
    amax = _calibrate(q, list(x))
    values = x.abs().flatten().sort().values
    exact = values[math.ceil(0.99 * len(values)) - 1].item()  # the 99th-percentile element
    width = values[-1].item() / 4096
    assert exact <= amax.item() <= exact + width + 1e-6  # the upper edge of its histogram bin
    q100 = TensorQuantizer(
        QuantizerSpec("int8", observer="percentile", observer_params={"percentile": 100.0}), (HIDDEN,)
    )
    assert torch.equal(_calibrate(q100, [x]), x.abs().amax().reshape(1))


def test_mse_observer_picks_the_best_candidate():
    torch.manual_seed(0)
    w = torch.randn(4, 64)
    w[0, 0] = 12.0  # an outlier worth clipping
    spec = QuantizerSpec("int4", "channel", axis=0, observer="mse", observer_params={"grid": 50, "max_shrink": 0.6})
    q = TensorQuantizer(spec, w.shape)
    amax = q.calibrate_from(w)
    full = w.abs().amax(1, keepdim=True)
    fractions = [1 - i / 50 for i in range(31)]
    errs = torch.stack(
        [
            (fake_quantize(w, full * torch.tensor(f, dtype=torch.float32), spec) - w).pow(2).sum(1).double()
            for f in fractions
        ]
    )
    best = torch.tensor(fractions, dtype=torch.float32)[errs.argmin(0)]
    assert torch.equal(amax, full * best[:, None])
    assert amax[0].item() < 12.0  # the outlier row got clipped


def test_split_batches_equal_one_batch_and_zero_data():
    x = _data()
    for _, spec, shape in CONFIGS:
        a = _calibrate(TensorQuantizer(spec, shape), [x.reshape(-1, HIDDEN)])
        b = _calibrate(TensorQuantizer(spec, shape), [x[0], x[1, :5], x[1, 5:], x[2], x[:0]])
        assert torch.equal(a, b), spec
    q = TensorQuantizer(QuantizerSpec("int8", observer="mse"), (HIDDEN,))
    assert torch.equal(_calibrate(q, []), torch.zeros(1)) and q.num_observed == 0
    assert torch.equal(q(torch.zeros(2, HIDDEN)), torch.zeros(2, HIDDEN))


# ------------------------------------------------------------------------------------------ 2 ranks


def _split_and_merge_on_ranks():
    """Every config: this rank's share (uneven: rank 0 gets 2 of 3 sequences) merged == all data locally."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _data()
    local = [x[0], x[1]] if rank == 0 else [x[2]]
    results = {}
    dist_qs = [TensorQuantizer(spec, shape, name=name) for name, spec, shape in CONFIGS]
    ref_qs = [TensorQuantizer(spec, shape, name=name) for name, spec, shape in CONFIGS]
    # all quantizers of a "layer" in one session: at most two all-reduces per pass
    start_calibration_all(dist_qs)
    issued = []
    for p in range(2):
        begin_pass_all(dist_qs, p)
        for b in local:
            for q in dist_qs:
                q(b)
        issued.append(end_pass_all(dist_qs, dist.group.WORLD))
    finish_calibration_all(dist_qs)
    for dq, rq, (name, _, _) in zip(dist_qs, ref_qs, CONFIGS):
        ref = _calibrate(rq, [x.reshape(-1, HIDDEN)])
        same = torch.equal(dq.amax, ref) and (dq.amin is None or torch.equal(dq.amin, rq.amin))
        results[name] = (same, dq.num_observed == x.numel(), dq.amax.tolist()[:3])
    # a rank that sees no data still takes part in every merge (an MoE expert with no tokens)
    q = TensorQuantizer(QuantizerSpec("int8", observer="percentile"), (HIDDEN,))
    amax = _calibrate(q, [x.reshape(-1, HIDDEN)] if rank == 0 else [], dist.group.WORLD)
    results["rank-without-data"] = (
        torch.equal(amax, _calibrate(TensorQuantizer(q.spec, (HIDDEN,)), [x.reshape(-1, HIDDEN)])),
        q.num_observed == x.numel(),
        None,
    )
    # weights: each rank holds the full weight; calibrate_from without a group does no collective
    w = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(7))
    wq = TensorQuantizer(QuantizerSpec("int4", "group", group_size=8, observer="mse"), w.shape)
    results["weight"] = (
        torch.equal(wq.calibrate_from(w), TensorQuantizer(wq.spec, w.shape).calibrate_from(w)),
        True,
        None,
    )
    return issued, results, world


def test_split_over_ranks_and_merge_equals_one_process():
    for issued, results, world in run_on_ranks(2, _split_and_merge_on_ranks):
        assert world == 2
        assert issued == [2, 1], issued  # pass 0: MAX + SUM; pass 1: SUM, for all twelve quantizers together
        bad = {k: v for k, v in results.items() if not (v[0] and v[1])}
        assert not bad, bad


def test_pass_protocol_errors():
    q = TensorQuantizer(QuantizerSpec("int8", observer="mse"), (HIDDEN,))
    with pytest.raises(RuntimeError, match="before start_calibration"):
        q.begin_pass(0)
    q.start_calibration()
    q.begin_pass(0)
    q.end_pass()
    with pytest.raises(RuntimeError, match="incomplete"):
        q.finish_calibration()
    with pytest.raises(RuntimeError, match="next pass is 1"):
        q.begin_pass(0)


def _mse_reference(x: torch.Tensor, spec: QuantizerSpec, reduce_dims: tuple[int, ...], shape) -> tuple:
    """The mse observer by its definition: every candidate fraction of the max range fake-quantized with
    ``fake_quantize``, float64 error sums per slot, the first (largest) candidate of least error."""
    grid, shrink, norm = (
        spec.observer_params.get(k, d) for k, d in (("grid", 100), ("max_shrink", 0.2), ("norm", 2.0))
    )
    fractions = [torch.tensor(1 - i / grid, dtype=torch.float32) for i in range(int(shrink * grid + 1e-9) + 1)]
    hi = x.amax(dim=reduce_dims).reshape(shape).clamp(min=0)
    lo = x.amin(dim=reduce_dims).reshape(shape).clamp(max=0)
    if spec.symmetric:
        hi = torch.maximum(hi, -lo)
    errors = []
    for f in fractions:
        deq = fake_quantize(x, hi * f, spec, amin=None if spec.symmetric else lo * f)
        errors.append((deq.double() - x.double()).abs().pow(norm).sum(dim=reduce_dims).reshape(-1))
    best = torch.stack(errors).min(dim=0).indices
    pick = torch.stack([torch.full_like(hi.reshape(-1), float(f)) for f in fractions]).gather(0, best[None])[0]
    return hi * pick.reshape(shape), None if spec.symmetric else lo * pick.reshape(shape)


@pytest.mark.parametrize(
    "spec",
    [
        QuantizerSpec("int4", "group", group_size=16, observer="mse"),
        QuantizerSpec("int4", "group", group_size=16, observer="mse", symmetric=False),
        QuantizerSpec("int8", "channel", axis=0, observer="mse", observer_params={"max_shrink": 0.5}),
        QuantizerSpec("int4", "channel", axis=0, observer="mse", observer_params={"norm": 2.4, "grid": 40}),
        QuantizerSpec("int4", "group", group_size=16, observer="mse", symmetric=False, observer_params={"norm": 3.0}),
    ],
    ids=["int4-group", "int4-group-asym", "int8-channel", "int4-channel-norm2.4", "int4-group-asym-norm3"],
)
def test_mse_weight_observer_is_its_definition_over_many_tiles(spec, monkeypatch):
    from shardcal.quant.observers import MseObserver

    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=g) * torch.linspace(0.2, 3.0, 24)[:, None] + 0.3
    w[5, 9], w[17, 40] = 9.0, -7.0  # outliers worth clipping
    monkeypatch.setattr(MseObserver, "TILE_ELEMENTS", 3 * 64)  # blocks of three rows: eight tiles
    q = TensorQuantizer(spec, w.shape)
    amax = q.calibrate_from(w)
    groups = w.reshape(24, -1, spec.group_size) if spec.granularity == "group" else w.reshape(24, 1, 64)
    ref_amax, ref_amin = _mse_reference(groups, spec, (-1,), q.amax.shape)
    assert torch.equal(amax, ref_amax)
    assert spec.symmetric or torch.equal(q.amin, ref_amin)
    if spec.format == "int4":  # some slots clipped
        assert (amax < w.abs().reshape(groups.shape).amax(-1).reshape(amax.shape)).any()


def test_mse_activation_observer_is_its_definition():
    x = _data(5)
    spec = QuantizerSpec("int8", "channel", axis=-1, observer="mse", observer_params={"max_shrink": 0.6, "grid": 30})
    amax = _calibrate(TensorQuantizer(spec, (HIDDEN,)), [x[0], x[1], x[2]])
    ref, _ = _mse_reference(x.reshape(-1, HIDDEN), spec, (0,), (HIDDEN,))
    assert torch.equal(amax, ref)


def test_observers_of_one_tensor_share_one_amax_and_never_a_stale_one(monkeypatch):
    from shardcal.quant.granularity import Layout

    calls = []
    real = Layout._amax_of
    monkeypatch.setattr(Layout, "_amax_of", lambda self, x: calls.append(1) or real(self, x))
    x = _data(9)
    qs = [TensorQuantizer(QuantizerSpec("int8"), (HIDDEN,)) for _ in range(3)]
    start_calibration_all(qs)
    begin_pass_all(qs, 0)
    with torch.no_grad():
        for q in qs:
            q(x)
        assert len(calls) == 1
        x[0, 0, 0] = 99.0  # changed in place: measured again
        qs[0](x)
    end_pass_all(qs)
    finish_calibration_all(qs)
    assert len(calls) == 2
    assert qs[0].amax.item() == 99.0 and qs[1].amax.item() == qs[2].amax.item() == _data(9).abs().max().item()


def test_a_kept_result_goes_with_its_input_and_no_python_runs_then():
    import gc
    import types
    import weakref

    from shardcal.quant.reuse import LastResult

    kept = LastResult()
    x, y = torch.ones(4), torch.zeros(4)
    result = x * 2
    kept.put(x, ("k", torch.tensor([1.0])), result)
    assert kept.get(x, ("k", torch.tensor([1.0]))) is result
    assert kept.get(x, ("k", torch.tensor([2.0]))) is None and kept.get(y, ("k", torch.tensor([1.0]))) is None
    gone = weakref.ref(result)
    # freeing x runs C code only (the dict's own pop): a Ctrl-C can never land inside a Python callback there, where
    # Python prints "Exception ignored" and drops it
    assert isinstance(kept._ref.__callback__, types.BuiltinMethodType)
    del result, x
    gc.collect()
    assert gone() is None  # the kept result went with its input
    z = torch.ones(3)
    kept.put(z, ("k",), z + 1)
    kept.put(y, ("k",), y + 1)  # replacing the entry drops the previous one (its reference and callback too)
    del z
    assert kept.get(y, ("k",)) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_amax_is_abs_amax_for_every_layout_and_zero_sign(dtype):
    """The amax of a contiguous weight (per channel, group or block; computed as max(max x, -min x)) is
    ``abs().amax`` over each slot: exactly, +0.0 for a slot of -0.0 only, NaN for a slot holding one; a strided view
    gets the same."""
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    w[0] = -0.0  # a whole channel, group and block row of negative zeros
    w[1, 3] = float("nan")
    w[2] = -w[2].abs()  # a slot with no positive value
    references = {
        "channel": w.float().abs().amax(dim=1, keepdim=True),
        "group": w.float().reshape(12, 4, 16).abs().amax(dim=2),
        "block": w.float().reshape(3, 4, 2, 32).abs().amax(dim=(1, 3)),
    }
    for spec in (
        QuantizerSpec("int8", "channel", axis=0),
        QuantizerSpec("int4", "group", group_size=16),
        QuantizerSpec("fp8_e4m3", "block", block_size=(4, 32)),
    ):
        lay = Layout(spec, w.shape)
        for x in (w, w.t().contiguous().t()):  # contiguous, and the same values in a strided view
            got = lay.amax_of(x)
            want = references[spec.granularity].reshape(got.shape)
            assert got.dtype == torch.float32 and torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), spec
            assert not torch.signbit(got[~got.isnan()]).any(), spec  # +0.0, never -0.0
    # one element per slot (nothing to fold): the amax is |x|, and x is left as it was
    for spec, x in (
        (QuantizerSpec("int8", "channel", axis=0), w[:, :1]),
        (QuantizerSpec("int8", "channel", axis=-1), w[2]),
    ):
        x = x.contiguous()
        before = x.clone()
        got = Layout(spec, x.shape).amax_of(x)
        assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(
            got.reshape(-1), x.float().abs().reshape(-1)
        )
