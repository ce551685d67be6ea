"""SmoothQuant: move activation outliers into the weights with per-channel scales folded into the layer.

For each foldable pair of the layer (see :mod:`.mappings`: ``input_layernorm`` -> q/k/v, ``post_attention_layernorm``
-> gate/up (all experts of an MoE block), ``v_proj`` -> ``o_proj``, ``up_proj`` -> ``down_proj``) whose consumers
quantize their inputs::

    s_j = act_max_j ** alpha / w_max_j ** (1 - alpha)

with ``act_max_j`` the max ``|x_j|`` of the consumers' input channel ``j`` over all calibration tokens (this rank's
cached inputs run through the layer with forward hooks, merged across ranks with one all-reduce MAX: exact) and
``w_max_j`` the max ``|W[:, j]|`` over every quantized consumer (every expert's weights for an MoE block). The
producer is divided by ``s`` (the norm's weight, or V's / up's output rows) and the consumers' input columns are
multiplied by it: the layer computes the same function, with flatter activations. A channel that never fires, or
whose weights are all zero, keeps ``s = 1``.

With ``alpha_grid`` (a list of alphas), each pair gets its own alpha: the one whose smoothed consumers, weights and
inputs fake-quantized as the recipe says (max scales; the static input amax is what a max observer records after
smoothing, ``max_j act_max_j / s_j``), give the least squared output error on ``sample_tokens`` evenly spaced
tokens of every batch. Each batch's loss is added to an exact accumulator and merged across ranks (one all-reduce
SUM), so every rank picks the same alpha at every world size.

The folds leave the layer's full-precision function as it was, so the statistics pass keeps the layer's outputs
(the next layer's inputs under ``propagate="fp"``), and a consumer's static per-tensor ``max`` input quantizer
(symmetric, outside MoE experts) needs no observing pass: smoothing divides input channel ``j`` by ``s_j``, so the
max observer would record ``max_j act_max_j / s_j`` (:meth:`SmoothQuant.derived_amax`; equal up to float
rounding, which the folded layer's own computation of the smoothed input differs by). A layer whose activation
quantizers all follow this way (W8A8 with every Linear smoothed) is calibrated in one pass over the data.

A consumer that rotates its inputs (a recipe's ``[rotation]``) is smoothed before its rotation: the statistics are
of its unrotated input, and its weight ``W H`` becomes ``(W diag(s)) H`` (smooth, then rotate); its input quantizer
observes (the rotated input's range is not ``max_j act_max_j / s_j``). With ``alpha_grid`` such pairs are left out.

Recipe: ``[algorithm] name = "smoothquant"``, ``alpha`` (0.5), ``alpha_grid`` ([]: off), ``sample_tokens`` (128),
``mappings`` (which pairs; all four by default), ``propagate`` (``"fp"``: what ``calibrate`` uses when the caller
does not choose).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..layerwise.moe import moe_blocks
from ..layerwise.options import PROPAGATE_MODES
from ..quant.formats import fake_quantize
from ..runtime.params import integer, number, number_list, one_of, subset_of
from .base import LayerAlgorithm
from .mappings import KINDS, Smoothing, layer_smoothings, warn_no_pairs
from .memory import AlgorithmMemory, LayerPlanContext
from .stats import ExactSum, InputStats, merge_exact


def smoothing_scales(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``act_max ** alpha / w_max ** (1 - alpha)`` per channel (float32), 1 where either is zero or not finite."""
    act, w = act_max.double(), w_max.double()
    s = act.pow(alpha) / w.pow(1.0 - alpha)
    ok = (act > 0) & (w > 0) & torch.isfinite(s) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)
    return s.float()


