"""Activation-aware weight scales (shardcal.algorithms.scales): the least-squares refit of group scales against
plain torch's lstsq, and GPTQ's new scale options beating round to nearest."""

from __future__ import annotations

import torch

from shardcal.algorithms.scales import clip_search_amax, refit_scales
from shardcal.quant import QuantizerSpec, TensorQuantizer


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
