"""Activation-aware weight scales (shardcal.algorithms.scales): the least-squares refit of group scales against
plain torch's lstsq, and GPTQ's new scale options beating round to nearest."""

from __future__ import annotations

import pytest
import torch

from shardcal.algorithms.scales import clip_search_amax, refit_scales
from shardcal.quant import QuantizerSpec, TensorQuantizer

pytestmark = pytest.mark.numerics


def _inputs(n: int = 2048, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5
    return torch.randn(n, dim, generator=g) @ mix + torch.randn(dim, generator=g)


def _quantizer(weight: torch.Tensor, group: int = 16) -> TensorQuantizer:
    q = TensorQuantizer(QuantizerSpec("int4", "group", group_size=group), tuple(weight.shape))
    q.calibrate_from(weight)
    return q


def test_refit_equals_plain_least_squares_per_row():
    """For fixed codes, the scales minimising ||X (w - sum_g s_g q_g)||^2, from torch.linalg.lstsq on the explicit
    design matrix; the quantizer with the new amax reproduces the refitted weight exactly."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 64, generator=g) * 0.1
    x = _inputs()
    q = _quantizer(weight)
    quantized = q(weight)
    amax, new = refit_scales(weight, quantized, q, (x.T @ x).double())
    scale = q.amax / 7.0
    codes = torch.round(quantized.reshape(6, 4, 16) / scale[..., None])
    for r in range(6):
        design = torch.zeros(64, 4, dtype=torch.float64)
        for k in range(4):
            design[k * 16 : (k + 1) * 16, k] = codes[r, k].double()
        want = torch.linalg.lstsq(x.double() @ design, x.double() @ weight[r].double()).solution
        torch.testing.assert_close(amax[r].double() / 7.0, want, rtol=1e-4, atol=1e-7)
    q.set_amax(amax)
    assert torch.equal(q(new), new)
    error = lambda w: (x @ (w - weight).T).pow(2).sum()
    assert error(new) < error(quantized)


def test_refit_keeps_rows_it_cannot_improve():
    weight = torch.zeros(2, 32)
    weight[0, :16] = 0.5  # row 0: one group of zeros (no codes), row 1: all zero
    q = _quantizer(weight)
    x = _inputs(dim=32)
    amax, new = refit_scales(weight, q(weight), q, x.T @ x)
    assert torch.isfinite(amax).all() and torch.equal(new, q(weight))


def test_clip_search_never_worse_than_max_on_its_objective():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 64, generator=g) * 0.1
    weight[:, 5] *= 8.0  # an outlier column: clipping pays for the other columns
    x = _inputs()
    h = x.T @ x
    q = _quantizer(weight)
    blocks = lambda w: sum(
        ((w[:, i : i + 16] @ h[i : i + 16, i : i + 16]) * w[:, i : i + 16]).sum() for i in range(0, 64, 16)
    )
    before = blocks(q(weight) - weight)
    q.set_amax(*clip_search_amax(weight, q, h, max_shrink=0.5, grid=20))
    assert blocks(q(weight) - weight) <= before


def _group_error(w: torch.Tensor, hi: float, lo: float, h: torch.Tensor) -> float:
    """``e H e^T`` of one group ``w`` [g] quantized asymmetric int4 over ``[lo, hi]``, written out per element."""
    scale = (max(hi, 0.0) - min(lo, 0.0)) / 15.0
    zp = min(max(-8 - round(min(lo, 0.0) / scale), -8), 7)
    deq = torch.tensor([(min(max(round(float(v) / scale) + zp, -8), 7) - zp) * scale for v in w])
    e = (deq - w).double()
    return float(e @ h.double() @ e)


def test_asymmetric_clip_search_is_the_documented_three_stage_search():
    """Per group, a plain loop over the documented candidates: both ends shrunk together, then the lower end alone,
    then the upper end alone (the other at its best so far), keeping a candidate only when it is strictly better.
    The search's ranges match it, and on off-centre groups the per-end stages beat shrinking both ends alike."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4, 32, generator=g) * 0.1 + torch.rand(4, 1, generator=g) * 0.1
    weight[1, 3] = -0.6  # one low outlier: only the lower end should shrink
    x = _inputs(dim=32)
    h = x.T @ x
    q = TensorQuantizer(QuantizerSpec("int4", "group", group_size=16, symmetric=False), tuple(weight.shape))
    q.calibrate_from(weight)
    amax, amin = clip_search_amax(weight, q, h, max_shrink=0.5, grid=10)
    fractions = [1.0 - i / 10 for i in range(6)]
    improved = 0
    for r in range(4):
        for k in range(2):
            w, hb = weight[r, 16 * k : 16 * k + 16], h[16 * k : 16 * k + 16, 16 * k : 16 * k + 16]
            top, bottom = max(float(w.max()), 0.0), min(float(w.min()), 0.0)
            best, err = (top, bottom), float("inf")
            for c in fractions:
                cand = _group_error(w, top * c, bottom * c, hb)
                if cand < err:
                    best, err = (top * c, bottom * c), cand
            joint = err
            for lo in (bottom * c for c in fractions):
                if (cand := _group_error(w, best[0], lo, hb)) < err:
                    best, err = (best[0], lo), cand
            for hi in (top * c for c in fractions):
                if (cand := _group_error(w, hi, best[1], hb)) < err:
                    best, err = (hi, best[1]), cand
            improved += err < joint
            assert abs(float(amax[r, k]) - best[0]) < 1e-7 and abs(float(amin[r, k]) - best[1]) < 1e-7, (r, k)
    assert improved >= 1
