"""AWQ: activation-aware per-channel weight scaling (Lin et al., 2023), folded into the layer like SmoothQuant.

For each foldable pair of the layer (:mod:`.mappings`; all four kinds by default) whose consumers quantize their
weights, a grid search over the scale exponent ``r`` in ``{0, 1/grid, ..., (grid-1)/grid}``::

    s = x_mean ** r / w_mean ** (1 - r)        (duo_scaling; ``x_mean ** r`` without it)
    s = s / sqrt(max(s) * min(s))
    loss(r) = sum over tokens and consumers of || Q(W diag(s)) diag(1/s) x - W x ||^2

``x_mean`` is the mean ``|x|`` of each input channel over all calibration tokens, ``w_mean`` the mean over the
consumers' rows of ``|W|`` normalised per quantization group (AutoAWQ's statistics); ``Q`` is the recipe's weight
format and granularity with max scales. The loss is the consumers' output error summed over every rank's tokens:
with ``H = sum_x x x^T`` it is ``sum_W tr(E H E^T)``, ``E = Q(W diag(s)) diag(1/s) - W``, and ``H`` is merged
across ranks exactly (one all-reduce SUM; :class:`.stats.ExactSum`) — the same number as all-reducing each rank's
loss, but bit-identical at every world size, so every rank picks the same ``r``. The best ``s`` is folded into the
producer (divided) and the consumers (multiplied), which keeps the layer's full-precision function.

Then, with ``clip`` (default on), the weight scales are chosen activation-aware: for every quantization group
(per-channel: every row) the amax ``c * max|w|``, ``c`` in ``{1, 1 - max_shrink/clip_grid, ...}`` down to
``1 - max_shrink``, with the least output error ``e H_gg e^T`` on the group's block of the (smoothed) inputs'
Hessian replaces the recipe observer's amax.

The loss is measured on each pair's consumer Linears' outputs (for q/k/v the projections, not the attention output;
for gate/up the projections, not the MLP output), which needs one pass over the data per layer for the Hessians
and no forward per grid point. Recipe: ``[algorithm] name = "awq"``, ``grid`` (20), ``duo_scaling`` (true),
``mappings`` (all), ``clip`` (true), ``clip_grid`` (20), ``max_shrink`` (0.5), ``propagate`` ("fp").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..layerwise.options import PROPAGATE_MODES
from ..quant.formats import FORMATS, fake_quantize
from ..quant.linear import QuantLinear
from ..quant.quantizer import TensorQuantizer
from ..runtime.params import boolean, integer, number, one_of, subset_of
from .base import AlgorithmStep, LayerAlgorithm
from .mappings import KINDS, Smoothing, layer_smoothings, warn_no_pairs
from .memory import EXACT_SUM_BYTES, GRAM_ADD_BYTES, AlgorithmMemory, LayerPlanContext
from .scales import clip_search_amax
from .stats import InputStats, threads


def _max_qdq(w: torch.Tensor, q: TensorQuantizer, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` fake-quantized with the quantizer's format and granularity, amax = max |w| per slot (asymmetric:
    the range ``[min w, max w]`` per slot); ``amax``: the range it shares with the Linears vLLM fuses it with."""
    if q.spec.symmetric:
        return fake_quantize(w, q.layout.amax_of(w) if amax is None else amax, q.spec, q.layout)
    hi, lo = q.layout.range_of(w)
    return fake_quantize(w, hi, q.spec, q.layout, lo)


