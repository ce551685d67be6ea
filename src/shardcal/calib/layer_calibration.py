"""One decoder layer's calibration: the recipe's quantizers inserted, the layer's pass plan made and run, its output
SQNR measured, and the recipe's fallback tried when the SQNR falls short.

On the gathered layer of one step (:class:`~shardcal.layerwise.steps.LayerStep`): insert the recipe's quantizers, ask
the algorithm what its hooks will do, sort the quantizers by how they get their state and make the pass plan from
that (:mod:`.passes`); then calibrate the weight quantizers from the full weights, run the layer over this rank's
cached batches with the activation observers collecting (one pass, or two for percentile / mse), merge the
statistics across ranks in one collective per reduce op, measure the layer's output SQNR, and leave the next layer's
inputs as the plan says. The whole-model loop around it (batches, resume, checkpoint commits, the report) is
:mod:`.runner`'s.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..algorithms import LayerAlgorithm
from ..algorithms.base import KEEPS_FINAL, KEEPS_FULL_PRECISION, AlgorithmStep
from ..collect.feed import ActivationFeed
from ..errors import ModelLayoutError
from ..layerwise.moe import AllExpertsObserve, ExpertTokenMasks, RoutingCounts, fallback_unobserved, moe_blocks
from ..layerwise.steps import LayerStep
from ..quant.experts import (
    calibrate_expert_weights,
    detach_expert_quantizers,
    expert_projections,
    store_quantized_weights,
)
from ..quant.fused import share_fused_ranges
from ..quant.kv_cache import cache_argument, kv_cache_quantizers
from ..quant.linear import QuantLinear, quantized_modules, remove_quantizers
from ..quant.quantizer import QuantMode, TensorQuantizer
from ..quant.session import (
    begin_pass_all,
    calibrate_weights,
    end_pass_all,
    finish_calibration_all,
    iter_quantizers,
    num_passes,
    quantizer_mode,
    start_calibration_all,
)
from ..runtime.distributed import all_reduce_
from ..sharding.fsdp2 import sync_unsharded_to_shards
from .attach import quantize_modules, rotate_modules, weight_fallbacks
from .passes import PROPAGATE, SQNR_FULL_PRECISION, LayerFacts, PassPlan, plan_layer_passes
from .recipe import Recipe
from .report import NO_INPUT_SCALES, LayerReport, amax_summary


def _activation_quantizers(layer: nn.Module, prefix: str) -> list[tuple[str, TensorQuantizer]]:
    return [
        (n, q) for n, q in iter_quantizers(layer, prefix) if not n.endswith(".weight_quantizer") and not q.spec.dynamic
    ]


def _weight_quantizers(layer: nn.Module, prefix: str) -> list[tuple[str, QuantLinear]]:
    return [
        (n, m)
        for n, m in layer.named_modules(prefix=prefix)
        if isinstance(m, QuantLinear) and m.weight_quantizer is not None
    ]


def _pass_kv_cache(step: LayerStep, recipe: Recipe) -> list[TensorQuantizer]:
    """Pass the layer's KV-cache quantizer as its cache in every call of this step; return its quantizers."""
    if recipe.kv_cache is None:
        return []
    found = kv_cache_quantizers(step.layer, step.name)
    if not found:
        raise ModelLayoutError(
            f"{step.name}: [kv_cache] found no attention in this decoder layer (a module with k_proj / v_proj or "
            "qkv_proj whose forward takes a cache / past_key_values argument)"
        )
    if len(found) > 1:
        raise ModelLayoutError(
            f"{step.name}: [kv_cache] needs one attention per decoder layer, found {len(found)}: "
            + ", ".join(n for n, _ in found)
        )
    name, kv = found[0]
    keyword = cache_argument(step.layer) or cache_argument(_kv_attention(step.layer, name, step.name))
    if keyword is None:
        raise ModelLayoutError(f"{step.name}: the decoder layer takes no cache argument (cache / past_key_values)")
    step.call_extras = lambda x: {keyword: kv.for_batch(x.token_mask)}
    return [kv.k_quantizer, kv.v_quantizer]


