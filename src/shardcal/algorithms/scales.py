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
:func:`clip_search_amax` and :func:`refine_rounding` also serve asymmetric weights (zero points shift the codes'
bounds), :func:`refit_scales` symmetric ones only.
"""

from __future__ import annotations

import math

import torch

from ..quant.formats import FORMATS, fake_quantize, nvfp4_block_scales, nvfp4_global_scale, qparams, scale_from_amax
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import NVFP4_BLOCK_SIZE


def nvfp4_element_scales(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per element of ``w`` [out, cols] (cols a multiple of 16): the effective nvfp4 scale (FP8 block scale over the
    global scale) of its block of 16 columns, as ``formats.fake_quantize`` derives it from these values."""
    blocks = w.unflatten(-1, (w.shape[-1] // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE))
    eff = nvfp4_block_scales(blocks, global_scale) / global_scale
    return eff.expand(blocks.shape).flatten(-2).contiguous()


def element_qparams(q: TensorQuantizer, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantizer's scale (and zero point, asymmetric) for every element of ``weight`` (float32, its shape);
    nvfp4: the block scales ``weight`` itself gets (over the global scale of the calibrated amax), no zero point."""
    if q.spec.format == "nvfp4":
        return nvfp4_element_scales(weight, nvfp4_global_scale(q.amax.detach().to(weight.device))), None
    lay = q.layout
    arranged = lay.arrange(weight)

    def per_element(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return lay.restore(t.expand(arranged.shape)).contiguous()

    amin = None if q.amin is None else lay.broadcast(q.amin.to(device=weight.device, dtype=torch.float32))
    scale, zp = qparams(lay.broadcast(q.amax.to(device=weight.device, dtype=torch.float32)), amin, q.spec.format)
    return per_element(scale), per_element(zp)


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
    ``(amax, amin)``, amin None for a symmetric quantizer. An asymmetric one first shrinks both ends of each
    group's range by the same fraction, then each end alone (the other held at its best so far), lower end first.

    ``w`` [out, in] float32, ``h`` [in, in] float32 on ``w``'s device. None for a layout without row groups.
    """
    g = _group_size(q, w.shape[1]) if w.dim() == 2 else None
    if g is None:
        return None
    search = _RangeSearch(w, q, h, g)
    fractions = [1.0 - i / grid for i in range(int(math.floor(max_shrink * grid + 1e-9)) + 1)]
    if q.spec.symmetric:
        for c in fractions:
            search.try_range(search.wmax * c, None)
        return search.result()
    for c in fractions:
        search.try_range(search.wmax * c, search.wmin * c)
    for c in fractions:
        search.try_range(search.best_max, search.wmin * c)
    for c in fractions:
        search.try_range(search.wmax * c, search.best_min)
    return search.result()


class _RangeSearch:
    """Candidate ranges per group of one weight, scored by the output error on the group's block of ``H``."""

    def __init__(self, w: torch.Tensor, q: TensorQuantizer, h: torch.Tensor, g: int):
        self.w, self.q, self.lay = w, q, q.layout
        out, n = w.shape
        self.blocks = w.reshape(out, n // g, g)  # [out, groups, g]
        self.hb = torch.stack([h[i : i + g, i : i + g] for i in range(0, n, g)])  # [groups, g, g]
        if q.spec.symmetric:
            self.wmax, self.wmin = self.blocks.abs().amax(dim=-1), None  # [out, groups]
        else:
            self.wmax, self.wmin = (t.reshape(out, n // g) for t in self.lay.range_of(w))
        self.best_err = torch.full_like(self.wmax, math.inf, dtype=torch.float64)
        self.best_max = self.wmax.clone()
        self.best_min = None if self.wmin is None else self.wmin.clone()

    def try_range(self, amax: torch.Tensor, amin: torch.Tensor | None) -> None:
        """Keep ``(amax, amin)`` [out, groups] for the groups where it lowers the error (strictly)."""
        shape = self.lay.amax_shape
        low = None if amin is None else amin.reshape(shape)
        qdq = fake_quantize(self.w, amax.reshape(shape), self.q.spec, self.lay, low).reshape(self.blocks.shape)
        e = self.blocks - qdq
        err = torch.einsum("ogi,gij,ogj->og", e, self.hb, e).double()
        better = err < self.best_err
        self.best_err = torch.where(better, err, self.best_err)
        self.best_max = torch.where(better, amax, self.best_max)
        if amin is not None:
            self.best_min = torch.where(better, amin, self.best_min)

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = self.lay.amax_shape
        return self.best_max.reshape(shape), None if self.best_min is None else self.best_min.reshape(shape)


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
    w, wq, h = weight.float(), quantized.float(), h.to(device=weight.device, dtype=torch.float32)
    scale, zp = element_qparams(q, w)
    scale_t = scale.T.contiguous()  # column j of W is row j here
    codes_t = torch.round(wq / scale).T.contiguous()  # asymmetric: codes less the zero point
    # the codes' bounds, per element when zero points shift them
    lo_t = fmt.qmin if zp is None else (fmt.qmin - zp).T.contiguous()
    hi_t = fmt.qmax if zp is None else (fmt.qmax - zp).T.contiguous()
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
                lo, hi = (lo_t, hi_t) if zp is None else (lo_t[b0 + i], hi_t[b0 + i])
                move = (step * g * 2.0 + s * diag[b0 + i] < 0) & (target >= lo) & (target <= hi)
                step = step * move
                codes_t[b0 + i] += step
                delta = step * s
                moved[i] = delta
                if i + 1 < b1 - b0:
                    local[i + 1 :].addr_(hb[i + 1 :, i], delta)
            grad_t.addmm_(h[:, b0:b1], moved)
    return (codes_t * scale_t).T.contiguous().to(weight.dtype)
