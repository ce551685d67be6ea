"""The calibration runner: ``calibrate(model, data, recipe)`` on a plain or FSDP2-sharded model.

It is :func:`shardcal.layer_steps` plus quantizers, over the whole model: the recipe and its algorithm, the batches
(split across ranks by whole batches, so the result does not depend on the world size; only the SQNR sequences when
nothing reads the data), the residual rotation, an activation report, then each decoder layer (gathered once)
calibrated by :func:`~shardcal.calib.layer_calibration.calibrate_layer`, the progress bar and the report. With
``checkpoint_dir`` the run commits every few layers and can be interrupted and resumed bit-identically (see
:mod:`shardcal.calib.calibration_checkpoint`). Options: :class:`CalibrationOptions`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..algorithms import LayerAlgorithm, make_algorithm
from ..algorithms.residual import PROBE_TOKENS, residual_rotation, rotate_residual
from ..collect.feed import ActivationFeed
from ..collect.report import ActivationReport
from ..errors import CalibrationInterrupted
from ..layerwise.batches import Batch, leading_rows, model_batches, rank_batch_indices, warn_idle_ranks
from ..layerwise.inputs import CachedInputs
from ..layerwise.moe import moe_blocks
from ..layerwise.options import CalibrationOptions
from ..layerwise.progress import progress_bar
from ..layerwise.resume import announce_resume, resume_point
from ..layerwise.steps import first_rows, layer_steps
from ..quant.experts import expert_projections
from ..runtime.distributed import dp_group, world
from ..runtime.faults import fault_point
from ..runtime.health import rank_guard, report_phase
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from ..sharding.residency import held_layer, residency_of
from .calibration_checkpoint import (
    CalibrationCheckpoint,
    ResumeState,
    held_weight_pieces,
    local_weight_pieces,
    quantizer_state,
    restore_quantizers,
    restore_weights,
    run_fingerprint,
)
from .layer_calibration import calibrate_layer
from .recipe import Recipe
from .recipes import load_recipe
from .report import CalibrationReport, LayerReport


def commit_points(num_layers: int, every: int, start: int = 0) -> list[int]:
    """After how many finished decoder layers a calibration with a checkpoint directory commits: every ``every``
    layers past ``start`` (the layers it resumed with), and once all ``num_layers`` are done."""
    return [k for k in range(start + 1, num_layers) if k % every == 0] + ([num_layers] if start < num_layers else [])


def calibrate(
    model: nn.Module,
    data: Any,
    recipe: str | Path | Recipe,
    options: CalibrationOptions | None = None,
    *,
    activation_report: ActivationReport | str | Path | None = None,
    **changes: Any,
) -> CalibrationReport:
    """Calibrate ``model`` (plain or FSDP2-sharded) layer by layer on ``data`` with ``recipe``; return the report.

    ``options`` (:class:`~shardcal.layerwise.options.CalibrationOptions`) says how; keyword ``changes`` override single
    fields (``calibrate(model, ids, "fp8", batch_size=4)``). Collective under torch.distributed: every rank calls it
    with the same data; each rank computes on its own whole batches. ``data``: an int tensor ``[N, L]``, a list of
    them, or dicts with ``input_ids`` (and ``attention_mask``). Afterwards the model's targeted Linears are
    fake-quant ``QuantLinear`` modules in quantize mode. If another rank fails, this one raises a
    :class:`~shardcal.errors.DistributedError` naming that rank and its layer. ``activation_report``: statistics
    collected by :func:`shardcal.collect_activations` on this model and data (a report or its directory), used
    instead of observing where they are the same (:mod:`shardcal.collect.feed`).
    """
    options = (options or CalibrationOptions()).replace(**changes)
    with rank_guard():
        return _calibrate(model, data, recipe, options, activation_report)


def _calibrate(
    model: nn.Module,
    data: Any,
    recipe: str | Path | Recipe,
    options: CalibrationOptions,
    activation_report: ActivationReport | str | Path | None = None,
) -> CalibrationReport:
    t0 = time.perf_counter()
    report_phase("calibrate: setup")
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    algorithm = make_algorithm(recipe.algorithm)
    if options.propagate is None:
        options = options.replace(propagate=algorithm.propagate)
    propagate = options.propagate
    layers = require_decoder_layers(model)
    _check_rotations(layers, decoder_layer_prefix(model, layers), recipe)
    batches = model_batches(model, data, options.batch_size)
    rank, world_size = world()
    group = dp_group()
    sample = leading_rows(batches, options.sqnr_tokens)  # the SQNR sequences: {global batch: its first rows}
    run_batches = batches
    if _reads_no_data(layers, recipe, algorithm, feed_given=activation_report is not None):
        # nothing observes the data: only the SQNR sequences (none: no forward at all) pass through the layers
        run_batches = [first_rows(batches[i], rows) for i, rows in sorted(sample.items())]
        sample = {i: b.input_ids.shape[0] for i, b in enumerate(run_batches)}
    mine = rank_batch_indices(len(run_batches), rank, world_size)
    local_batches = [run_batches[i] for i in mine]
    local_sqnr = {j: sample[i] for j, i in enumerate(mine) if i in sample}
    partial = any(rows < run_batches[i].input_ids.shape[0] for i, rows in sample.items())  # the same on every rank
    head_rows = {j: rows for j, rows in local_sqnr.items() if rows < local_batches[j].input_ids.shape[0]}
    prefix = decoder_layer_prefix(model, layers)
    names = [f"{prefix}.{i}" for i in range(len(layers))]

    residual = _rotate_residual(model, recipe, batches)
    # Weights change during calibration when the algorithm edits them, when fused experts store quantized values, or
    # when the residual stream is rotated.
    keep_weights = algorithm.changes_weights or residual or any(p.dim() == 3 for p in model.parameters())
    feed = None
    if activation_report is not None:
        feed = ActivationFeed.for_run(activation_report, model, batches, recipe, algorithm, propagate)
        if feed.smoothing:
            algorithm.collected_max = feed.smoothing_maxima
    checkpoint = None
    resume = None
    if options.checkpoint_dir is not None:
        fingerprinted = options.fingerprint() | ({"activation_report": feed.digest()} if feed is not None else {})
        fingerprint = run_fingerprint(model, recipe, batches, fingerprinted)
        checkpoint = CalibrationCheckpoint(options.checkpoint_dir, fingerprint, rank, world_size)
        resume = checkpoint.load(mine, reference=algorithm.reference_stream)
    report = CalibrationReport(
        recipe=recipe.name,
        propagate=propagate,
        world_size=world_size,
        num_batches=len(batches),
        num_tokens=sum(b.num_tokens for b in batches),
        layer_tokens=sum(b.num_tokens for b in run_batches),
    )
    start, initial = _resume(model, recipe, names, resume, report, local_batches, checkpoint, options)
    residency = residency_of(model)
    # a streamed run's finished layers leave memory at the end of their step: their changed weights (this rank's
    # share of the rows) are kept from then until the next commit writes them
    pending: dict[str, tuple[int, torch.Tensor]] | None = None
    unhook = None
    if checkpoint is not None and keep_weights and residency.streamed:
        pending = {}
        unhook = residency.on_release(lambda index, layer: pending.update(held_weight_pieces(layer, names[index])))
    reference = None
    if initial is not None and resume is not None and resume.reference is not None:
        reference = [r.to(x.hidden_states.device) for r, x in zip(resume.reference, initial)]

    if rank == 0:
        warn_idle_ranks(len(batches), options.batch_size, world_size, stacklevel=3)  # calibrate's caller
    if resume is not None and options.progress and rank == 0:
        announce_resume(resume, checkpoint.dir, len(layers))
    bar = progress_bar("calibrate", len(layers), start, options.progress and rank == 0)
    steps = layer_steps(
        model,
        local_batches,
        propagate=propagate,
        offload_activations=options.offload_activations,
        start=start,
        initial_inputs=initial,
        batch_numbers=mine,
        head_rows=head_rows if partial else None,
        reference_stream=algorithm.reference_stream,
        initial_reference=reference,
    )
    report_phase("calibrate: embedding")
    committed = start  # the layers the checkpoint directory holds (0 without one)
    commits = set(commit_points(len(layers), options.checkpoint_every, start))
    try:
        for step in steps:
            report_phase(f"calibrate {step.name}")
            if checkpoint is not None and step.index in commits:
                acts = {mine[j]: x.hidden_states for j, x in enumerate(step.inputs)}
                refs = None if step.reference_inputs is None else dict(zip(mine, step.reference_inputs))
                _commit(checkpoint, model, names, step.index, acts, report, keep_weights, refs, pending)
                committed = step.index
                fault_point("calibrate.committed", completed_layers=step.index)
            entry = calibrate_layer(
                step, recipe, group, options.calibrate_all_experts, local_sqnr, algorithm, propagate, feed
            )
            report.layers.append(entry)
            if bar is not None:
                bar.set_postfix_str(f"{entry.name} {entry.seconds:.2f}s")
                bar.update(1)
    except KeyboardInterrupt as exc:  # how far it got, for the message (see CalibrationInterrupted)
        where = None if checkpoint is None else str(checkpoint.dir)
        raise CalibrationInterrupted(len(report.layers), len(layers), committed, where) from exc
    finally:
        if bar is not None:  # closed before any message, so that an error starts on a line of its own
            bar.close()
        if unhook is not None:
            unhook()
    if checkpoint is not None and len(layers) in commits:
        _commit(checkpoint, model, names, len(layers), {}, report, keep_weights, None, pending)
    report.seconds = time.perf_counter() - t0
    if options.report_path is not None and rank == 0:
        report.save_json(options.report_path)
    return report


def _rotate_residual(model: nn.Module, recipe: Recipe, batches: list[Batch]) -> bool:
    """``[rotation] residual``: rotate the model's residual stream, folded into its weights, before anything is
    calibrated (a resumed run rotates the freshly loaded model the same way, then restores its finished layers),
    checked on the data's first sequence; return whether it did. Collective for a sharded model."""
    rotation = recipe.rotation
    if rotation is None or rotation.residual is None:
        return False
    report_phase("calibrate: residual rotation")
    probe = batches[0].input_ids[:1, :PROBE_TOKENS] if batches else None
    rotate_residual(model, residual_rotation(model, rotation.residual, rotation.seed), probe=probe)
    return True