def _kv_attention(layer: nn.Module, name: str, prefix: str) -> nn.Module:
    return layer.get_submodule(name[len(prefix) + 1 :]) if name != prefix else layer


def _check_kv_observed(quantizers: list[TensorQuantizer]) -> None:
    for q in quantizers:
        if q.num_observed == 0:
            raise ModelLayoutError(
                f"{q.name}: saw no keys or values: the attention never called cache.update(key_states, value_states, "
                "layer_idx) with the cache the decoder layer was given; [kv_cache] needs that protocol"
            )


def _layer_sqnr(step: LayerStep, fp_outputs: Any, local_sqnr: dict[int, int], group: Any) -> float | None:
    """SQNR (dB) of the layer output, quantizers on vs off, over the SQNR sequences (summed over ranks):
    ``local_sqnr`` maps a batch index to its first rows in the sample, ``fp_outputs`` holds at least those rows."""
    sums = torch.zeros(2, dtype=torch.float64)
    for i, rows in local_sqnr.items():
        quantized = step.forward(i, rows).to(fp_outputs[i].device).double()
        reference = fp_outputs[i][:rows].double()
        real = None if step.inputs[i].token_mask is None else step.inputs[i].token_mask[:rows]
        if real is not None:  # padded positions are not part of the signal
            quantized, reference = (
                quantized[real.bool().to(quantized.device)],
                reference[real.bool().to(reference.device)],
            )
        sums[0] += reference.pow(2).sum().cpu()
        sums[1] += (quantized - reference).pow(2).sum().cpu()
    all_reduce_(sums, "sum", group)
    signal, noise = float(sums[0]), float(sums[1])
    if signal == 0.0:
        return None
    return math.inf if noise == 0.0 else 10.0 * math.log10(signal / noise)


def layer_copies_held(recipe: Recipe) -> int:
    """How many more copies of a held layer's parameters its step keeps with ``recipe``: one with a ``[fallback]``
    (the layer as it came, put back when it falls back), else none. The planner asks."""
    return 1 if recipe.fallback is not None else 0


def calibrate_layer(
    step: LayerStep,
    recipe: Recipe,
    group: Any,
    calibrate_all_experts: bool,
    local_sqnr: dict[int, int],
    algorithm: LayerAlgorithm,
    propagate: str = "fp",
    feed: ActivationFeed | None = None,
) -> LayerReport:
    """Calibrate one layer with ``recipe``; a layer whose SQNR falls under the recipe's ``min_layer_sqnr_db`` is
    put back as it was (weights and quantizers) and calibrated again with the recipe's fallback. Then the next
    layer's inputs, as the final attempt's pass plan says (:mod:`shardcal.calib.passes`)."""
    args = (group, calibrate_all_experts, local_sqnr, algorithm, propagate, feed)
    if recipe.fallback is None:
        entry, plan = _calibrate_layer_once(step, recipe, *args)
        _next_inputs(step, plan)
        return entry
    saved = {n: p.detach().clone() for n, p in step.layer.named_parameters()}  # layer_copies_held: one
    entry, plan = _calibrate_layer_once(step, recipe, *args)
    if entry.sqnr_db is None or entry.sqnr_db >= recipe.min_layer_sqnr_db:  # the SQNR is merged: every rank agrees
        _next_inputs(step, plan)
        return entry
    _restore_layer(step, saved)
    fallback, plan = _calibrate_layer_once(step, recipe.fallback, *args)
    fallback.scheme, fallback.recipe_sqnr_db = "fallback", entry.sqnr_db
    fallback.seconds += entry.seconds
    _next_inputs(step, plan)
    return fallback


