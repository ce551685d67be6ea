"""Activation-aware weight scales from the inputs' Gram matrix ``H = sum_x x x^T`` (merged exactly across ranks).

Two searches, shared by AWQ and GPTQ; both minimise a Linear's output error ``tr(E H E^T)`` (``E`` the weight error)
instead of the weight error itself:

* :func:`clip_search_amax` — per quantization group (per row for per-channel scales), the amax among
  ``c * max|w|``, ``c`` in ``{1, 1 - max_shrink/grid, ..., 1 - max_shrink}``, with the least ``e H_gg e^T`` on the
  group's diagonal block of ``H`` (AWQ's clip search; it ignores the coupling between groups).
* :func:`refit_scales` — for weights already quantized (fixed integer codes, e.g. GPTQ's), the group scales of each
  row that minimise the full ``e H e^T`` — a small least-squares problem per row (``G`` unknowns for ``G`` groups):
  ``(Q^T H Q) s = Q^T H w``. A row keeps its old scales unless the new ones are positive, finite and give a
  smaller error.
* :func:`refine_rounding` — for fixed scales, greedy sweeps over the columns: an integer code moves one step up or
  down where that lowers ``e H e^T`` (the exact change, ``2 d (E H)_rj + d^2 H_jj``, is known from the running
  ``E H``), i.e. rounding tuned against the inputs, starting from GPTQ's.

They return amax values for the weight quantizer (``scale = amax / qmax``), so export and reload work unchanged;
:func:`clip_search_amax` also serves asymmetric weights (an amin as well), the other two symmetric ones only.
"""

from __future__ import annotations

import math

import torch

from ..quant.formats import FORMATS, fake_quantize, scale_from_amax
from ..quant.quantizer import TensorQuantizer


def _group_size(q: TensorQuantizer, n: int) -> int | None:
    """Columns per scale of a 2-D weight: the group size, ``n`` for per-output-channel scales, else None."""
    lay = q.layout
    if lay.kind == "group":
        return lay.group_size
    if lay.kind == "channel" and q.spec.axis in (0, -2):
        return n
    return None


