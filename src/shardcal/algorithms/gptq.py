"""GPTQ: error-compensating weight quantization from the layer inputs' second moments (Frantar et al., 2022).

Per quantized Linear of the gathered layer:

1. The Hessian ``H = sum_x x x^T`` of its inputs: this rank's cached batches run through the layer (every quantizer
   off) with a forward pre-hook; one ``X^T X`` per batch (float32), accumulated across batches with an exact
   fixed-point sum and all-reduced (SUM) in one collective, so ``H`` is bit-identical at every world size.
   Padding tokens are skipped; an MoE expert sees the tokens routed to it.
2. The update, on the unsharded weight (:mod:`.gptq_solve`): columns are quantized one at a time (in blocks of
   ``block_size``, optionally in decreasing ``diag(H)`` order with ``act_order``) and each column's error is spread
   over the columns not yet quantized through the upper Cholesky factor of ``(H + percdamp * mean(diag H) * I)^-1``.
   The scales are static: the ones the weight quantizer calibrated (with the recipe's observer) before the update,
   so export keeps the recipe's layout (``pack-quantized`` for int4 groups), and the weight left in the layer is
   GPTQ's quantized result itself: the weight quantizer's fake quantization with its stored amax reproduces it
   exactly.
3. Linears with equal Hessians (one input: q/k/v, gate/up) share one preparation (the column order and the
   inverse factor, :func:`prepare_hessian`). Such group ``k`` of the layer (module order) is solved by rank
   ``k mod N`` and broadcast from there, so N ranks share the solves. The runner writes the gathered weights back
   into the FSDP2 shards and checkpoints them.

The weight ranges GPTQ rounds with are those the runner leaves: shared across the Linears vLLM fuses into one layer
where vLLM computes them with one range (nvfp4's global scale, fp8 per-tensor scales; :mod:`shardcal.quant.fused`).
With ``stream_correction`` each Linear's weight quantizer is calibrated again on its moved weight: the members of such
a fused layer are then solved by one rank, which shares their new ranges before rounding them.

The simple per-layer variant: every Hessian of a layer comes from the layer's inputs with the layer's original
weights (``o_proj``'s from the full-precision attention, not from already-quantized q/k/v; ``down_proj``'s from the
full-precision gate/up). Between layers the inputs are propagated through the quantized layers
(``propagate = "qdq"``, the default ``calibrate`` takes for this algorithm when the caller does not choose).

Columns whose input is always zero (``H_jj = 0``: dead channels, experts that got no token) are rounded to nearest
and pass no error on. Recipe: ``[algorithm] name = "gptq"``, ``block_size`` (128), ``percdamp`` (0.01),
``act_order`` (false), ``static_groups`` (false), ``propagate`` ("qdq"), ``smooth`` (a table naming ``smoothquant`` or
``awq`` with its parameters: that algorithm folds its scales first, in the same step, then GPTQ quantizes the
smoothed weights — SmoothQuant + GPTQ is the usual W8A8 int8 combination), ``stream_correction`` (0: off),
``input_amax`` ("observe": static input quantizers observe the layer after the solve; "hessian-pass": they take
the maximum of the Hessian pass's inputs, one pass fewer).

``stream_correction = α`` (0 < α <= 1) makes GPTQ's objective asymmetric (:mod:`.paired`): the runner carries the
full-precision stream beside the quantized one, and each Linear outside an MoE block is first moved by the fraction
α of the least-squares step from "the quantized stream's inputs, through the Linear's input quantizer" to "the
full-precision model's output of this Linear", then rounded by GPTQ against the Hessian of those quantized inputs
(its weight scales calibrated again on the moved weight). It compensates the drift of the layers quantized before
and, for W4A4 / W8A8, the Linear's own input quantization.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import NumericsError, RecipeError
from ..layerwise.moe import in_moe_blocks
from ..layerwise.options import PROPAGATE_MODES
from ..quant.formats import FORMATS
from ..quant.fused import range_groups, share_range
from ..quant.linear import QuantLinear
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import MX_FORMATS
from ..runtime.distributed import all_gather_strings, broadcast_, group_rank_size
from ..runtime.params import SpecError, boolean, integer, number, one_of, table_or_none
from .awq import AWQ
from .base import AlgorithmStep, LayerAlgorithm
from .gptq_solve import DEFAULTS, PreparedHessian, check_quantizer, gptq_quantize, prepare_hessian
from .memory import EXACT_SUM_BYTES, GRAM_ADD_BYTES, AlgorithmMemory, LayerPlanContext
from .paired import PairedGrams, corrected_weight, pairable
from .scales import clip_search_amax, refine_rounding, refit_scales
from .smoothquant import SmoothQuant
from .stats import InputStats, static_max_input

#: Algorithms GPTQ can run first in the same step (``smooth = { name = ..., <its parameters> }``).
SMOOTHERS: dict[str, type[LayerAlgorithm]] = {cls.name: cls for cls in (SmoothQuant, AWQ)}
#: The solve of one Linear (measured): the float64 Hessian value and ~8 float64 copies of ``[in, in]`` (damping, the
#: reversed Cholesky, the triangular solve), and a float32 copy of the weight (bytes per weight element).
SOLVE_HESSIAN_COPIES, SOLVE_WEIGHT_BYTES = 9, 4


def _paired_solves(names: list[str], specs: Mapping[str, Any]) -> list[list[str]]:
    """The solves of the stream-corrected Linears ``names``: one per Linear, except that the members of a vLLM fused
    layer whose weight range is one (:func:`~shardcal.quant.fused.range_groups`) are solved together."""
    groups = range_groups({n: specs[n] for n in names}, "weight")
    grouped = {n for g in groups for n in g}
    return groups + [[n] for n in names if n not in grouped]


def _gptq_memory(context: LayerPlanContext, paired: bool = False) -> AlgorithmMemory:
    """GPTQ's own state on one layer (see :meth:`GPTQ.planned_memory`); ``paired``: two sums per Linear
    (``stream_correction``: ``C_qq`` and ``C_tq``)."""
    quantized = [lin for lin in context.linears if lin.weight is not None]
    if not quantized:
        return AlgorithmMemory(GPTQ.name)
    world, rank = context.world_size, context.rank
    hessians = (2 if paired else 1) * sum(EXACT_SUM_BYTES * (lin.in_features**2 + 1) for lin in quantized)
    widest = max(lin.in_features for lin in quantized)
    mine = [lin for k, lin in enumerate(quantized) if k % world == rank]
    solve = max(
        (SOLVE_HESSIAN_COPIES * 8 * lin.in_features**2 + SOLVE_WEIGHT_BYTES * lin.in_features * lin.out_features
         for lin in mine),
        default=0,
    )  # fmt: skip
    return AlgorithmMemory(
        GPTQ.name,
        collect=hessians + GRAM_ADD_BYTES * widest**2,
        merge=2 * hessians if world > 1 else hessians,
        solve=hessians + solve,
    )


class GPTQ(LayerAlgorithm):
    """See the module docstring."""

    name = "gptq"
    schema = {
        "block_size": (DEFAULTS["block_size"], integer(1)),
        "percdamp": (DEFAULTS["percdamp"], number(0.0, 1.0, lo_open=True)),
        "act_order": (DEFAULTS["act_order"], boolean),
        "static_groups": (DEFAULTS["static_groups"], boolean),
        "propagate": ("qdq", one_of(*PROPAGATE_MODES)),
        "smooth": (None, table_or_none),
        "scale_search": ("observer", one_of("observer", "hessian")),
        "scale_grid": (20, integer(1)),
        "scale_max_shrink": (0.3, number(0.0, 1.0, hi_open=True)),
        "refit_scales": (0, integer(0)),
        "refine_sweeps": (0, integer(0)),
        "stream_correction": (0.0, number(0.0, 1.0)),
        "input_amax": ("observe", one_of("observe", "hessian-pass")),
    }
    changes_weights = True
    default_propagate = "qdq"

    @classmethod
    def validate(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        out = super().validate(params)
        if out["smooth"] is None:
            del out["smooth"]
            return out
        table = dict(out["smooth"])
        name = table.pop("name", None)
        if name not in SMOOTHERS:
            raise SpecError(
                "smooth.name",
                f"algorithm 'gptq': smooth.name must be one of {', '.join(map(repr, SMOOTHERS))}, got {name!r}",
            )
        try:
            out["smooth"] = {"name": name, **SMOOTHERS[name].validate(table)}
        except SpecError as exc:
            raise SpecError(f"smooth.{exc.key}", str(exc)) from None
        return out

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """One ``[in, in]`` exact sum per quantized Linear of the layer, all at once (twice while all-reduced as one
        flat buffer, N >= 2), and the float64 solve of the widest Linear this rank owns (Linear k on rank k mod N);
        with ``stream_correction``, two sums per Linear (the reference stream's activations are the runner's). With
        ``smooth``, the smoother runs first in the same step: the larger of the two counts."""
        state = _gptq_memory(context, paired=params.get("stream_correction", 0.0) > 0)
        smooth = params.get("smooth")
        if smooth:
            first = SMOOTHERS[smooth["name"]].planned_memory(context, smooth)
            if first.peak > state.peak:
                return AlgorithmMemory(cls.name, first.collect, first.merge, first.solve, first.held)
            state.held = first.held
        return state

    def __init__(self, params: Mapping[str, Any] | None = None):
        super().__init__(params)
        self._damping: dict[str, dict[str, float]] = {}  # layer -> Linear -> relative damping used
        self._derived: dict[str, list[tuple[Any, torch.Tensor, int]]] = {}  # layer -> derived_amax's entries
        self.smoother: LayerAlgorithm | None = None
        if "smooth" in self.params:
            table = dict(self.params["smooth"])
            self.smoother = SMOOTHERS[table.pop("name")](table)

    @property
    def reference_stream(self) -> bool:
        """``stream_correction`` reads the full-precision stream."""
        return self.params["stream_correction"] > 0

    @property
    def smooths_before_rotation(self) -> bool:
        """As its ``smooth`` algorithm (the only thing it does before weight calibration)."""
        return self.smoother is not None and self.smoother.smooths_before_rotation

    def plan_step(self, step: Any, recipe: Any) -> AlgorithmStep:
        """The smoother's step, then a Hessian pass (and the paired pass of ``stream_correction``) over every quantized
        Linear; the outputs it leaves are the smoother's; with ``input_amax = "hessian-pass"`` it derives
        :meth:`_derivable`'s input amax."""
        smoother = self.smoother.plan_step(step, recipe) if self.smoother is not None else AlgorithmStep()
        targets = self._targets(step)
        if not targets:
            return smoother
        derived = tuple(m.input_quantizer for m in self._derivable(step, targets).values())
        return AlgorithmStep(passes=True, keeps=smoother.keeps, may_keep_none=smoother.may_keep_none, derives=derived)

    @staticmethod
    def _targets(step: Any) -> list[tuple[str, QuantLinear]]:
        return [
            (n, m)
            for n, m in step.layer.named_modules(prefix=step.name)
            if isinstance(m, QuantLinear) and m.weight_quantizer is not None
        ]

    def _paired(self, step: Any, targets: list[tuple[str, QuantLinear]]) -> list[tuple[str, QuantLinear]]:
        """The targets ``stream_correction`` pairs across the two streams (none without it)."""
        return pairable(step.layer, targets) if self.params["stream_correction"] > 0 else []

    def _derivable(self, step: Any, targets: list[tuple[str, QuantLinear]]) -> dict[str, QuantLinear]:
        """With ``input_amax = "hessian-pass"``: the Linears (not paired, outside MoE experts) whose static per-tensor
        ``max`` input quantizer takes the maximum of the Hessian pass's inputs; else none."""
        if self.params["input_amax"] != "hessian-pass":
            return {}
        paired = {n for n, _ in self._paired(step, targets)}
        in_experts = in_moe_blocks(step.layer)
        return {n: m for n, m in targets if n not in paired and id(m) not in in_experts and static_max_input(m)}

    def before_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        if self.smoother is not None:
            self.smoother.before_weight_calibration(step, recipe, group)

    def after_weight_calibration(self, step: Any, recipe: Any, group: Any) -> None:
        if self.smoother is not None:
            self.smoother.after_weight_calibration(step, recipe, group)
        targets = self._targets(step)
        if not targets:
            return
        for n, m in targets:
            check_quantizer(m.weight_quantizer, n)
            self._check_options(m.weight_quantizer, n)
        paired = PairedGrams(self._paired(step, targets)).collect(step, group)
        plain = {n: (m, "input") for n, m in targets if n not in paired}
        derivable = self._derivable(step, targets)  # Linear name -> module
        kinds = {"gram", "max"} if derivable else {"gram"}
        stats = InputStats(plain, kinds).collect(step).merge(group) if plain else None
        self._derived[step.name] = [
            (
                m.input_quantizer,
                stats[n].max.max().reshape(m.input_quantizer.layout.amax_shape),
                stats[n].tokens * m.in_features,
            )
            for n, m in derivable.items()
        ]
        rank, size = group_rank_size(group)
        modules = dict(targets)
        # Linears that share their inputs share one Hessian and its preparation, and one rank solves them all; the
        # stream-corrected members of a vLLM fused layer whose weight range is one (nvfp4, fp8 per tensor) are
        # solved by one rank too, which shares the range of their moved weights before rounding them.
        solves = _paired_solves(
            [n for n, _ in targets if n in paired], {n: m.weight_quantizer.spec for n, m in targets}
        ) + (stats.same_gram() if stats is not None else [])
        owner = {n: k % size for k, names in enumerate(solves) for n in names}
        damping: dict[str, float] = {}
        failed: dict[str, str] = {}
        for names in (names for k, names in enumerate(solves) if k % size == rank):
            hessian = None if names[0] in paired else stats[names[0]].hessian()  # the group's one value
            try:
                prepared = None if hessian is None else self._prepare(hessian)
                moved = self._moved_weights(names, modules, paired) if names[0] in paired else {}
            except torch.linalg.LinAlgError as exc:
                failed.update({n: str(exc) for n in names})
                continue
            for n in names:
                m, info = modules[n], {}
                try:
                    if n in paired:
                        q = self._solve(m, paired[n][0], info, moved[n])
                    else:
                        q = self._solve(m, hessian, info, prepared=prepared)
                except torch.linalg.LinAlgError as exc:
                    failed[n] = str(exc)
                    continue
                damping[n] = info["damping"]
                with torch.no_grad():
                    m.weight.copy_(q)
        del stats, paired
        # Every rank learns every Linear's damping, and stops together if any Linear could not be solved.
        parts = [json.loads(p) for p in all_gather_strings(json.dumps({"damping": damping, "failed": failed}), group)]
        failures = {n: why for p in parts for n, why in p["failed"].items()}
        if failures:
            name, why = sorted(failures.items())[0]
            raise NumericsError(f"{name}: GPTQ cannot quantize it: {why}; raise the recipe's percdamp or exclude it")
        self._damping[step.name] = {n: d for p in parts for n, d in sorted(p["damping"].items())}
        with torch.no_grad():
            for n, m in targets:
                broadcast_(m.weight.data, owner[n], group)
                broadcast_(m.weight_quantizer.amax, owner[n], group)  # in-order, searched or refitted scales
                if m.weight_quantizer.amin is not None:
                    broadcast_(m.weight_quantizer.amin, owner[n], group)

    def _moved_weights(
        self, names: list[str], modules: dict[str, QuantLinear], paired: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """``stream_correction``: each Linear's weight moved toward the full-precision stream's outputs, its weight
        quantizer calibrated on it (the scales of the weight GPTQ rounds), the range then shared where ``names`` are
        one vLLM fused layer (:func:`~shardcal.quant.fused.share_range`)."""
        moved = {}
        for n in names:
            cqq, ctq = paired[n]
            moved[n] = corrected_weight(
                modules[n].weight, cqq, ctq, self.params["stream_correction"], self.params["percdamp"]
            )
            modules[n].weight_quantizer.calibrate_from(moved[n])
        if len(names) > 1:
            share_range([modules[n].weight_quantizer for n in names])
        return moved

    def derived_amax(self, step: Any) -> list[tuple[Any, torch.Tensor, int]]:
        """With ``input_amax = "hessian-pass"``, every static per-tensor ``max`` input quantizer of the layer's
        Linears (outside MoE experts and the stream-corrected ones): the maximum of the inputs the Hessian pass saw
        (the weights as they were before the solve, as llm-compressor's GPTQ observes them), so the runner runs no
        observing pass for them. By default (``"observe"``) none: they observe the layer with the solved weights."""
        return self._derived.pop(step.name, [])

    def _check_options(self, q: TensorQuantizer, name: str) -> None:
        if not q.spec.symmetric and self.params["refit_scales"]:
            raise RecipeError(f"{name}: gptq's refit_scales needs symmetric weights (symmetric = true)")
        if q.spec.format == "nvfp4" and (self.params["refit_scales"] or self.params["scale_search"] != "observer"):
            raise RecipeError(
                f"{name}: nvfp4 block scales follow the weight, so gptq's refit_scales and scale_search = "
                "'hessian' do not apply to nvfp4 weights; leave them at their defaults"
            )

    def _prepare(self, hessian: torch.Tensor) -> PreparedHessian:
        return prepare_hessian(hessian, percdamp=self.params["percdamp"], act_order=self.params["act_order"])

    def _gptq(
        self,
        weight: torch.Tensor,
        hessian: torch.Tensor | PreparedHessian,
        quantizer: TensorQuantizer,
        info: dict[str, Any],
    ) -> torch.Tensor:
        return gptq_quantize(
            weight,
            hessian,
            quantizer,
            percdamp=self.params["percdamp"],
            block_size=self.params["block_size"],
            act_order=self.params["act_order"],
            static_groups=self.params["static_groups"],
            info=info,
        )

    def _solve(
        self,
        m: QuantLinear,
        hessian: torch.Tensor,
        info: dict[str, Any],
        weight: torch.Tensor | None = None,
        prepared: PreparedHessian | None = None,
    ) -> torch.Tensor:
        """One Linear: the scale search (fixed scales only), GPTQ, then ``max(refit_scales, refine_sweeps > 0)``
        rounds of: ``refine_sweeps`` rounding sweeps, then (while rounds of ``refit_scales`` remain) a least-squares
        refit of the scales. ``weight``: what to quantize (default: the Linear's own); ``prepared``: ``hessian`` as
        :meth:`_prepare` left it, shared with the Linears of the same inputs. ``info["damping"]``: the relative
        damping GPTQ needed."""
        wq = m.weight_quantizer
        weight = (m.weight if weight is None else weight).detach()
        fixed = (
            self.params["static_groups"]
            or self.params["act_order"]
            or wq.layout.kind != "group"
            or wq.spec.format in MX_FORMATS
        )
        h = hessian.to(device=weight.device, dtype=torch.float32)
        if self.params["scale_search"] == "hessian" and fixed:
            found = clip_search_amax(weight.float(), wq, h, self.params["scale_max_shrink"], self.params["scale_grid"])
            if found is not None:
                wq.set_amax(*found)
        q = self._gptq(weight, hessian if prepared is None else prepared, wq, info)
        sweeps, refits = self.params["refine_sweeps"], self.params["refit_scales"]
        for r in range(max(refits, 1 if sweeps else 0)):
            if sweeps:
                q = refine_rounding(weight, q, wq, h, sweeps) if FORMATS[wq.spec.format].kind == "int" else q
            if r < refits and (refit := refit_scales(weight, q, wq, h)) is not None:
                wq.set_amax(refit[0])
                q = refit[1]
        return q

    def layer_report(self, step: Any) -> dict[str, Any]:
        """The relative damping each Linear of the layer needed (``percdamp`` unless raised by the schedule)."""
        report = self.smoother.layer_report(step) if self.smoother is not None else {}
        if step.name in self._damping:
            report["gptq_damping"] = self._damping[step.name]
        return report