def _next_inputs(step: LayerStep, plan: PassPlan) -> None:
    """Leave the next layer's inputs in ``step.outputs`` as ``plan`` says: the kept outputs of the pass it names, or a
    propagate pass with the quantizers on (which layer_steps then takes as they are)."""
    propagate = next((p for p in plan.passes if p.kind == PROPAGATE), None)
    if propagate is not None and not (propagate.unless_kept and step.outputs is not None):
        step.outputs = [step.forward(i).to(step.cache_device) for i in range(len(step.inputs))]
        step.outputs_final = True  # the layer as it is left: layer_steps takes them as they are
    if step.outputs is None:
        raise RuntimeError(f"{step.name}: the pass plan ({plan.describe()}) left no inputs for the next layer")


def _rotates(layer: nn.Module) -> bool:
    """Whether a Linear of ``layer`` rotates its inputs (its weight holds ``W H``: the shards must get it too)."""
    return any(m.input_rotation is not None for _, m in quantized_modules(layer))


def _restore_layer(step: LayerStep, saved: dict[str, torch.Tensor]) -> None:
    """The layer's parameters as saved (written back to the shards too) and its Linear / expert quantizers removed."""
    remove_quantizers(step.layer)  # first: it rotates rotated weights back, which the saved values then replace
    for module in step.layer.modules():
        detach_expert_quantizers(module)
    with torch.no_grad():
        for n, p in step.layer.named_parameters():
            p.copy_(saved[n])
    sync_unsharded_to_shards(step.layer)
    step.invalidate_outputs()


@dataclass(frozen=True, kw_only=True)
class _LayerQuantizers:
    """A layer's activation-side quantizers by how they get their state: ``observing`` (their observers see the
    data), ``fed`` (amax from an activation report or the algorithm's statistics: id -> quantizer, and the value once
    known), ``dynamic`` (none to calibrate), ``kv`` (the KV cache's), ``fused`` (fused experts' modules)."""

    observing: list[TensorQuantizer]
    fed: dict[int, TensorQuantizer]
    dynamic: list[TensorQuantizer]
    kv: list[TensorQuantizer]
    fused: list[nn.Module]

    @property
    def set_after_algorithm(self) -> bool:
        return bool(self.observing or self.fed or self.dynamic or self.kv or self.fused)


def _layer_quantizers(
    step: LayerStep, recipe: Recipe, feed: ActivationFeed | None, all_experts: bool, kv: list[TensorQuantizer],
    derived: tuple[Any, ...],
) -> _LayerQuantizers:  # fmt: skip
    """The layer's quantizers sorted by how they get their state (see :class:`_LayerQuantizers`)."""
    reported = _fed_amax(step, recipe, feed, all_experts) if feed is not None else {}
    fed = {i: q for i, (q, _) in reported.items()} | {id(q): q for q in derived}
    observing = [q for _, q in _activation_quantizers(step.layer, step.name) if id(q) not in fed]
    return _LayerQuantizers(
        observing=observing,
        fed=fed,
        dynamic=[q for _, q in iter_quantizers(step.layer, step.name) if q.spec.dynamic],
        kv=kv,
        fused=[m for m in step.layer.modules() if expert_projections(m)],
    )


def layer_pass_plan(
    step: LayerStep, algorithm: LayerAlgorithm, promised: AlgorithmStep, quantizers: _LayerQuantizers, propagate: str
) -> PassPlan:
    """The layer's passes (:func:`shardcal.calib.passes.plan_layer_passes`) from what the algorithm promised, its
    quantizers and its structure."""
    facts = LayerFacts(
        propagate=propagate,
        changes_weights=algorithm.changes_weights,
        preserves_function=algorithm.preserves_function,
        reference_stream=algorithm.reference_stream,
        algorithm_passes=promised.passes,
        algorithm_keeps=promised.keeps,
        algorithm_may_keep_none=promised.may_keep_none,
        observer_passes=num_passes(quantizers.observing),
        set_after_algorithm=quantizers.set_after_algorithm,
        moe=bool(moe_blocks(step.layer)),
    )
    return plan_layer_passes(facts)


