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
(:mod:`shardcal.collect.checkpoint`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CalibrationCheckpointError, CollectionError
from ..layerwise.batches import Batch, make_batches, rank_batch_indices, warn_idle_ranks
from ..layerwise.inputs import CachedInputs
from ..layerwise.moe import ExpertTokenMasks
from ..layerwise.steps import LayerStep, compute_device, embed_batches, layer_steps
from ..runtime.distributed import dp_group, world
from ..runtime.faults import fault_point
from ..runtime.health import rank_guard, report_phase
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from .checkpoint import CollectionCheckpoint
from .report import (
    DEFAULT_BINS,
    DEFAULT_TOP_K,
    STATS,
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
from .store import ActivationWriter, dtype_name, parse_dtype
from .targets import Target, observed_tensor, parse_targets, resolve_targets


def collect_activations(
    model: nn.Module,
    data: Any,
    targets: str | Iterable[str],
    *,
    stats: Sequence[str] = STATS,
    save_dir: str | Path | None = None,
    save_dtype: torch.dtype | str | None = None,
    batch_size: int = 8,
    bins: int = DEFAULT_BINS,
    top_k: int = DEFAULT_TOP_K,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 1,
    offload_activations: bool | None = None,
    keep_mb: float = 4096,
    progress: bool = True,
) -> ActivationReport:
    """Statistics (and with ``save_dir`` the raw values) of ``targets``' activations over ``data``, layer by layer.

    ``targets``: patterns ``"PATTERN[:input|output]"`` (:mod:`shardcal.collect.targets`), e.g.
    ``"model.layers.*.mlp.down_proj:input"``, ``"model.layers.*:output"`` (the residual stream). ``stats``: which of
    ``absmax``, ``mean``, ``meansq``, ``histogram`` to keep (absmax and token counts are always kept). ``bins``: the
    histogram's bins; ``top_k``: largest channels listed per target. ``save_dir``: write each target's activations
    in ``save_dtype`` (default: the model's parameter dtype), read back with
    :class:`~shardcal.collect.store.ActivationDataset`. ``keep_mb``: how much of a layer's target activations a
    rank keeps from the first pass for the histogram before it runs a second pass instead (with ``save_dir`` they
    are always kept: one layer's worth). Collective under torch.distributed: every rank calls it with the same
    arguments; ``data`` as for :func:`shardcal.calibrate`. The report is identical on every rank and world size.
    """
    with rank_guard():
        return _collect(
            model, data, targets, stats=stats, save_dir=save_dir, save_dtype=save_dtype, batch_size=batch_size,
            bins=bins, top_k=top_k, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            offload_activations=offload_activations, keep_mb=keep_mb, progress=progress,
        )  # fmt: skip


def parse_stats(stats: Sequence[str] | str) -> list[str]:
    """The statistics asked for, in :data:`STATS` order; a :class:`CollectionError` naming an unknown one."""
    chosen = [stats] if isinstance(stats, str) else list(stats)
    for s in chosen:
        if s not in STATS:
            raise CollectionError(f"stats: unknown statistic {s!r} (known: {', '.join(STATS)})")
    return [s for s in STATS if s in chosen or s == "absmax"]


def _check_number(name: str, value: Any, low: float, integer: bool = True) -> None:
    """A :class:`CollectionError` unless ``value`` is an integer (or with ``integer=False`` a number) >= ``low``."""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < low:
        raise CollectionError(f"{name} must be {'an integer' if integer else 'a number'} >= {low}, got {value!r}")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@dataclass
class CollectionPlan:
    """One run, checked: its targets by layer, the batches (global, and this rank's), fingerprint and writers."""

    targets: list[Target]
    patterns: list[str]
    stats: list[str]
    options: dict[str, Any]
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


def _plan(model: nn.Module, data: Any, targets: Any, o: dict[str, Any]) -> CollectionPlan:
    """Check every argument (nothing is written) and prepare the run. Collective (the model's fingerprint)."""
    stats = parse_stats(o["stats"])
    patterns = parse_targets(targets)
    for name, low in (("bins", 1), ("top_k", 0), ("checkpoint_every", 1), ("batch_size", 1)):
        _check_number(name, o[name], low)
    _check_number("keep_mb", o["keep_mb"], 0, integer=False)
    layers = require_decoder_layers(model)
    resolved = resolve_targets(model, patterns, decoder_layer_prefix(model, layers), len(layers))
    dtype = parse_dtype(o["save_dtype"], model_dtype(model))
    config = getattr(model, "config", None)
    batches = make_batches(
        data,
        o["batch_size"],
        vocab_size=getattr(config, "vocab_size", None),
        max_positions=getattr(config, "max_position_embeddings", None),
    )
    rank, world_size = world()
    fingerprint = run_fingerprint(model, batches)
    settings = {
        "targets": [t.name for t in resolved],
        "patterns": [p.text for p in patterns],
        "stats": stats,
        "bins": o["bins"],
        "top_k": o["top_k"],
        "save_dtype": dtype_name(dtype) if o["save_dir"] is not None else None,
    }
    run = json_digest({"fingerprint": fingerprint, "settings": settings})
    writer = ActivationWriter(o["save_dir"], dtype, batches, run) if o["save_dir"] is not None else None
    if writer is not None:
        writer.check()
    checkpoint = None
    if o["checkpoint_dir"] is not None:  # not the world size: a run can resume on another number of ranks
        checkpoint = CollectionCheckpoint(o["checkpoint_dir"], {**fingerprint, **settings})
        checkpoint.check_directory()
    return CollectionPlan(
        resolved, settings["patterns"], stats, o, batches, rank_batch_indices(len(batches), rank, world_size),
        fingerprint, writer, checkpoint,
    )  # fmt: skip


def _collect(model: nn.Module, data: Any, targets: Any, **o: Any) -> ActivationReport:
    t0 = time.perf_counter()
    report_phase("collect: setup")
    plan = _plan(model, data, targets, o)
    rank = world()[0]
    local_batches = [plan.batches[i] for i in plan.mine]
    last = max(plan.by_layer)
    results: dict[str, TargetStats] = {}
    entries: list[dict[str, Any]] = []
    start, initial = 0, None
    resume = plan.checkpoint.load(plan.mine) if plan.checkpoint is not None else None
    if resume is not None:
        start, entries, results = resume.completed_layers, resume.entries, resume.stats
        missing = [t.name for t in plan.targets if t.layer < start and t.name not in results]
        if missing or resume.finished != (start > last):
            what = f"no statistics of {missing[0]}" if missing else f"{start} layers done of {last + 1}"
            raise CalibrationCheckpointError(f"{plan.checkpoint.dir}: collection checkpoint is inconsistent ({what})")
        if start <= last:
            initial = _restore_inputs(model, local_batches, resume.activations, o["offload_activations"])
    if rank == 0:
        warn_idle_ranks(len(plan.batches), o["batch_size"], world()[1], stacklevel=3)  # collect_activations' caller
    if resume is not None and o["progress"] and rank == 0:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(resume.committed_at))
        print(
            f"resuming after layer {start} of {last + 1} from {plan.checkpoint.dir} (committed {when})", file=sys.stderr
        )
    bar = _progress_bar(last + 1, min(start, last + 1), o["progress"] and rank == 0)
    if start <= last:
        steps = layer_steps(
            model,
            local_batches,
            propagate="fp",
            offload_activations=o["offload_activations"],
            start=start,
            initial_inputs=initial,
            batch_numbers=plan.mine,
        )
        report_phase("collect: embedding")
        try:
            _step_through(steps, plan, start, results, entries, bar)
        finally:
            steps.close()
            if bar is not None:  # closed before any message, so that an error starts on a line of its own
                bar.close()
        if plan.checkpoint is not None:
            plan.checkpoint.commit(last + 1, {}, entries, finished=True)
    elif bar is not None:
        bar.close()
    ordered = {t.name: results[t.name] for t in plan.targets}
    if plan.writer is not None:
        report_phase("collect: manifest")
        meta = {n: {"layer": s.layer, "channels": s.channels, "pattern": s.pattern} for n, s in ordered.items()}
        plan.writer.finish(meta, plan.fingerprint)
    return ActivationReport(
        targets=ordered,
        patterns=plan.patterns,
        stats=plan.stats,
        bins=o["bins"],
        top_k=o["top_k"],
        batch_size=o["batch_size"],
        world_size=world()[1],
        num_samples=sum(int(b.input_ids.shape[0]) for b in plan.batches),
        num_tokens=sum(b.num_tokens for b in plan.batches),
        fingerprint=plan.fingerprint,
        save_dir=None if o["save_dir"] is None else str(o["save_dir"]),
        seconds=time.perf_counter() - t0,
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
    by_layer, every = plan.by_layer, plan.options["checkpoint_every"]
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
            found = _collect_layer(step, by_layer[step.index], plan.stats, plan.options, plan.writer, plan.mine, group)
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
    stats: list[str],
    o: dict[str, Any],
    writer: ActivationWriter | None,
    mine: list[int],
    group: Any,
) -> list[TargetStats]:
    """Observe, check, merge and (with a writer) save one layer's targets; see the module docstring."""
    histogram = "histogram" in stats
    observers = [TargetObserver(t, stats, o["bins"], step.device) for t in targets]
    for obs in observers:
        obs.keep = writer is not None or histogram
        obs.keep_device = step.cache_device
        obs.per_token = writer is not None
    _first_pass(step, observers, o["keep_mb"] * 2**20, must_keep=writer is not None)
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
    return [obs.result(o["top_k"]) for obs in observers]


def _rows_of(observer: TargetObserver, batch: int) -> torch.Tensor:
    kept = observer.kept.get(batch, [])
    return kept[0] if kept else torch.zeros(0, observer.channels)


# ----------------------------------------------------------------------------------------------- resume


def _restore_inputs(
    model: nn.Module, local_batches: list, activations: list[torch.Tensor], offload: bool | None
) -> list[CachedInputs]:
    """The resume layer's inputs: stored hidden states with freshly computed layer arguments (collective)."""
    device = compute_device(model)
    cache_device = torch.device("cpu") if (offload if offload is not None else device.type != "cpu") else device
    if len(activations) != len(local_batches):
        raise CalibrationCheckpointError(
            f"collection checkpoint holds {len(activations)} of this rank's {len(local_batches)} batches; it is incomplete"
        )
    inputs = embed_batches(model, local_batches, device, cache_device)
    for x, stored in zip(inputs, activations):
        x.hidden_states = stored.to(cache_device)
    return inputs


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    import threading

    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())  # not tqdm's multiprocessing lock: see shardcal.calib.runner
    return tqdm(total=total, initial=initial, desc="collect", unit="layer")
