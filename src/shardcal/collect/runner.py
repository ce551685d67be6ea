"""Activation collection on plain or FSDP2-sharded models: ``collect_activations(model, data, targets)``.

It is :func:`shardcal.layer_steps` plus forward hooks: for each decoder layer holding a target (gathered once), hooks
on the gathered layer's target modules see what they are called with or return while the layer runs over this
rank's cached batches (one pass, ``propagate="fp"``: that pass's outputs are the next layer's inputs); padded
positions are dropped; statistics are merged exactly across ranks (:mod:`shardcal.collect.stats`); with a
histogram its counts come from the rows kept from that pass (or a second pass when they do not fit in ``keep_mb``);
with ``save_dir`` each rank writes its own batches' raw activations (:mod:`shardcal.collect.store`); then the hooks
are removed. Stepping stops after the last layer holding a target. Batches are dealt to ranks whole
(:func:`shardcal.layerwise.batches.rank_batch_indices`), so the report and the files do not depend on the world size.

Bad targets fail before anything is written: a pattern that matches nothing, a module outside the decoder layers or
an unknown selector at once; a target whose module the forward never runs (or that yields no tensor) after the
first pass of its layer, on every rank alike (the ranks merge what their hooks saw first). With ``checkpoint_dir``
an interrupted run resumes after the last committed layer, on any number of ranks
(:mod:`shardcal.collect.collection_checkpoint`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CollectionCheckpointError, CollectionError
from ..layerwise.batches import Batch, model_batches, rank_batch_indices, warn_idle_ranks
from ..layerwise.inputs import CachedInputs
from ..layerwise.moe import ExpertTokenMasks
from ..layerwise.progress import progress_bar
from ..layerwise.resume import announce_resume, resume_point
from ..layerwise.steps import LayerStep, layer_steps
from ..runtime.distributed import dp_group, world
from ..runtime.faults import fault_point
from ..runtime.health import rank_guard, report_phase
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from .collection_checkpoint import CollectionCheckpoint, CollectionResume
from .options import CollectionOptions, parse_stats
from .report import (
    ActivationReport,
    TargetStats,
    json_digest,
    run_fingerprint,
)
from .stats import (
    CHANNELS_DIFFER,
    NOT_A_TENSOR,
    NOT_PER_TOKEN,
    SEVERAL_CALLS,
    TargetObserver,
    merge_flags,
    merge_maxima,
    merge_sums,
)
from .store import ActivationWriter, parse_dtype
from .targets import Target, observed_tensor, parse_targets, resolve_targets

#: ``parse_stats`` is also the CLI's (its definition is in :mod:`.options`).
__all__ = ["CollectionOptions", "CollectionPlan", "collect_activations", "model_dtype", "parse_stats"]


def collect_activations(
    model: nn.Module,
    data: Any,
    targets: str | Iterable[str],
    options: CollectionOptions | None = None,
    **changes: Any,
) -> ActivationReport:
    """Statistics (and with ``save_dir`` the raw values) of ``targets``' activations over ``data``, layer by layer.

    ``targets``: patterns ``"PATTERN[:input|output]"`` (:mod:`shardcal.collect.targets`), e.g.
    ``"model.layers.*.mlp.down_proj:input"``, ``"model.layers.*:output"`` (the residual stream). ``options``
    (:class:`~shardcal.collect.options.CollectionOptions`) says what to keep and how to run; keyword ``changes``
    override single fields (``collect_activations(model, ids, targets, stats=["absmax"], save_dir=d)``). Collective
    under torch.distributed: every rank calls it with the same arguments; ``data`` as for :func:`shardcal.calibrate`.
    The report is identical on every rank and world size.
    """
    options = (options or CollectionOptions()).replace(**changes)
    with rank_guard():
        return _collect(model, data, targets, options)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@dataclass(kw_only=True)
class CollectionPlan:
    """One run, checked: its targets by layer, the batches (global, and this rank's), fingerprint and writers."""

    targets: list[Target]
    patterns: list[str]
    options: CollectionOptions  # save_dtype resolved
    batches: list[Batch]
    mine: list[int]
    fingerprint: dict[str, str]
    writer: ActivationWriter | None
    checkpoint: CollectionCheckpoint | None

    @property
    def by_layer(self) -> dict[int, list[Target]]:
        out: dict[int, list[Target]] = {}
        for t in self.targets:
            out.setdefault(t.layer, []).append(t)
        return out


def _plan(model: nn.Module, data: Any, targets: Any, options: CollectionOptions) -> CollectionPlan:
    """Check the targets and the model (nothing is written) and prepare the run. Collective (the model's
    fingerprint)."""
    patterns = parse_targets(targets)
    layers = require_decoder_layers(model)
    resolved = resolve_targets(model, patterns, decoder_layer_prefix(model, layers), len(layers))
    options = options.resolved(model_dtype(model))
    batches = model_batches(model, data, options.batch_size)
    rank, world_size = world()
    fingerprint = run_fingerprint(model, batches)
    settings = {"targets": [t.name for t in resolved], "patterns": [p.text for p in patterns], **options.fingerprint()}
    run = json_digest({"fingerprint": fingerprint, "settings": settings})
    writer = None
    if options.save_dir is not None:
        writer = ActivationWriter(options.save_dir, parse_dtype(options.save_dtype, torch.float32), batches, run)
        writer.check()
    checkpoint = None
    if options.checkpoint_dir is not None:  # not the world size: a run can resume on another number of ranks
        checkpoint = CollectionCheckpoint(options.checkpoint_dir, {**fingerprint, **settings})
        checkpoint.check_directory()
    mine = rank_batch_indices(len(batches), rank, world_size)
    return CollectionPlan(
        targets=resolved,
        patterns=settings["patterns"],
        options=options,
        batches=batches,
        mine=mine,
        fingerprint=fingerprint,
        writer=writer,
        checkpoint=checkpoint,
    )


def _resume(
    plan: CollectionPlan, model: nn.Module, local_batches: list[Batch], stop: int
) -> tuple[CollectionResume | None, int, list[CachedInputs] | None]:
    """``(resume state or None, first layer, its inputs)``; a checkpoint that lacks a finished layer's statistics,
    or whose finished flag disagrees with its layer count, is refused."""
    resume = plan.checkpoint.load(plan.mine) if plan.checkpoint is not None else None
    if resume is not None:
        missing = [t.name for t in plan.targets if t.layer < resume.completed_layers and t.name not in resume.stats]
        if missing or resume.finished != (resume.completed_layers >= stop):
            what = f"no statistics of {missing[0]}" if missing else f"{resume.completed_layers} layers done of {stop}"
            raise CollectionCheckpointError(f"{plan.checkpoint.dir}: collection checkpoint is inconsistent ({what})")
    start, initial = resume_point(model, local_batches, resume, stop, plan.checkpoint, plan.options.offload_activations)
    return resume, start, initial


def _collect(model: nn.Module, data: Any, targets: Any, options: CollectionOptions) -> ActivationReport:
    t0 = time.perf_counter()
    report_phase("collect: setup")
    plan = _plan(model, data, targets, options)
    o = plan.options
    rank, world_size = world()
    local_batches = [plan.batches[i] for i in plan.mine]
    stop = max(plan.by_layer) + 1  # layers after the last one holding a target are not run
    resume, start, initial = _resume(plan, model, local_batches, stop)
    results: dict[str, TargetStats] = dict(resume.stats) if resume is not None else {}
    entries: list[dict[str, Any]] = list(resume.entries) if resume is not None else []
    if rank == 0:
        warn_idle_ranks(len(plan.batches), o.batch_size, world_size, stacklevel=3)  # collect_activations' caller
    if resume is not None and o.progress and rank == 0:
        announce_resume(resume, plan.checkpoint.dir, stop)
    bar = progress_bar("collect", stop, min(start, stop), o.progress and rank == 0)
    try:
        if start < stop:
            _run_layers(model, local_batches, plan, start, initial, results, entries, bar)
    finally:
        if bar is not None:  # closed before any message, so that an error starts on a line of its own
            bar.close()
    return _report(plan, results, start, time.perf_counter() - t0)


def _run_layers(
    model: nn.Module,
    local_batches: list[Batch],
    plan: CollectionPlan,
    start: int,
    initial: list[CachedInputs] | None,
    results: dict[str, TargetStats],
    entries: list[dict[str, Any]],
    bar: Any,
) -> None:
    """Step from layer ``start`` (inputs ``initial`` when resuming) to the last layer holding a target; the final
    commit marks the collection finished."""
    steps = layer_steps(
        model,
        local_batches,
        propagate="fp",
        offload_activations=plan.options.offload_activations,
        start=start,
        initial_inputs=initial,
        batch_numbers=plan.mine,
    )
    report_phase("collect: embedding")
    try:
        _step_through(steps, plan, start, results, entries, bar)
    finally:
        steps.close()
    if plan.checkpoint is not None:
        plan.checkpoint.commit(max(plan.by_layer) + 1, {}, entries, finished=True)


def _report(plan: CollectionPlan, results: dict[str, TargetStats], start: int, seconds: float) -> ActivationReport:
    """The report (after the raw activations' manifest, with a ``save_dir``)."""
    o = plan.options
    ordered = {t.name: results[t.name] for t in plan.targets}
    if plan.writer is not None:
        report_phase("collect: manifest")
        meta = {n: {"layer": s.layer, "channels": s.channels, "pattern": s.pattern} for n, s in ordered.items()}
        plan.writer.finish(meta, plan.fingerprint)
    return ActivationReport(
        targets=ordered,
        patterns=plan.patterns,
        stats=list(o.stats),
        bins=o.bins,
        top_k=o.top_k,
        batch_size=o.batch_size,
        world_size=world()[1],
        num_samples=sum(int(b.input_ids.shape[0]) for b in plan.batches),
        num_tokens=sum(b.num_tokens for b in plan.batches),
        fingerprint=plan.fingerprint,
        save_dir=None if o.save_dir is None else str(o.save_dir),
        seconds=seconds,
        resumed_from_layer=start,
    )


def _step_through(
    steps: Iterator[LayerStep],
    plan: CollectionPlan,
    start: int,
    results: dict[str, TargetStats],
    entries: list[dict[str, Any]],
    bar: Any,
) -> None:
    """Visit the layers up to the last holding a target: commit (from after the first such layer on), collect."""
    by_layer, every = plan.by_layer, plan.options.checkpoint_every
    first, last = min(by_layer), max(by_layer)
    group = dp_group()
    for step in steps:
        report_phase(f"collect {step.name}")
        if plan.checkpoint is not None and step.index > max(start, first) and step.index % every == 0:
            inputs = {b: x.hidden_states for b, x in zip(plan.mine, step.inputs)}
            plan.checkpoint.commit(step.index, inputs, entries)
            fault_point("collect.committed", completed_layers=step.index)
        if step.index in by_layer:
            layer_start = time.perf_counter()
            found = _collect_layer(step, by_layer[step.index], plan.options, plan.writer, plan.mine, group)
            results.update({s.name: s for s in found})
            if plan.checkpoint is not None:
                entries.append(plan.checkpoint.record_layer(step.index, found))
            if bar is not None:
                bar.set_postfix_str(f"{step.name} {time.perf_counter() - layer_start:.2f}s")
        if bar is not None:
            bar.update(1)
        if step.index == last:
            return


# ----------------------------------------------------------------------------------------------- one layer


def _module_of(step: LayerStep, target: Target) -> nn.Module:
    return step.layer.get_submodule(target.relative) if target.relative else step.layer


def _hook(stack: ExitStack, module: nn.Module, target: Target, record: Any) -> None:
    """Call ``record(tensor)`` with what ``target`` observes on each call of ``module``, until ``stack`` closes.

    Output hooks go first among the module's forward hooks: they see the output while the call's token mask (an MoE
    expert's routed tokens) is still declared."""
    if target.tensor == "input":
        handle = module.register_forward_pre_hook(
            lambda m, args, kwargs: record(observed_tensor("input", args, kwargs)), with_kwargs=True
        )
    else:
        handle = module.register_forward_hook(
            lambda m, args, kwargs, out: record(observed_tensor("output", args, kwargs, out)),
            with_kwargs=True,
            prepend=True,
        )
    stack.callback(handle.remove)


def _first_pass(step: LayerStep, observers: list[TargetObserver], keep_bytes: float, must_keep: bool) -> None:
    """Run the layer over this rank's batches with the observers' hooks; its outputs become the next inputs."""
    outputs = []
    with ExitStack() as stack:
        stack.enter_context(ExpertTokenMasks(step.layer))
        for o in observers:
            _hook(stack, _module_of(step, o.target), o.target, o.observe)
        for i, x in enumerate(step.inputs):
            for o in observers:
                o.start_batch(i, tuple(x.hidden_states.shape[:2]))
            outputs.append(step.forward(i).to(step.cache_device))
            if not must_keep and observers[0].keep and sum(o.kept_bytes for o in observers) > keep_bytes:
                for o in observers:  # too much to keep: the histogram takes a second pass instead
                    o.keep = False
                    o.drop_unsquared()
    step.outputs = outputs


def _second_pass(step: LayerStep, observers: list[TargetObserver]) -> None:
    """Histogram counts from a second run of the layer (outputs discarded)."""
    with ExitStack() as stack:
        stack.enter_context(ExpertTokenMasks(step.layer))
        for o in observers:
            _hook(stack, _module_of(step, o.target), o.target, o.observe_histogram)
        for i in range(len(step.inputs)):
            step.forward(i)


def _check_flags(flags: torch.Tensor, observers: list[TargetObserver], step: LayerStep) -> None:
    """The same verdict on every rank (the flags are merged): a one-line error for the first bad target."""
    for (ran, _, problem), o in zip(flags.tolist(), observers):
        t = o.target
        head = f"target {t.pattern!r}: "
        if not ran:
            raise CollectionError(
                head + f"{t.module} never ran in the model's forward (its decoder layer {step.name} ran on the data, "
                "this module did not); choose modules the forward calls"
            )
        if problem == NOT_A_TENSOR:
            raise CollectionError(head + f"the {t.tensor} of {t.module} is not a floating-point tensor")
        if problem == CHANNELS_DIFFER:
            raise CollectionError(head + f"{t.module}'s {t.tensor}s differ in their last dimension (the channels)")
        if problem == NOT_PER_TOKEN:
            raise CollectionError(
                head + f"cannot save raw activations of {t.name}: its tensor is not one row per token of the batch "
                "([batch, seq, channels]; an MoE expert sees its routed tokens only); collect its statistics without "
                "save_dir"
            )
        if problem == SEVERAL_CALLS:
            raise CollectionError(
                head + f"cannot save raw activations of {t.name}: {t.module} runs more than once per batch"
            )


def _collect_layer(
    step: LayerStep,
    targets: list[Target],
    o: CollectionOptions,
    writer: ActivationWriter | None,
    mine: list[int],
    group: Any,
) -> list[TargetStats]:
    """Observe, check, merge and (with a writer) save one layer's targets; see the module docstring."""
    histogram = "histogram" in o.stats
    observers = [TargetObserver(t, list(o.stats), o.bins, step.device) for t in targets]
    for obs in observers:
        obs.keep = writer is not None or histogram
        obs.keep_device = step.cache_device
        obs.per_token = writer is not None
    _first_pass(step, observers, o.keep_mb * 2**20, must_keep=writer is not None)
    flags = merge_flags(observers, group)
    _check_flags(flags, observers, step)
    for obs, channels in zip(observers, flags[:, 1].tolist()):
        obs.adopt(int(channels))
    merge_maxima(observers, group)
    if writer is not None:  # first: the histogram turns the kept rows into |x|
        report_phase(f"collect {step.name}: writing")
        for i, batch in enumerate(mine):
            writer.write(step.index, batch, {obs.target.name: _rows_of(obs, i) for obs in observers})
    if histogram:
        for obs in observers:
            obs.start_histogram()
        if all(obs.keep for obs in observers):
            for obs in observers:
                obs.count_kept()
        else:
            _second_pass(step, observers)
    merge_sums(observers, group)
    for obs in observers:
        obs.drop_kept()
    return [obs.result(o.top_k) for obs in observers]


def _rows_of(observer: TargetObserver, batch: int) -> torch.Tensor:
    kept = observer.kept.get(batch, [])
    return kept[0] if kept else torch.zeros(0, observer.channels)