def _check_rotations(layers: nn.ModuleList, prefix: str, recipe: Recipe) -> None:
    """A :class:`RecipeError` before anything changes when ``[rotation]`` cannot rotate a Linear it selects."""
    if recipe.rotation is None:
        return
    for i, layer in enumerate(layers):
        for name, sub in layer.named_modules(prefix=f"{prefix}.{i}"):
            if isinstance(sub, nn.Linear) and recipe.matches(name):
                recipe.rotation_block(name, sub.in_features)


def _reads_no_data(layers: nn.ModuleList, recipe: Recipe, algorithm: LayerAlgorithm, feed_given: bool) -> bool:
    """Whether no result of the run depends on the data beyond the SQNR sequences: round to nearest, every activation
    quantizer dynamic (or none) and no KV-cache quantizer, also in the fallback recipe, no activation report, and no
    MoE layer (whose report counts the routing of every token)."""
    if type(algorithm) is not LayerAlgorithm or feed_given:
        return False
    r: Recipe | None = recipe
    while r is not None:
        if r.kv_cache is not None or any(not s.dynamic for role, s in r.specs.items() if role != "weight"):
            return False
        r = r.fallback
    return not any(moe_blocks(layer) or any(expert_projections(m) for m in layer.modules()) for layer in layers)