def _check_promise(step: LayerStep, algorithm: LayerAlgorithm, promised: AlgorithmStep) -> None:
    """The algorithm's hooks left what :meth:`~shardcal.algorithms.LayerAlgorithm.plan_step` said (a bug otherwise:
    the pass plan was made on that word)."""
    left = None if step.outputs is None else KEEPS_FINAL if step.outputs_final else KEEPS_FULL_PRECISION
    if left != promised.keeps and not (left is None and promised.may_keep_none):
        raise RuntimeError(f"{step.name}: algorithm {algorithm.name!r} said its passes leave {promised.keeps!r} "
                           f"outputs, they left {left!r}")  # fmt: skip


def _plan_layer(
    step: LayerStep, recipe: Recipe, algorithm: LayerAlgorithm, propagate: str, feed: ActivationFeed | None,
    all_experts: bool,
) -> tuple[AlgorithmStep, _LayerQuantizers, PassPlan]:  # fmt: skip
    """A step's start, before any pass: the recipe's quantizers inserted into the layer, what the algorithm promises
    its hooks will do, the quantizers sorted by how they get their state, and the pass plan made from them."""
    quantize_modules(step.layer, recipe, prefix=step.name, rotate=not algorithm.smooths_before_rotation)
    promised = algorithm.plan_step(step, recipe)
    kv = _pass_kv_cache(step, recipe)
    quantizers = _layer_quantizers(step, recipe, feed, all_experts, kv, promised.derives)
    return promised, quantizers, layer_pass_plan(step, algorithm, promised, quantizers, propagate)


def predicted_pass_plan(
    layer: nn.Module, name: str, recipe: Recipe, algorithm: LayerAlgorithm, propagate: str
) -> PassPlan:
    """The pass plan the runner will make for decoder layer ``name``, predicted before anything is loaded: the same
    start of the step (:func:`_plan_layer`) on a copy of ``layer`` (a skeleton's, on the meta device; left as it
    is), without an activation report. For the planner (:mod:`shardcal.plan`), which counts the passes it runs."""
    skeleton = copy.deepcopy(layer)
    meta = torch.device("meta")
    step = LayerStep(index=0, name=name, layer=skeleton, inputs=[], device=meta, cache_device=meta)
    return _plan_layer(step, recipe, algorithm, propagate, None, False)[2]


