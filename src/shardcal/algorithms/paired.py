"""Paired input statistics: each quantized Linear's input in the full-precision stream beside its input in the
quantized stream, token by token — what GPTQ's ``stream_correction`` fits (GPTAQ-style asymmetric calibration,
Li et al., 2025: arXiv 2504.02692).

For a Linear with weight ``W``, let ``t`` be its input when the full-precision model runs (the layer's
:attr:`~shardcal.layerwise.steps.LayerStep.reference_inputs` through the unchanged layer) and ``q`` its input in
the stream being calibrated, passed through the Linear's own input quantizer (none: as it comes). The layer should
give ``W t`` and computes ``W' q``; over the calibration tokens the least-squares ``W'`` is

    ``W* = W + W (C_tq - C_qq) (C_qq + λ I)^-1``,  ``C_tq = Σ t q^T``,  ``C_qq = Σ q q^T``

(``λ`` GPTQ's damping: with ``t = q`` the step is exactly zero, so the damping never shrinks the weight). It
corrects, in one linear map, the drift the previous quantized layers left in the stream and the error of this
Linear's own input quantization. :func:`corrected_weight` takes the fraction ``α`` of that step; GPTQ then rounds
the result against ``C_qq``, its Hessian on the inputs the quantized layer will really see. The full step over-fits
the calibration tokens and loses on held-out text; a quarter of it is what the shipped recipes use.

Sums are exact (:class:`~shardcal.algorithms.stats.ExactSum`), one all-reduce for all of a layer's Linears, so the
statistics are the same bits at every world size. A static input quantizer is calibrated first, on the layer's
stream inputs (its observer, merged over ranks), to quantize ``q``; the runner calibrates it again afterwards as
usual. Linears inside a sparse MoE block see other tokens in the two streams (routing differs) and are not paired.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from ..layerwise.moe import ExpertTokenMasks, in_moe_blocks
from ..layerwise.steps import LayerStep
from ..quant.linear import QuantLinear, rotated_input
from ..quant.quantizer import QuantMode, TensorQuantizer
from ..quant.session import CalibrationSession, quantizer_mode
from ..quant.tokens import real_positions
from .stats import ExactSum, merge_exact


def pairable(layer: nn.Module, targets: Sequence[tuple[str, QuantLinear]]) -> list[tuple[str, QuantLinear]]:
    """The targets whose inputs line up token by token in both streams: those outside sparse MoE blocks."""
    inside = in_moe_blocks(layer)
    return [(n, m) for n, m in targets if id(m) not in inside]


class PairedGrams:
    """``C_qq`` and ``C_tq`` (see the module docstring) of chosen Linears of one decoder layer, over every rank.

    Use::

        grams = PairedGrams(targets).collect(step, group)   # collective
        cqq, ctq = grams[name]
    """

    def __init__(self, targets: Sequence[tuple[str, QuantLinear]]):
        self.targets = list(targets)
        self._sums: dict[str, tuple[ExactSum, ExactSum]] = {}

    def __getitem__(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        qq, tq = self._sums[name]
        return qq.value(), tq.value()

    def __contains__(self, name: str) -> bool:
        return name in self._sums

    def collect(self, step: LayerStep, group: Any) -> PairedGrams:
        """Calibrate the targets' static input quantizers on the stream, then run each of this rank's batches
        through the layer twice — the full-precision stream, then the stream being calibrated — with every quantizer
        off, and sum the products; merge over ``group`` (collective: every rank calls it, also one with no batch).
        Nothing to do without targets."""
        if not self.targets:
            return self
        if step.reference_inputs is None:
            raise ValueError(f"{step.name}: paired statistics need the reference stream (reference_stream=True)")
        self._calibrate_inputs(step, group)
        self._sums = {
            n: (ExactSum((m.in_features,) * 2, step.device), ExactSum((m.in_features,) * 2, step.device))
            for n, m in self.targets
        }
        for i in range(len(step.inputs)):
            reference = self._capture(step, lambda i=i: step.forward_reference(i))
            self._accumulate(step, i, reference)
        merge_exact([s for pair in self._sums.values() for s in pair], group)
        return self

    def _calibrate_inputs(self, step: LayerStep, group: Any) -> None:
        """The targets' static input quantizers, calibrated with their observers on this step's stream inputs (the
        layer in full precision), merged over ranks."""
        quantizers = [m.input_quantizer for _, m in self.targets if _static(m.input_quantizer)]
        with quantizer_mode(step.layer, QuantMode.DISABLED):
            for _ in CalibrationSession(quantizers, group).passes():  # each pass merged: collective
                with ExpertTokenMasks(step.layer):
                    step.forward_all(keep_outputs=False)

    def _capture(self, step: LayerStep, run: Any) -> dict[str, torch.Tensor]:
        """Each target's input rows (real tokens, float32, as its weight sees them) in one forward ``run()``; Linears
        that read one tensor get one rows tensor."""
        seen: dict[str, torch.Tensor] = {}
        rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def record(module: nn.Module, args: tuple, name: str) -> None:
            x = rotated_input(module, args[0].detach())
            if id(x) not in rows_of:
                rows_of[id(x)] = (x, _rows(x))  # the source is held, so its id is not reused meanwhile
            seen[name] = rows_of[id(x)][1]

        with ExitStack() as stack:
            stack.enter_context(quantizer_mode(step.layer, QuantMode.DISABLED))
            for name, module in self.targets:
                hook = module.register_forward_pre_hook(lambda m, args, name=name: record(m, args, name))
                stack.callback(hook.remove)
            run()
        return seen

    def _accumulate(self, step: LayerStep, i: int, reference: dict[str, torch.Tensor]) -> None:
        stream = self._capture(step, lambda i=i: step.forward(i))
        # q / k / v share one input and (equal ranges) one quantization of it: each product is computed once
        products: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for name, module in self.targets:
            t, x = reference[name], stream[name]
            if t.shape != x.shape:
                raise ValueError(f"{name}: {t.shape[0]} reference tokens against {x.shape[0]} in the stream")
            q = _quantized(module.input_quantizer, x)
            key = (id(t), id(q))
            if key not in products:
                products[key] = (q, q.T @ q, t.T @ q)
            qq, tq = self._sums[name]
            qq.add(products[key][1])
            tq.add(products[key][2])


def _static(q: TensorQuantizer | None) -> bool:
    return q is not None and not q.spec.dynamic


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[tokens, channels]`` float32 without padding tokens (the step declares the batch's mask)."""
    return real_positions(x).reshape(-1, x.shape[-1]).float()