def _qdq_weight(c: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """``w`` through the consumer's weight format with max scales (unchanged when it has no weight quantizer)."""
    q = getattr(c, "weight_quantizer", None)
    return w if q is None else fake_quantize(w, q.layout.amax_of(w), q.spec, q.layout)


def _qdq_input(c: nn.Module, x: torch.Tensor, act_max: torch.Tensor) -> torch.Tensor:
    """``x`` through the consumer's input quantizer, its static amax being what a max observer would record."""
    q = c.input_quantizer
    amax = q.layout.amax_of(x) if q.spec.dynamic else q.layout.amax_of(act_max[None, :])
    return fake_quantize(x, amax, q.spec, q.layout)


class SmoothQuant(LayerAlgorithm):
    """See the module docstring."""

    name = "smoothquant"
    schema = {
        "alpha": (0.5, number(0.0, 1.0)),
        "alpha_grid": ([], number_list(0.0, 1.0)),
        "sample_tokens": (128, integer(1)),
        "mappings": (list(KINDS), subset_of(*KINDS)),
        "propagate": ("fp", one_of(*PROPAGATE_MODES)),
    }
    changes_weights = True
    preserves_function = True

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """Per-channel maxima (float32, and a count) of the pairs whose consumers quantize their input, all-reduced;
        with ``alpha_grid``, this rank's token samples of each pair (``sample_tokens`` per batch), twice while the
        grid is searched."""
        with_input = {lin.name for lin in context.linears if lin.input is not None}
        pairs = [s for s in context.smoothings_of(tuple(params.get("mappings", ()))) if with_input & set(s.consumers)]
        maxima = sum(4 * s.dim + 8 for s in pairs)
        samples = 0
        if params.get("alpha_grid"):
            tokens = context.local_batches * int(params.get("sample_tokens", 128))
            samples = sum(4 * tokens * s.dim for s in pairs)
        return AlgorithmMemory(cls.name, collect=maxima + samples, merge=2 * maxima + samples,
                               solve=maxima + 2 * samples)  # fmt: skip

    def __init__(self, params: Mapping[str, Any] | None = None):
        super().__init__(params)
        self.alpha = float(self.params["alpha"])
        self.grid = [float(a) for a in self.params["alpha_grid"]]
        self.kinds = tuple(self.params["mappings"])
        #: Per layer name: ``{smoothing key: scales}`` of the last run (for inspection and tests).
        self.scales: dict[str, dict[str, torch.Tensor]] = {}
        #: Per layer name: ``{smoothing key: alpha}`` chosen (with ``alpha_grid``).
        self.alphas: dict[str, dict[str, float]] = {}
        self._warned: set[str] = set()
        #: The last layer smoothed from its own statistics pass: its name, and per pair the per-channel maxima and
        #: the tokens seen (for :meth:`derived_amax`, with the scales in :attr:`scales`).
        self._smoothed: tuple[str, list[tuple[Smoothing, torch.Tensor, int]]] | None = None

    def takes_collected_max(self) -> bool:
        return not self.grid  # the grid needs token samples, which a report does not hold

    def smoothings(self, step: Any) -> list[Smoothing]:
        # scales fold into rotated consumers before their rotation; the alpha grid's losses use unrotated weights
        found = layer_smoothings(step.layer, self.kinds, prefix=step.name, rotated_consumers=not self.grid)
        if not found and any(getattr(m, "input_quantizer", None) is not None for m in step.layer.modules()):
            warn_no_pairs(self.name, step.name, self._warned)
        return [m for m in found if m.quantized("input")]

    def before_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        self._smoothed = None
        smoothings = self.smoothings(step)
        if not smoothings:  # the same on every rank (same layer, same recipe): no collective is skipped unevenly
            return
        collected = self._collected(step, smoothings)
        stats = None
        if collected is None:
            kinds = {"max", "samples"} if self.grid else {"max"}
            stats = (
                InputStats({m.key: m.point for m in smoothings}, kinds, self.params["sample_tokens"], rotated=False)
                .collect(step, keep_outputs=True)  # the folds keep the function: these stay the FP outputs
                .merge(group)
            )
            collected = [stats[m.key].max for m in smoothings]
        maxima = [m.reduce(c.to(step.device), "max") for m, c in zip(smoothings, collected)]
        w_maxima = [
            m.weight_max(m.quantized("weight") or m.quantized("input")).to(a.device) for m, a in zip(smoothings, maxima)
        ]
        alphas = [self.alpha] * len(smoothings)
        if self.grid:
            losses = ExactSum((len(smoothings), len(self.grid)), maxima[0].device)
            for i, (m, act, w) in enumerate(zip(smoothings, maxima, w_maxima)):
                losses_i = self._losses(m, act, w, stats[m.key].samples)
                for j, per_batch in enumerate(losses_i):
                    for loss in per_batch:
                        onehot = torch.zeros(losses.hi.shape, dtype=torch.float64, device=losses.hi.device)
                        onehot[i, j] = loss
                        losses.add(onehot)
            merge_exact([losses], group)
            best = torch.argmin(losses.value(), dim=1).tolist()  # the first (smallest listed) alpha on a tie
            alphas = [self.grid[b] for b in best]
        applied, smoothed = {}, []
        for m, act, w, alpha in zip(smoothings, maxima, w_maxima, alphas):
            s = smoothing_scales(act, w, alpha)
            m.fold(s)
            applied[m.key] = s.cpu()
            if stats is not None:
                smoothed.append((m, act, stats[m.key].tokens))
        self.scales[step.name] = applied
        if self.grid:
            self.alphas[step.name] = {m.key: a for m, a in zip(smoothings, alphas)}
        if stats is not None:
            self._smoothed = (step.name, smoothed)

    def derived_amax(self, step: Any) -> list[tuple[Any, torch.Tensor, int]]:
        """The smoothed consumers' static per-tensor max input quantizers: ``max_j act_max_j / s_j`` (see the module
        docstring). Not for MoE experts (each observes its routed tokens only)."""
        if self._smoothed is None or self._smoothed[0] != step.name:
            return []
        in_experts = {id(m) for block in moe_blocks(step.layer) for m in block.modules()}
        out = []
        scales = self.scales[step.name]
        for m, act, tokens in self._smoothed[1]:
            top = (act / scales[m.key].to(act.device)).max()
            for c in m.quantized("input"):
                q = c.input_quantizer
                spec = q.spec
                if id(c) in in_experts or spec.dynamic or spec.observer != "max" or not spec.symmetric:
                    continue
                if getattr(c, "input_rotation", None) is not None:  # its quantizer sees the rotated input: observed
                    continue
                if q.layout.num_slots != 1:
                    continue
                out.append((q, top.reshape(q.layout.amax_shape).float(), tokens * c.in_features))
        return out

    def _collected(self, step: Any, smoothings: list[Smoothing]) -> list[torch.Tensor] | None:
        """The capture points' maxima from a collected activation report (see ``collected_max``), or None. Names: the
        capture point itself, and for ``attn_in`` the q/k/v inputs (the same tensor)."""
        if self.collected_max is None or self.grid:
            return None
        names = {id(m): n for n, m in step.layer.named_modules(prefix=step.name)}
        candidates = []
        for m in smoothings:
            module, where = m.point
            own = [f"{names[id(module)]}:{where}"]
            if m.kind == "attn_in":
                own += [f"{names[id(c)]}:input" for c in m.consumers]
            candidates.append(own)
        return self.collected_max(candidates)

    @torch.no_grad()
    def _losses(
        self, m: Smoothing, act_max: torch.Tensor, w_max: torch.Tensor, samples: list[torch.Tensor]
    ) -> list[list[float]]:
        """Per alpha of the grid, per sampled batch: the consumers' summed squared output error, W and input quantized."""
        consumers = m.quantized("input")
        weights = [c.weight.detach().float() for c in consumers]
        refs = [[x.to(w.device) @ w.T for x in samples] for w in weights]
        out = []
        for alpha in self.grid:
            sc = m.expand(smoothing_scales(act_max, w_max, alpha))
            per_batch = [0.0] * len(samples)
            for c, w, ref in zip(consumers, weights, refs):
                sc_c = sc.to(w.device)
                wq = _qdq_weight(c, w * sc_c[None, :])
                amax_in = m.expand(act_max).to(w.device) / sc_c
                for b, x in enumerate(samples):
                    xq = _qdq_input(c, x.to(w.device) / sc_c[None, :], amax_in)
                    per_batch[b] += float((xq @ wq.T - ref[b]).double().pow(2).sum())
            out.append(per_batch)
        return out