def _calibrate_layer_once(
    step: LayerStep,
    recipe: Recipe,
    group: Any,
    calibrate_all_experts: bool,
    local_sqnr: dict[int, int],
    algorithm: LayerAlgorithm,
    propagate: str = "fp",
    feed: ActivationFeed | None = None,
) -> tuple[LayerReport, PassPlan]:
    """One attempt at the layer: quantizers inserted, the pass plan made, then executed up to the SQNR (the next
    inputs are :func:`_next_inputs`' after the last attempt). Returns the layer's report and its plan."""
    start = time.perf_counter()
    if feed is not None:
        feed.used = []
    rotate_later = algorithm.smooths_before_rotation
    promised, quantizers, plan = _plan_layer(step, recipe, algorithm, propagate, feed, calibrate_all_experts)
    if feed is not None:
        feed.used = []  # planning looked the report up; the uses are recorded below, where they happen
    reference: dict[int, torch.Tensor] | None = None
    if plan.sqnr_reference_first:  # SQNR against the layer as it was
        with quantizer_mode(step.layer, QuantMode.DISABLED):
            reference = {i: step.forward(i, rows).to(step.cache_device) for i, rows in local_sqnr.items()}
    algorithm.before_weight_calibration(step, recipe, group)
    if rotate_later:
        rotate_modules(step.layer, recipe, prefix=step.name)
    pairs = [(m.weight, m.weight_quantizer) for _, m in _weight_quantizers(step.layer, step.name)]
    calibrate_weights(pairs, group)  # the layer is gathered: the full weights, on every rank (a search: shared)
    weights = [q for _, q in pairs]
    for q in weights:
        q.mode = QuantMode.DISABLED  # the observing passes run the layer in full precision
    for experts in quantizers.fused:
        calibrate_expert_weights(experts)  # per expert and projection, from the gathered fused parameters
    share_fused_ranges(step.layer, step.name, "weight")  # what vLLM's fused layers compute with; before GPTQ's solve
    algorithm.after_weight_calibration(step, recipe, group)
    _check_promise(step, algorithm, promised)
    if algorithm.changes_weights or _rotates(step.layer):
        sync_unsharded_to_shards(step.layer)  # resharding would otherwise drop the edits
    if not plan.algorithm_outputs_valid:
        step.invalidate_outputs()  # outputs the algorithm's passes left are not those of the layer as it is now
    fed = _fed_amax(step, recipe, feed, calibrate_all_experts) if feed is not None else {}
    fed.update({id(q): (q, (amax, elements)) for q, amax, elements in algorithm.derived_amax(step)})
    if set(fed) != set(quantizers.fed):
        raise RuntimeError(f"{step.name}: the amax given by the report and {algorithm.name!r} are not what was planned")
    for q in quantizers.fed.values():
        q.mode = QuantMode.DISABLED  # its amax comes from the report or the algorithm: it does not observe
    for q in quantizers.dynamic:  # nothing to observe; off so that the observing pass is the full-precision function
        q.mode = QuantMode.DISABLED
    start_calibration_all(quantizers.observing)
    fp_outputs = _observe(step, plan, quantizers.observing, calibrate_all_experts, group, local_sqnr)
    finish_calibration_all(quantizers.observing)
    for q, (amax, elements) in fed.values():
        q.set_amax(amax)
        q.num_observed = elements  # as if observed: an MoE expert no token reached still gets its siblings' range
        q.mode = QuantMode.QUANTIZE
    _check_kv_observed(quantizers.kv)
    for q in weights + quantizers.dynamic:
        q.mode = QuantMode.QUANTIZE
    if quantizers.fused and _computes_quantized(step, plan, local_sqnr):
        for experts in quantizers.fused:  # fused experts compute with quantized weights: written into the parameters
            store_quantized_weights(experts)
        sync_unsharded_to_shards(step.layer)
    fallbacks = fallback_unobserved(step.layer)
    scaled = [n for n, _ in _activation_quantizers(step.layer, step.name)]
    moe_report = _moe_report(fp_outputs.routing.merged(group), fallbacks, calibrate_all_experts, scaled)  # collective
    sqnr = _layer_sqnr(step, reference if reference is not None else fp_outputs.outputs, local_sqnr, group)
    entry = LayerReport(
        index=step.index,
        name=step.name,
        seconds=time.perf_counter() - start,
        sqnr_db=sqnr,
        quantizers={n: amax_summary(q.amax) for n, q in iter_quantizers(step.layer, step.name)},
        fallbacks=fallbacks,
        group_sizes=weight_fallbacks(step.layer, recipe, step.name),
        moe=moe_report,
        algorithm=algorithm.layer_report(step),
        from_activation_report=list(feed.used) if feed is not None else [],
    )
    return entry, plan


def _computes_quantized(step: LayerStep, plan: PassPlan, local_sqnr: dict[int, int]) -> bool:
    """Whether anything computes with the layer quantized once its weights are calibrated: a pass of this step on this
    rank (:meth:`PassPlan.runs_quantized`), or, when the layer stays in memory after its step, whoever holds the
    model. A streamed layer that neither runs quantized nor stays keeps its fused experts' weights as read: the export
    encodes the same codes from them as from their fake-quantized values (:func:`store_quantized_weights`)."""
    return plan.runs_quantized(bool(local_sqnr)) or not step.released_after


@dataclass
class _Observed:
    """What the observing passes give the rest of the step: the full-precision outputs the SQNR compares with (all
    batches, or the SQNR sequences' rows), and the routing counts of the first pass."""

    outputs: Any
    routing: RoutingCounts


