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
of its unrotated input, and the runner folds the rotation in after the smoothing (``smooths_before_rotation``), so
its weight is ``(W diag(s)) H``, rotated once. Its static per-tensor ``max`` input quantizer's range is not
``max_j act_max_j / s_j`` but ``max |(x / s) H|``: the statistics pass keeps every real token's row of such a pair
(on the step's cache device), and after the folds the amax is taken from them, rotated as the Linear will rotate
(all-reduced MAX: exact), so that such a layer too is calibrated in one pass over the data — at the cost of those
rows (4 bytes per token and input channel of each such pair, which the planner counts); ``rotated_amax =
"observe"`` keeps none and observes the rotated inputs in a second pass instead. With ``alpha_grid`` such pairs
are left out.

Recipe: ``[algorithm] name = "smoothquant"``, ``alpha`` (0.5), ``alpha_grid`` ([]: off), ``sample_tokens`` (128),
``mappings`` (which pairs; all four by default), ``propagate`` (``"fp"``: what ``calibrate`` uses when the caller
does not choose), ``rotated_amax`` (``"kept-rows"`` or ``"observe"``: where a rotated consumer's static input amax
comes from).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..layerwise.moe import in_moe_blocks
from ..layerwise.options import PROPAGATE_MODES
from ..quant.formats import fake_quantize
from ..quant.hadamard import hadamard_blocks_by_factors
from ..runtime.distributed import all_reduce_
from ..runtime.params import integer, number, number_list, one_of, subset_of
from .base import KEEPS_FULL_PRECISION, AlgorithmStep, LayerAlgorithm
from .mappings import KINDS, Smoothing, layer_smoothings, warn_no_pairs
from .memory import AlgorithmMemory, LayerPlanContext
from .stats import ExactSum, InputStats, merge_exact, static_max, static_max_input


def _rotating(context: LayerPlanContext, pair: Any) -> list[Any]:
    """The planned consumers of ``pair`` whose static per-tensor ``max`` input quantizer sees rotated inputs."""
    found = [context.linear(name) for name in pair.consumers]
    return [
        lin
        for lin in found
        if lin is not None and lin.rotation is not None and static_max(lin.input) and lin.input.granularity == "tensor"
    ]


def _rotating_consumers(step: Any, smoothings: list[Smoothing], recipe: Any) -> dict[str, list[tuple[nn.Module, int]]]:
    """Per pair (key), its consumers (outside MoE experts) whose static per-tensor ``max`` input quantizer will see
    the input rotated by the recipe's ``[rotation]``, with their Hadamard block."""
    names = {id(m): n for n, m in step.layer.named_modules(prefix=step.name)}
    in_experts = in_moe_blocks(step.layer)
    out = {}
    for m in smoothings:
        found = []
        for c in m.quantized("input"):
            if id(c) in in_experts or not static_max_input(c):
                continue
            block = getattr(c, "input_rotation", None) or recipe.rotation_block(names[id(c)], c.in_features)
            if block is not None:
                found.append((c, block))
        if found:
            out[m.key] = found
    return out


@torch.no_grad()
def _rotated_amax(
    smoothings: list[Smoothing],
    rotating: dict[str, list[tuple[nn.Module, int]]],
    stats: InputStats,
    scales: dict[str, torch.Tensor],
    group: Any,
    device: torch.device,
) -> dict[int, tuple[torch.Tensor, int]]:
    """Each rotating consumer's input amax, ``max |(x / s) H|`` over the rows the statistics pass kept (this rank's
    real tokens; rotated as the Linear will rotate them), all-reduced (MAX: exact), and the elements it stands for:
    what its max observer would record in a pass over the smoothed, rotated layer (up to float rounding, by which
    the folded layer's own computation of ``x / s`` differs), without that pass."""
    # the consumers of one pair take the same scaled columns: one maximum per pair and block (q / k / v share it)
    found = sorted({(m.key, block) for m in smoothings for _, block in rotating.get(m.key, [])})
    by_key = {m.key: m for m in smoothings}
    maxima = torch.zeros(len(found), dtype=torch.float32)
    for k, (key, block) in enumerate(found):
        rows = stats[key].rows
        if rows:
            cols = by_key[key].expand(scales[key]).float().to(device)
            maxima[k] = max(float(hadamard_blocks_by_factors(x.to(device) / cols, block).abs().max()) for x in rows)
    all_reduce_(maxima, "max", group)
    index = {point: k for k, point in enumerate(found)}
    return {
        id(c): (
            maxima[index[key, block]].reshape(c.input_quantizer.layout.amax_shape),
            stats[key].tokens * c.in_features,
        )
        for key, consumers in rotating.items()
        for c, block in consumers
    }


def smoothing_scales(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``act_max ** alpha / w_max ** (1 - alpha)`` per channel (float32), 1 where either is zero or not finite."""
    act, w = act_max.double(), w_max.double()
    s = act.pow(alpha) / w.pow(1.0 - alpha)
    ok = (act > 0) & (w > 0) & torch.isfinite(s) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)
    return s.float()


def _qdq_weight(c: nn.Module, w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` through the consumer's weight format with max scales (``amax``: the range it shares with the Linears
    vLLM fuses it with; by default its own), unchanged when it has no weight quantizer."""
    q = getattr(c, "weight_quantizer", None)
    if q is None:
        return w
    return fake_quantize(w, q.layout.amax_of(w) if amax is None else amax, q.spec, q.layout)


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
        "rotated_amax": ("kept-rows", one_of("kept-rows", "observe")),
    }
    changes_weights = True
    preserves_function = True

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """Per-channel maxima (float32, and a count) of the pairs whose consumers quantize their input, all-reduced;
        with ``alpha_grid``, this rank's token samples of each pair (``sample_tokens`` per batch), twice while the
        grid is searched; without it, every token row (float32) of each pair whose consumers rotate their inputs
        into a static per-tensor ``max`` input quantizer, kept from the statistics pass until their amax is taken,
        and one batch's smoothed, rotated copy."""
        with_input = {lin.name for lin in context.linears if lin.input is not None}
        pairs = [s for s in context.smoothings_of(tuple(params.get("mappings", ()))) if with_input & set(s.consumers)]
        maxima = sum(4 * s.dim + 8 for s in pairs)
        samples = 0
        if params.get("alpha_grid"):
            tokens = context.local_batches * int(params.get("sample_tokens", 128))
            samples = sum(4 * tokens * s.dim for s in pairs)
        widths = [max(lin.in_features for lin in rotating) for s in pairs if (rotating := _rotating(context, s))]
        keep = not params.get("alpha_grid") and params.get("rotated_amax", "kept-rows") == "kept-rows"
        rows = 4 * context.local_tokens * sum(widths) if keep else 0
        batch = 0 if not (keep and widths) else 8 * max(widths) * context.local_tokens // max(context.local_batches, 1)
        return AlgorithmMemory(cls.name, collect=maxima + samples + rows, merge=2 * maxima + samples + rows,
                               solve=maxima + 2 * samples + rows + batch)  # fmt: skip

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
        #: Per consumer (``id``) that rotates its inputs, of the last layer smoothed: its input quantizer's amax and
        #: the elements it stands for, from the statistics pass's kept rows (:func:`_rotated_amax`).
        self._rotated_amax: dict[int, tuple[torch.Tensor, int]] = {}
        #: The last layer smoothed from its own statistics pass: its name, and per pair the per-channel maxima and
        #: the tokens seen (for :meth:`derived_amax`, with the scales in :attr:`scales`).
        self._smoothed: tuple[str, list[tuple[Smoothing, torch.Tensor, int]]] | None = None

    @property
    def smooths_before_rotation(self) -> bool:
        """Without the alpha grid: its statistics and folds are in the inputs' own channels (the grid's losses are
        not: they quantize the consumers' weights as they will compute, rotated)."""
        return not self.grid

    def takes_collected_max(self) -> bool:
        return not self.grid  # the grid needs token samples, which a report does not hold

    def smoothings(self, step: Any) -> list[Smoothing]:
        # scales fold into rotated consumers before their rotation; the alpha grid's losses use unrotated weights
        found = layer_smoothings(step.layer, self.kinds, prefix=step.name, rotated_consumers=not self.grid)
        if not found and any(getattr(m, "input_quantizer", None) is not None for m in step.layer.modules()):
            warn_no_pairs(self.name, step.name, self._warned)
        return [m for m in found if m.quantized("input")]

    def plan_step(self, step: Any, recipe: Any) -> AlgorithmStep:
        """A statistics pass whose full-precision outputs stay the layer's (the folds keep its function), unless the
        maxima come from an activation report; it derives the smoothed consumers' static max input amax."""
        smoothings = self.smoothings(step)
        if not smoothings or self._collected(step, smoothings) is not None:
            return AlgorithmStep()
        rotating = self._kept_rotations(step, smoothings, recipe)
        names = {id(m): n for n, m in step.layer.named_modules(prefix=step.name)}

        def rotated(c: nn.Module) -> bool:
            return (
                getattr(c, "input_rotation", None) or recipe.rotation_block(names[id(c)], c.in_features)
            ) is not None

        kept = {id(c) for consumers in rotating.values() for c, _ in consumers}
        derived = self._derivable(step, smoothings, kept, rotated)
        return AlgorithmStep(passes=True, keeps=KEEPS_FULL_PRECISION, derives=tuple(c.input_quantizer for c in derived))

    def _kept_rotations(self, step: Any, smoothings: list[Smoothing], recipe: Any) -> dict[str, list]:
        """The rotating consumers whose input amax come from the statistics pass's kept rows (see
        ``rotated_amax``), per pair."""
        keep = not self.grid and self.params["rotated_amax"] == "kept-rows"
        return _rotating_consumers(step, smoothings, recipe) if keep else {}

    @staticmethod
    def _derivable(step: Any, smoothings: list[Smoothing], kept: set[int], rotated: Any) -> list[nn.Module]:
        """The smoothed consumers whose static per-tensor max input quantizer the statistics give (see
        :meth:`derived_amax`): outside MoE experts, and when ``rotated(consumer)``, only those whose rotated inputs'
        amax come from the kept rows (ids in ``kept``)."""
        in_experts = in_moe_blocks(step.layer)
        return [
            c
            for m in smoothings
            for c in m.quantized("input")
            if id(c) not in in_experts and static_max_input(c) and (id(c) in kept or not rotated(c))
        ]

    def before_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        self._smoothed = None
        smoothings = self.smoothings(step)
        if not smoothings:  # the same on every rank (same layer, same recipe): no collective is skipped unevenly
            return
        collected = self._collected(step, smoothings)
        stats = None
        rotating: dict[str, list[tuple[nn.Module, int]]] = {}
        if collected is None:
            kinds = {"max", "samples"} if self.grid else {"max"}
            rotating = self._kept_rotations(step, smoothings, recipe)
            points = {m.key: m.point for m in smoothings}
            stats = (
                InputStats(points, kinds, self.params["sample_tokens"], rotated=False, keep_rows=list(rotating))
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
            s = m.fold(smoothing_scales(act, w, alpha))  # the scales the producer's dtype keeps
            applied[m.key] = s.cpu()
            if stats is not None:
                smoothed.append((m, act, stats[m.key].tokens))
        self.scales[step.name] = applied
        self._rotated_amax = _rotated_amax(smoothings, rotating, stats, applied, group, step.device) if rotating else {}
        if self.grid:
            self.alphas[step.name] = {m.key: a for m, a in zip(smoothings, alphas)}
        if stats is not None:
            self._smoothed = (step.name, smoothed)

    def derived_amax(self, step: Any) -> list[tuple[Any, torch.Tensor, int]]:
        """The smoothed consumers' static per-tensor max input quantizers: ``max_j act_max_j / s_j`` (see the module
        docstring). Not for MoE experts (each observes its routed tokens only)."""
        if self._smoothed is None or self._smoothed[0] != step.name:
            return []
        out = []
        scales = self.scales[step.name]
        kept = set(self._rotated_amax)
        for m, act, tokens in self._smoothed[1]:
            top = (act / scales[m.key].to(act.device)).max()
            for c in self._derivable(step, [m], kept, lambda c: getattr(c, "input_rotation", None) is not None):
                q = c.input_quantizer
                if id(c) in self._rotated_amax:  # its quantizer sees the rotated input: from the kept rows
                    out.append((q, *self._rotated_amax[id(c)]))
                else:
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
        shares = m.shares_weight_range(consumers)
        for alpha in self.grid:
            sc = m.expand(m.stored_scales(smoothing_scales(act_max, w_max, alpha)))  # as a fold applies them
            per_batch = [0.0] * len(samples)
            shared = (
                m.shared_weight_amax(consumers, [w * sc.to(w.device)[None, :] for w in weights])
                if shares
                else [None] * len(consumers)
            )
            for c, w, ref, amax in zip(consumers, weights, refs, shared):
                sc_c = sc.to(w.device)
                wq = _qdq_weight(c, w * sc_c[None, :], amax)
                amax_in = m.expand(act_max).to(w.device) / sc_c
                for b, x in enumerate(samples):
                    xq = _qdq_input(c, x.to(w.device) / sc_c[None, :], amax_in)
                    per_batch[b] += float((xq @ wq.T - ref[b]).double().pow(2).sum())
            out.append(per_batch)
        return out