def _quantized(q: TensorQuantizer | None, rows: torch.Tensor) -> torch.Tensor:
    """What the Linear computes with: ``rows`` through its input quantizer (calibrated, or dynamic), else as they are."""
    if q is None:
        return rows
    saved = q.mode
    q.mode = QuantMode.QUANTIZE
    try:
        return q(rows)
    finally:
        q.mode = saved


@torch.no_grad()
def corrected_weight(
    weight: torch.Tensor, cqq: torch.Tensor, ctq: torch.Tensor, fraction: float, percdamp: float
) -> torch.Tensor:
    """``W + fraction * W (C_tq - C_qq) (C_qq + λ I)^-1`` (float32, ``weight``'s device), ``λ = percdamp`` times the
    mean of ``diag(C_qq)``; see the module docstring. Computed in float64 with one Cholesky factorization; the
    damping grows tenfold until ``C_qq + λ I`` is positive definite (a :class:`torch.linalg.LinAlgError` after six
    tries)."""
    h = cqq.to(torch.float64)
    eye = torch.eye(h.shape[0], dtype=torch.float64, device=h.device)
    damp = percdamp * float(torch.diagonal(h).mean()) or percdamp
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            break
        damp *= 10.0
    else:
        raise torch.linalg.LinAlgError("the quantized inputs' Gram matrix is not positive definite even when damped")
    w = weight.detach().to(device=h.device, dtype=torch.float64)
    rhs = (w @ (ctq.to(torch.float64) - h)).T  # [in, out]; (C_qq + λ I) is symmetric
    step = torch.cholesky_solve(rhs, chol).T
    return (w + fraction * step).to(device=weight.device, dtype=torch.float32)