def _resume(
    model: nn.Module,
    recipe: Recipe,
    names: list[str],
    resume: ResumeState | None,
    report: CalibrationReport,
    local_batches: list[Batch],
    checkpoint: CalibrationCheckpoint | None,
    options: CalibrationOptions,
) -> tuple[int, list[CachedInputs] | None]:
    """Put back what the checkpoint committed — the finished layers' report entries and quantizers, and weights an
    algorithm changed — and return where the run starts and that layer's inputs (``(0, None)`` without one)."""
    if resume is None or checkpoint is None:
        return 0, None
    done = resume.completed_layers
    report.layers = [LayerReport(**entry) for entry in resume.report]
    fallback = set(report.fallback_layers)
    if residency_of(model).streamed:
        _replay_streamed(model, recipe, names, resume, fallback)
    else:
        restore_quantizers(model, recipe, names[:done], resume.quantizer_state, fallback)
        restore_weights(model, resume.weights)
    report.resumed_from_layer = done
    return resume_point(model, local_batches, resume, len(names), checkpoint, options.offload_activations)


def _replay_streamed(
    model: nn.Module, recipe: Recipe, names: list[str], resume: ResumeState, fallback: set[str]
) -> None:
    """A resumed streamed run's committed layers: each read in again, its quantizers and changed weights put back
    from the checkpoint, and released, which exports it (the residency's release hooks), without calibrating it
    again. Collective."""
    layers = require_decoder_layers(model)
    for i in range(resume.completed_layers):
        report_phase(f"resume: export {names[i]}")
        with held_layer(model, i, layers[i]):
            restore_quantizers(model, recipe, [names[i]], resume.quantizer_state, fallback)
            restore_weights(model, {n: p for n, p in resume.weights.items() if n.startswith(f"{names[i]}.")})


def _commit(
    checkpoint: CalibrationCheckpoint,
    model: nn.Module,
    names: list[str],
    done: int,
    acts: dict[int, torch.Tensor],
    report: CalibrationReport,
    keep_weights: bool,
    reference: dict[int, torch.Tensor] | None = None,
    pending: dict[str, tuple[int, torch.Tensor]] | None = None,
) -> None:
    """Commit the first ``done`` layers. ``pending``: a streamed run's changed weights of the layers finished since
    the last commit (the earlier ones stay committed); None: the weights are read from the model (resident)."""
    if pending is not None:
        weights: dict[str, tuple[int, torch.Tensor]] | None = dict(pending)
    else:
        weights = local_weight_pieces(model, names[:done]) if keep_weights else None
    checkpoint.commit(
        done,
        len(names),
        acts,
        quantizer_state(model, names[:done]),
        [dict(entry.__dict__) for entry in report.layers[:done]],
        weights=weights,
        reference=reference,
        adds_weights=pending is not None,
    )
    if pending is not None:
        pending.clear()