def _observe(
    step: LayerStep,
    plan: PassPlan,
    observing: list[TensorQuantizer],
    all_experts: bool,
    group: Any,
    local_sqnr: dict[int, int],
) -> _Observed:
    """The plan's observing passes (the first in full precision, its outputs kept), or its full-precision pass over
    the SQNR sequences when the algorithm's outputs do not stand in."""
    moe = AllExpertsObserve(step.layer) if all_experts else None
    routing = RoutingCounts(step.layer, step.name)
    if plan.observing:
        step.invalidate_outputs()  # the pass computes them again: never two sets of outputs alive
    fp_outputs: Any = step.outputs
    sqnr_pass = next((p for p in plan.passes if p.kind == SQNR_FULL_PRECISION), None)
    if sqnr_pass is not None and not (sqnr_pass.unless_kept and step.outputs is not None):
        fp_outputs = {i: step.forward(i, r).to(step.cache_device) for i, r in local_sqnr.items()}
    for p in range(plan.observing):
        begin_pass_all(observing, p)
        counting = routing if p == 0 else contextlib.nullcontext()
        with moe if moe is not None else contextlib.nullcontext(), ExpertTokenMasks(step.layer), counting:
            outs = step.forward_all(keep_outputs=p == 0)  # observers leave outputs unchanged: pass 0 is FP
        if p == 0:
            fp_outputs = outs
        end_pass_all(observing, group)  # collective, also for a rank with no batches
    return _Observed(outputs=fp_outputs if fp_outputs is not None else [], routing=routing)


def _fed_amax(
    step: LayerStep, recipe: Recipe, feed: ActivationFeed, all_experts: bool
) -> dict[int, tuple[TensorQuantizer, tuple[torch.Tensor, int]]]:
    """The layer's activation quantizers whose amax the report gives (not MoE experts' in all-experts mode, nor a
    rotated Linear's input quantizer — rotated already, or to be by the recipe: the report saw its inputs
    unrotated)."""
    skip = {id(q) for b in moe_blocks(step.layer) for _, q in iter_quantizers(b.experts)} if all_experts else set()
    skip |= {
        id(m.input_quantizer)
        for n, m in step.layer.named_modules(prefix=step.name)
        if isinstance(m, QuantLinear)
        and (m.input_rotation is not None or recipe.rotation_block(n, m.in_features) is not None)
    }
    out = {}
    for name, q in _activation_quantizers(step.layer, step.name):
        found = None if id(q) in skip else feed.amax_for(name, q)
        if found is not None:
            out[id(q)] = (q, found)
    return out


#: The expert index of a quantizer name, after its MoE block's name (``.experts.3.`` ours, ``.3.`` fused experts).
_EXPERT = re.compile(r"^\.(?:experts\.)?(\d+)\.")


def _experts_of(block: str, names: list[str]) -> set[int]:
    """The experts of MoE block ``block`` that quantizer ``names`` belong to."""
    return {int(m.group(1)) for n in names if n.startswith(block + ".") and (m := _EXPERT.search(n[len(block) :]))}


def _moe_report(
    routed: dict[str, list[int]], fallbacks: list[str], all_experts: bool, scaled: list[str]
) -> dict[str, dict[str, list]]:
    """Per MoE block: tokens routed to each expert, and where each expert's input scales come from (``scaled``: the
    names of the layer's activation quantizers with a static scale; an expert with none has no input scale)."""
    out = {}
    for block, counts in routed.items():
        fell_back, with_scales = _experts_of(block, fallbacks), _experts_of(block, scaled)
        sources = [
            NO_INPUT_SCALES if e not in with_scales
            else "sibling fallback" if e in fell_back
            else "all tokens" if all_experts
            else "routed tokens"
            for e in range(len(counts))
        ]  # fmt: skip
        out[block] = {"routed_tokens": counts, "scales_from": sources}
    return out
