"""GPTQ's column solve: one weight quantized column by column against its inputs' Hessian, each column's rounding
error spread over the columns not yet quantized (Frantar et al., 2022).

Columns are quantized in blocks of ``block_size`` (optionally in decreasing ``diag(H)`` order with ``act_order``), and
each column's error is spread through the upper Cholesky factor of ``(H + percdamp * mean(diag H) * I)^-1``, the
damping raised tenfold until the damped Hessian is positive definite (:func:`prepare_hessian`, shared by the Linears
of one input). The scales are static, the ones the weight quantizer calibrated, or computed group by group from the
columns as updated so far; nvfp4 takes its block scales the same way. Columns whose input is always zero
(``H_jj = 0``) are rounded to nearest and pass no error on. The algorithm around the solve (the Hessians, the solves
shared across ranks, the recipe's parameters) is :mod:`.gptq`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import RecipeError
from ..quant.formats import FORMATS, fake_quantize, nvfp4_global_scale, qparams, round_e2m1, round_to_fp8_e4m3
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import NVFP4_BLOCK_SIZE
from .scales import element_qparams, nvfp4_element_scales
from .stats import threads

#: GPTQ's parameter defaults: the recipe schema's and :func:`gptq_quantize`'s, one source for both.
DEFAULTS: dict[str, Any] = {"block_size": 128, "percdamp": 0.01, "act_order": False, "static_groups": False}


def check_quantizer(q: TensorQuantizer, name: str) -> None:
    """GPTQ needs a calibrated weight amax and a format it can round column by column: int, fp8, nvfp4 or MX."""
    spec = q.spec
    if FORMATS[spec.format].kind not in ("int", "fp8", "nvfp4", "mx"):
        raise RecipeError(f"{name}: gptq supports int8, int4, fp8_e4m3, nvfp4 and MX weights, not {spec.format!r}")
    if not q.calibrated or q.amax is None:
        raise RecipeError(f"{name}: gptq needs a calibrated static weight quantizer")


def _quantize_column(
    w: torch.Tensor, scale: torch.Tensor, fmt: str, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """Fake quantization of one column with its static scales (and zero points): the same arithmetic as
    ``formats.fake_quantize``."""
    f = FORMATS[fmt]
    if zero_point is not None:
        return torch.clamp(torch.round(w / scale), f.qmin - zero_point, f.qmax - zero_point) * scale
    scaled = torch.clamp(w / scale, f.qmin, f.qmax)
    if f.kind == "nvfp4" or fmt == "mxfp4":  # ``scale``: the element's block scale (nvfp4: over the global scale)
        return round_e2m1(scaled) * scale
    q = torch.round(scaled) if f.kind == "int" else round_to_fp8_e4m3(scaled)
    return q * scale


def _upper_cholesky_of_inverse(h: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``U`` upper triangular with ``H^-1 = U^T U`` (``info`` != 0: not positive definite), from one Cholesky.

    With ``J`` the reversal permutation and ``J H J = L L^T``: ``H^-1 = (J L^-T J)(J L^-1 J)`` and ``J L^-1 J`` is
    upper triangular with a positive diagonal, i.e. the Cholesky factor of ``H^-1`` (no explicit inverse of H).
    """
    chol, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info) != 0:
        return chol, int(info)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.solve_triangular(chol, eye, upper=False).flip(0, 1), 0


#: The damping schedule: ``percdamp * 10**k`` of the mean diagonal, ``k = 0 .. DAMPING_TRIES - 1``, until the damped
#: Hessian is positive definite.
DAMPING_TRIES = 6