def clip_search_amax(
    w: torch.Tensor, q: TensorQuantizer, h: torch.Tensor, max_shrink: float, grid: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per group: the shrunk max amax with the least output error ``e H_gg e^T`` (see the module docstring);
    ``(amax, amin)``, with amin the shrunk minimum for an asymmetric quantizer (both ends shrink by the same
    fraction) and None for a symmetric one.

    ``w`` [out, in] float32, ``h`` [in, in] float32 on ``w``'s device. None for a layout without row groups.
    """
    g = _group_size(q, w.shape[1]) if w.dim() == 2 else None
    if g is None:
        return None
    lay = q.layout
    out, n = w.shape
    blocks = w.reshape(out, n // g, g)  # [out, groups, g]
    hb = torch.stack([h[i : i + g, i : i + g] for i in range(0, n, g)])  # [groups, g, g]
    if q.spec.symmetric:
        wmax, wmin = blocks.abs().amax(dim=-1), None  # [out, groups]
    else:
        wmax, wmin = (t.reshape(out, n // g) for t in lay.range_of(w))
    best_err = torch.full_like(wmax, math.inf, dtype=torch.float64)
    best, best_min = wmax.clone(), None if wmin is None else wmin.clone()
    for i in range(int(math.floor(max_shrink * grid + 1e-9)) + 1):
        c = 1.0 - i / grid
        amax, amin = wmax * c, None if wmin is None else wmin * c
        low = None if amin is None else amin.reshape(lay.amax_shape)
        qdq = fake_quantize(w, amax.reshape(lay.amax_shape), q.spec, lay, low).reshape(out, n // g, g)
        e = blocks - qdq
        err = torch.einsum("ogi,gij,ogj->og", e, hb, e).double()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, amax, best)
        if amin is not None:
            best_min = torch.where(better, amin, best_min)
    return best.reshape(lay.amax_shape), None if best_min is None else best_min.reshape(lay.amax_shape)


def _row_errors(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``e_r H e_r^T`` per row (float64)."""
    return ((e @ h) * e).sum(dim=1, dtype=torch.float64)


@torch.no_grad()
def refit_scales(
    weight: torch.Tensor, quantized: torch.Tensor, q: TensorQuantizer, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(amax, weight)``: per row, least-squares group scales for the integer codes of ``quantized`` against the
    original ``weight`` and the Gram matrix ``h`` (see the module docstring), and the weight those scales give
    (``codes * scale``, exactly what the quantizer with that amax computes). None when the format is not an integer
    one or the layout has no row groups."""
    fmt = FORMATS[q.spec.format]
    out, n = weight.shape
    g = _group_size(q, n)
    if fmt.kind != "int" or g is None:
        return None
    lay = q.layout
    w, wq, h = weight.float(), quantized.float(), h.float()
    old_amax = q.amax.to(device=w.device, dtype=torch.float32).reshape(out, n // g)
    old_scale = scale_from_amax(old_amax, q.spec.format)
    groups = n // g
    codes = torch.round(wq.reshape(out, groups, g) / old_scale[..., None])  # exact: wq = codes * scale
    hb = h.reshape(groups, g, groups, g)
    a = torch.empty(out, groups, groups, dtype=torch.float32, device=w.device)
    for k in range(groups):  # A[r, j, k] = codes_rj^T H_jk codes_rk
        t = torch.einsum("jik,rk->rji", hb[:, :, k, :], codes[:, k])
        a[:, :, k] = (codes * t).sum(dim=-1)
    b = (codes * (w @ h).reshape(out, groups, g)).sum(dim=-1)
    diag = torch.diagonal(a, dim1=1, dim2=2)
    ridge = 1e-6 * diag.mean(dim=1, keepdim=True).clamp(min=1e-12)
    a = a + torch.diag_embed(ridge.expand(-1, groups))
    scale, info = torch.linalg.solve_ex(a.double(), b.double())
    ok = (info == 0)[:, None] & torch.isfinite(scale) & (scale > 0) & (diag > 0)
    scale = torch.where(ok, scale.float(), old_scale)
    amax = scale * fmt.qmax
    new_scale = scale_from_amax(amax, q.spec.format)  # the scale the quantizer will use with this amax
    new = (codes * new_scale[..., None]).reshape(out, n)
    better = _row_errors(new - w, h) < _row_errors(wq - w, h)
    amax = torch.where(better[:, None], amax, old_amax)
    new = torch.where(better[:, None], new, wq)
    return amax.reshape(lay.amax_shape), new.to(weight.dtype)


@torch.no_grad()
def refine_rounding(
    weight: torch.Tensor,
    quantized: torch.Tensor,
    q: TensorQuantizer,
    h: torch.Tensor,
    sweeps: int = 1,
    block_size: int = 128,
) -> torch.Tensor | None:
    """``quantized`` with its integer codes moved one step where that lowers ``tr(E H E^T)`` (see the module
    docstring); same scales, so the quantizer reproduces the result. None for a non-integer format.

    Columns are visited in order, in blocks of ``block_size``: inside a block the running ``E H`` of the block's
    columns is updated after every column, the rest once per block (one matrix product), as GPTQ batches its updates.
    """
    fmt = FORMATS[q.spec.format]
    if fmt.kind != "int" or weight.dim() != 2:
        return None
    lay = q.layout
    w, wq, h = weight.float(), quantized.float(), h.to(device=weight.device, dtype=torch.float32)
    amax = lay.broadcast(q.amax.to(device=w.device, dtype=torch.float32))
    scale = lay.restore(scale_from_amax(amax, q.spec.format).expand(lay.arrange(w).shape))
    scale_t = scale.T.contiguous()  # column j of W is row j here
    codes_t = torch.round(wq / scale).T.contiguous()
    grad_t = ((wq - w) @ h).T.contiguous()  # (E H)^T: row j is half the derivative of every row's error in w_.j
    n = w.shape[1]
    diag = torch.diagonal(h).tolist()
    for _ in range(sweeps):
        for b0 in range(0, n, block_size):
            b1 = min(b0 + block_size, n)
            local = grad_t[b0:b1].clone()
            moved = torch.zeros_like(local)
            hb = h[b0:b1, b0:b1]
            for i in range(b1 - b0):
                s, g = scale_t[b0 + i], local[i]
                step = -torch.sign(g)
                target = codes_t[b0 + i] + step
                move = (step * g * 2.0 + s * diag[b0 + i] < 0) & (target >= fmt.qmin) & (target <= fmt.qmax)
                step = step * move
                codes_t[b0 + i] += step
                delta = step * s
                moved[i] = delta
                if i + 1 < b1 - b0:
                    local[i + 1 :].addr_(hb[i + 1 :, i], delta)
            grad_t.addmm_(h[:, b0:b1], moved)
    return (codes_t * scale_t).T.contiguous().to(weight.dtype)