def _output_error(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``tr(E H E^T)`` in float64: the summed squared output error of a weight error ``E`` on inputs with Gram ``H``."""
    return ((e @ h) * e).sum(dtype=torch.float64)


def _w_mean(weights: list[torch.Tensor], quantizers: list[TensorQuantizer]) -> torch.Tensor:
    """Per input column: mean over all rows of ``|w|`` divided by its quantization group's max (AutoAWQ)."""
    parts = []
    for w, q in zip(weights, quantizers):
        lay = q.layout
        if lay.group_size is not None:
            a = lay.arrange(w.abs())
            parts.append(lay.restore(a / (a.amax(dim=-1, keepdim=True) + 1e-6)))
        else:
            a = w.abs()
            parts.append(a / (a.amax(dim=1, keepdim=True) + 1e-6))
    return torch.cat(parts, dim=0).mean(dim=0)


def _small(linears: list[nn.Linear]) -> bool:
    """Small CPU weights: their kernels run faster on one thread."""
    return all(m.weight.device.type == "cpu" for m in linears) and sum(m.weight.numel() for m in linears) <= 1 << 18


def _supported(q: TensorQuantizer) -> bool:
    return FORMATS[q.spec.format].kind in ("int", "fp8") and not q.spec.dynamic


class AWQ(LayerAlgorithm):
    """See the module docstring."""

    name = "awq"
    schema = {
        "grid": (20, integer(1)),
        "duo_scaling": (True, boolean),
        "mappings": (list(KINDS), subset_of(*KINDS)),
        "clip": (True, boolean),
        "clip_grid": (20, integer(1)),
        "max_shrink": (0.5, number(0.0, 1.0, hi_open=True)),
        "propagate": ("fp", one_of(*PROPAGATE_MODES)),
    }
    changes_weights = True

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """The exact-sum Gram matrices (``[d, d]``, mean, count) of the pairs it scales and, with ``clip``, of the
        Linears no pair covers; a float32 clip Hessian per supported Linear (alive through weight calibration);
        the scale search's six float32 copies of a pair's consumer weights."""
        by_name = {lin.name: lin for lin in context.linears}
        weighted = {n for n, lin in by_name.items() if lin.weight is not None}
        supported = {n for n in weighted if by_name[n].static_int_or_fp8_weight}
        pairs = [
            s
            for s in context.smoothings_of(tuple(params.get("mappings", ())))
            if weighted & set(s.consumers) and all(c in supported for c in s.consumers if c in weighted)
        ]
        covered = {c for s in pairs for c in s.consumers}
        clip = bool(params.get("clip", True))
        dims = [s.dim for s in pairs] + (
            [by_name[n].in_features for n in supported if n not in covered] if clip else []
        )
        if not dims:
            return AlgorithmMemory(cls.name)
        grams = sum(EXACT_SUM_BYTES * (d * d + d + 1) for d in dims)
        clip_hessians = 4 * sum(by_name[n].in_features ** 2 for n in supported) if clip else 0
        widest = max(dims)
        search = max(
            (6 * 4 * sum(by_name[c].in_features * by_name[c].out_features for c in s.consumers if c in supported)
             for s in pairs),
            default=0,
        )  # fmt: skip
        return AlgorithmMemory(
            cls.name,
            collect=grams + GRAM_ADD_BYTES * widest**2,
            merge=2 * grams if context.world_size > 1 else grams,
            solve=grams + clip_hessians + 16 * widest**2 + search,
            held=clip_hessians,
        )

    def __init__(self, params: Mapping[str, Any] | None = None):
        super().__init__(params)
        self.kinds = tuple(self.params["mappings"])
        #: Per layer name: ``{smoothing key: best exponent r}`` of the last run (for inspection).
        self.ratios: dict[str, dict[str, float]] = {}
        self._clip_hessians: dict[int, tuple[nn.Linear, torch.Tensor]] = {}
        self._warned: set[str] = set()

    def _smoothings(self, step: Any) -> list[Smoothing]:
        found = layer_smoothings(step.layer, self.kinds, prefix=step.name)
        if not found and any(getattr(m, "weight_quantizer", None) is not None for m in step.layer.modules()):
            warn_no_pairs(self.name, step.name, self._warned)
        return [
            m
            for m in found
            if m.quantized("weight") and all(_supported(c.weight_quantizer) for c in m.quantized("weight"))
        ]

    def plan_step(self, step: Any, recipe: Any) -> AlgorithmStep:
        """One statistics pass when it has a pair to scale or a Linear to clip; it leaves no outputs."""
        return AlgorithmStep(passes=bool(self._points(step, self._smoothings(step))[0]))

    def _points(
        self, step: Any, smoothings: list[Smoothing]
    ) -> tuple[dict[str, Any], list[tuple[str, QuantLinear]], dict[int, str]]:
        """The statistics pass's capture points (the pairs', and with ``clip`` the inputs of the supported Linears no
        pair covers), the supported Linears, and which pair covers which Linear (by id)."""
        linears = [
            (n, m)
            for n, m in step.layer.named_modules(prefix=step.name)
            if isinstance(m, QuantLinear) and m.weight_quantizer is not None and _supported(m.weight_quantizer)
        ]
        covered = {id(c): m.key for m in smoothings for c in m.consumers}
        points = {m.key: m.point for m in smoothings}
        if self.params["clip"]:
            # keyed apart from the pairs: a pair's key is its producer's name, which may be a Linear's (v_proj)
            points.update({f"{n}:input": (m, "input") for n, m in linears if id(m) not in covered})
        return points, linears, covered

    def before_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        smoothings = self._smoothings(step)
        points, linears, covered = self._points(step, smoothings)
        self._clip_hessians = {}
        if not points:
            return
        stats = InputStats(points, {"gram", "abssum"}).collect(step).merge(group)
        cols: dict[str, torch.Tensor] = {}  # smoothing key -> the consumers' input scales chosen
        ratios = {}
        for m in smoothings:
            st = stats[m.key]
            h = st.hessian().float()
            with threads(1 if _small(m.quantized("weight")) else None):
                r, s = self._search(m, h, m.reduce(st.mean_abs().float(), "mean"))
            s = m.fold(s)
            cols[m.key] = m.expand(s).to(h.device)
            ratios[m.key] = r
        self.ratios[step.name] = ratios
        if self.params["clip"]:
            for n, lin in linears:
                key = covered.get(id(lin), f"{n}:input")
                h = stats[key].hessian().float()
                if key in cols:  # the consumer now sees x / s: H -> diag(1/s) H diag(1/s)
                    inv = 1.0 / cols[key]
                    h = h * inv[:, None] * inv[None, :]
                self._clip_hessians[id(lin)] = (lin, h)

    def _search(self, m: Smoothing, h: torch.Tensor, x_mean: torch.Tensor) -> tuple[float, torch.Tensor]:
        """``(best exponent r or -1 for no scaling, scales)`` for one pair."""
        consumers = m.quantized("weight")
        weights = [c.weight.detach().float() for c in consumers]
        quantizers = [c.weight_quantizer for c in consumers]
        h = h.to(weights[0].device)
        w_mean = m.reduce(_w_mean(weights, quantizers), "mean").to(x_mean.device)
        x_mean = x_mean.clamp(min=0)
        best = (math.inf, -1.0, torch.ones_like(x_mean))
        grid = self.params["grid"]
        shares = m.shares_weight_range(consumers)  # fp8 per-tensor members of a vLLM fused layer: one range
        for i in range(-1, grid):  # -1: no scaling at all, so the search never does worse than plain rounding
            r = i / grid
            if i < 0:
                s = torch.ones_like(x_mean)
            elif self.params["duo_scaling"]:
                s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
            else:
                s = x_mean.pow(r).clamp(min=1e-4)
            s = s / torch.sqrt(s.max() * s.min())
            if not bool(torch.isfinite(s).all()):
                continue
            s = m.stored_scales(s)  # what folding it into the producer applies: the loss scores that
            sc = m.expand(s).to(weights[0].device)
            shared = m.shared_weight_amax(consumers, [w * sc[None, :] for w in weights]) if shares else None
            loss = sum(
                float(
                    _output_error(
                        _max_qdq(w * sc[None, :], q, None if shared is None else shared[k]) / sc[None, :] - w, h
                    )
                )
                for k, (w, q) in enumerate(zip(weights, quantizers))
            )
            if loss < best[0]:
                best = (loss, r, s)
        return best[1], best[2]

    def after_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        if not self.params["clip"]:
            return
        for lin, h in self._clip_hessians.values():
            with threads(1 if _small([lin]) else None):
                found = clip_search_amax(
                    lin.weight.detach().float(),
                    lin.weight_quantizer,
                    h.to(lin.weight.device),
                    self.params["max_shrink"],
                    self.params["clip_grid"],
                )
            if found is not None:
                lin.weight_quantizer.set_amax(*found)
        self._clip_hessians = {}