def _inverse_hessian_factor(h: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, float]:
    """``(upper Cholesky factor of (H + damp I)^-1 in float64, the relative damping used)``: the damping grows
    tenfold (:data:`DAMPING_TRIES` tries) until H is positive definite; LinAlgError after the last."""
    diag_mean = torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    damp = percdamp
    for _ in range(DAMPING_TRIES):
        factor, info = _upper_cholesky_of_inverse(h + damp * diag_mean * eye)
        if info == 0:
            return factor, damp
        damp *= 10.0
    raise torch.linalg.LinAlgError(
        f"the Hessian is not positive definite even with damping {damp / 10.0:g} x its mean diagonal"
    )


def _group_range(spec: Any, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The amax (and, asymmetric, amin) the recipe's observer gives one group of columns ``values`` [out, group]
    (shape [out, 1])."""
    q = TensorQuantizer(spec, tuple(values.shape), device=values.device)
    amax = q.calibrate_from(values).clone()
    return amax, None if q.amin is None else q.amin.clone()


@dataclasses.dataclass(frozen=True)
class PreparedHessian:
    """What GPTQ needs of one Hessian, whatever the weight: computed once for Linears that share their inputs
    (q/k/v, gate/up). ``factor`` is None when no input ever reached the Linear (every column dead)."""

    perm: torch.Tensor | None  # act_order's column order (decreasing diag H)
    factor: torch.Tensor | None  # float32 upper Cholesky factor of the damped inverse, in ``perm`` order
    damping: float  # the relative damping used


@torch.no_grad()
def prepare_hessian(
    hessian: torch.Tensor, *, percdamp: float = DEFAULTS["percdamp"], act_order: bool = DEFAULTS["act_order"]
) -> PreparedHessian:
    """The column order and inverse factor GPTQ derives from ``hessian`` [in, in] (see :func:`gptq_quantize`).
    Dead columns (``H_jj = 0``) get a unit diagonal; LinAlgError when no damping makes H positive definite."""
    h = hessian.detach().to(dtype=torch.float64).clone()
    dead = torch.diag(h) == 0
    if bool(dead.all()):
        return PreparedHessian(None, None, percdamp)
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        h = h[perm][:, perm]
    factor, used = _inverse_hessian_factor(h, percdamp)  # on every thread: one large factorization
    return PreparedHessian(perm, factor.float(), used)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | PreparedHessian,
    quantizer: TensorQuantizer,
    *,
    percdamp: float = DEFAULTS["percdamp"],
    block_size: int = DEFAULTS["block_size"],
    act_order: bool = DEFAULTS["act_order"],
    static_groups: bool = DEFAULTS["static_groups"],
    info: dict[str, Any] | None = None,
) -> torch.Tensor:
    """GPTQ's quantized (dequantized values) ``weight`` [out, in] for inputs with Hessian ``hessian`` [in, in]
    (or that Hessian as :func:`prepare_hessian` left it, with the same ``percdamp`` and ``act_order``: Linears
    that share their inputs share one preparation).

    ``quantizer`` is the weight's calibrated quantizer. With ``static_groups`` its scales are used as they are;
    without (per-group granularity, no ``act_order``) each group's scales are computed with the recipe's observer
    when GPTQ reaches the group, from the group's columns as updated so far, and stored in the quantizer. Either
    way ``quantizer(result) == result``. Returns a tensor of ``weight``'s dtype and device.

    nvfp4 (FP4-aware GPTQ): the global scale comes from the calibrated amax (shared by a vLLM fused layer's
    members); each block of 16 columns gets its FP8
    block scale from its columns as updated so far when GPTQ reaches it (from the original weight with
    ``act_order`` or ``static_groups``). The quantizer derives block scales from the weight it is given, so a block
    whose largest value GPTQ moved below the top code would be rescaled: the result is passed through the
    quantizer once more (``info["nvfp4_requantized"]``: the fraction of elements that changed there).
    """
    check_quantizer(quantizer, quantizer.name)
    fmt = quantizer.spec.format
    nvfp4 = FORMATS[fmt].kind == "nvfp4"
    w = weight.detach().float()
    fixed = static_groups or act_order or FORMATS[fmt].kind == "mx"  # MX: the calibrated block scales, kept
    group = None if fixed else NVFP4_BLOCK_SIZE if nvfp4 else quantizer.layout.group_size
    if group is not None:
        block_size = -(-block_size // group) * group  # whole groups per block: a group's columns are all current
    scale, zp = element_qparams(quantizer, w)
    out, n = w.shape
    prepared = (
        hessian
        if isinstance(hessian, PreparedHessian)
        else prepare_hessian(hessian.to(w.device), percdamp=percdamp, act_order=act_order)
    )
    if prepared.factor is None:
        if group is None:  # no input ever reached it: round to nearest
            return _quantize_column(w, scale, fmt, zp).to(weight.dtype)
        prepared = PreparedHessian(None, torch.eye(n, device=w.device), prepared.damping)  # dead: per-group RTN
    perm = prepared.perm
    if perm is not None:
        perm = perm.to(w.device)
        w, scale = w[:, perm], scale[:, perm]
        zp = zp[:, perm] if zp is not None else None
    small = w.device.type == "cpu" and out * block_size <= 1 << 20 and n <= 8192
    amax = quantizer.amax.detach().clone() if group is not None and not nvfp4 else None
    amin = quantizer.amin.detach().clone() if group is not None and quantizer.amin is not None else None
    group_spec = (
        dataclasses.replace(quantizer.spec, granularity="channel", axis=0, group_size=None)
        if group and not nvfp4
        else None
    )
    global_scale = nvfp4_global_scale(quantizer.amax.detach().to(w.device)) if nvfp4 else None
    with threads(1 if small else None):
        hinv = prepared.factor.to(w.device)
        if info is not None:
            info["damping"] = prepared.damping
        # Work on the transposed weight: a column of W is a contiguous row here.
        wt, st = w.T.clone(memory_format=torch.contiguous_format), scale.T.contiguous()
        zt = zp.T.contiguous() if zp is not None else None
        qt = torch.empty_like(wt)
        for i1 in range(0, n, block_size):
            i2 = min(i1 + block_size, n)
            w1, h1 = wt[i1:i2], hinv[i1:i2, i1:i2]
            err1 = torch.empty_like(w1)
            diag = h1.diagonal().tolist()
            for i in range(i2 - i1):
                if group is not None and (i1 + i) % group == 0 and nvfp4:  # the block's scales, from its columns
                    st[i1 + i : i1 + i + group] = nvfp4_element_scales(w1[i : i + group].T, global_scale).T
                elif group is not None and (i1 + i) % group == 0:  # the group's range, with the recipe's observer
                    g = (i1 + i) // group
                    hi, lo = _group_range(group_spec, w1[i : i + group].T)
                    amax[:, g] = hi.reshape(-1).to(amax.device)
                    if lo is not None:
                        amin[:, g] = lo.reshape(-1).to(amin.device)
                    gs, gz = qparams(amax[:, g], None if lo is None else amin[:, g], fmt)
                    st[i1 + i : i1 + i + group] = gs.to(st.device)
                    if gz is not None:
                        zt[i1 + i : i1 + i + group] = gz.to(zt.device)
                row = w1[i]
                q = _quantize_column(row, st[i1 + i], fmt, None if zt is None else zt[i1 + i])
                qt[i1 + i] = q
                torch.sub(row, q, out=err1[i]).div_(diag[i])
                if i + 1 < i2 - i1:
                    w1[i + 1 :].addr_(h1[i, i + 1 :], err1[i], alpha=-1.0)
            if i2 < n:
                wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1.0)
    if amax is not None:
        quantizer.set_amax(amax, amin)
    q = qt.T
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    q = q.contiguous()
    if nvfp4:
        settled = fake_quantize(q, quantizer.amax, quantizer.spec, quantizer.layout)
        if info is not None:
            info["nvfp4_requantized"] = float((settled != q).float().mean())
        q = settled
    return q.to(weight.dtype)
