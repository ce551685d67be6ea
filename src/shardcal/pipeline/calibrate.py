"""``calibrate_to_checkpoint``: what ``shardcal calibrate`` does, as one library call — a model directory in, an export out.

Collective: every rank calls it (under torchrun, :func:`shardcal.runtime.launcher.launch`, or alone, which forms a
one-process group). The steps, each on every rank:

1. the checks before loading (:func:`~.inputs.check_calibration_inputs`): recipe, export format, outputs never over
   inputs, ``overwrite``, config, headers against the recipe;
2. the token data (:func:`~.inputs.read_token_data`);
3. the planner's refusal (:func:`shardcal.plan.planner.check_before_loading`) unless ``force``;
4. the sharded load, :func:`~shardcal.calib.runner.calibrate`, :func:`~shardcal.export.export.export_checkpoint`;
5. on rank 0: the SQNR plot in the export, and the calibration checkpoint removed (unless ``keep_checkpoint``).
"""

from __future__ import annotations

import resource
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..calib.calibration_checkpoint import remove_checkpoint
from ..calib.recipe import Recipe
from ..calib.report import SQNR_PLOT_NAME, CalibrationReport
from ..calib.runner import calibrate
from ..data.sources import DataOptions, data_shape
from ..errors import (
    CalibrationInterrupted,
    InsufficientMemoryError,
    RunInterrupted,
    UsageError,
    interrupted_as,
)
from ..export.export import export_checkpoint
from ..export.format import DEFAULT_FORMAT, ExportFormat
from ..layerwise.options import CalibrationOptions
from ..runtime.distributed import all_gather_floats, init_distributed
from ..runtime.fsutil import missing_ancestors, remove_empty_dirs
from .chooser import damage_warning
from .inputs import CalibrationInputs, DataArgument, check_calibration_inputs, input_name, read_token_data
from .streamed import STREAM_MODES, calibrate_streamed, streaming_refusal

#: The SQNR plot written into the export directory (rank 0; needs matplotlib).
PLOT_NAME = SQNR_PLOT_NAME


@dataclass(frozen=True, kw_only=True)
class PhaseSeconds:
    """Where a run's wall time went, per phase (seconds, this rank): loading the model, calibrating it, exporting it.
    A streamed run reads and writes each decoder layer in its calibration step: its load is the rest of the model,
    its export what is left to write after the last step."""

    load: float
    calibration: float
    export: float


@dataclass(frozen=True, kw_only=True)
class PipelineResult:
    """What one rank's :func:`calibrate_to_checkpoint` did.

    Built by keyword. ``seconds``: loading and calibration (not the export); ``peak_memory_mb``: every rank's peak (host RSS, or the
    accelerator's peak allocation on CUDA), in rank order, in MiB (2^20 bytes; the name predates the unit).
    ``memory_growth_mib``: every rank's measured peak growth over its baseline (on CPU: the kernel's high-water mark
    ``VmHWM``, restarted when the call begins, less the resident size then — after imports, the process group
    joined — which is what the planner predicts); ``memory_baseline_mib``: those baselines (0 on CUDA, where both
    figures are the accelerator's allocation); ``planned_growth_mib``: the planner's predicted peak per rank (None
    with ``force``, or when the planner could not build the model). ``checkpoint_dir``: ``options.checkpoint_dir``. ``plot``
    and ``checkpoint_removed_bytes`` (the bytes freed by removing ``checkpoint_dir``) are rank 0's (None elsewhere,
    and when there is no plot / no checkpoint was removed).
    """

    out_dir: Path
    report: CalibrationReport
    recipe: Recipe
    rank: int
    world_size: int
    data_shape: tuple[int, int]
    data_source: str
    seconds: float
    peak_memory_mb: list[float]
    checkpoint_dir: str | Path | None = None
    plot: Path | None = None
    checkpoint_removed_bytes: int | None = None
    memory_growth_mib: list[float] | None = None
    memory_baseline_mib: list[float] | None = None
    planned_growth_mib: list[float] | None = None
    #: Whether the decoder layers were streamed from disk (``stream=``).
    streamed: bool = False
    #: Loading, calibration and export, each (:class:`PhaseSeconds`); None only where a caller built the result.
    phases: PhaseSeconds | None = None
    #: The whole call, from its checks to the plot (``seconds`` leaves out the checks, the data and the export).
    wall_seconds: float | None = None

    @property
    def process_peak_mib(self) -> list[float] | None:
        """Every rank's process peak since the call began: its baseline plus its growth (MiB)."""
        if self.memory_growth_mib is None or self.memory_baseline_mib is None:
            return None
        return [b + g for b, g in zip(self.memory_baseline_mib, self.memory_growth_mib, strict=True)]


def calibrate_to_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    recipe: str | Path | Recipe,
    *,
    data: DataArgument = None,
    num_samples: int = 32,
    seq_len: int | None = None,
    options: CalibrationOptions | None = None,
    keep_checkpoint: bool = False,
    overwrite: bool = False,
    model_impl: str = "auto",
    force: bool = False,
    shard_root: bool = True,
    cpu_offload: bool = False,
    format: str | ExportFormat = DEFAULT_FORMAT,
    export_dtype: str | None = "auto",
    input_names: Mapping[str, str] | None = None,
    stream: str = "auto",
    data_options: DataOptions | None = None,
) -> PipelineResult:
    """Calibrate the Hugging Face-format model in ``model_dir`` with ``recipe``, sharded over the ranks, and export it
    to ``out_dir`` — what ``shardcal calibrate`` does, with the same checks, files and numbers.

    - ``data`` / ``num_samples`` / ``seq_len`` / ``data_options``: the token data (:func:`~.inputs.read_token_data`:
      one source or several, ``PATH:COUNT``, records read as ``data_options`` says; None: the calibration half of
      the Wikipedia summaries).
    - ``options``: how :func:`shardcal.calibrate` runs (batch size, propagation, SQNR tokens, ``checkpoint_dir``
      ...); ``keep_checkpoint``: leave ``options.checkpoint_dir`` after a successful export (else rank 0 removes it).
    - ``overwrite``: replace a non-empty ``out_dir``; ``model_impl``: ``"auto"``, ``"shardcal"`` or
      ``"transformers"`` (whose model class loads the directory); ``force``: run even when the planner predicts more
      memory than is free; ``shard_root`` / ``cpu_offload``: as :func:`shardcal.load_pretrained`; ``format``: the
      export format (``"compressed-tensors"``); ``export_dtype``: the dtype of the export's unquantized tensors,
      ``"auto"`` (the checkpoint's own: bf16 for a bf16 checkpoint, whatever dtype the model was calibrated in),
      ``"bfloat16"``, ``"float16"``, ``"float32"``, or None (the loaded model's).
    - ``input_names``: how errors name the inputs (:data:`~.inputs.PARAMETER_NAMES`; the CLI passes its flags).
    - ``stream``: ``"auto"`` streams the decoder layers from disk (:mod:`~.streamed`: a rank holds one layer at a
      time, each exported at the end of its step) when the resident run would not fit and the run can stream (one
      warning says so), ``"on"`` always (a run that cannot stream is refused, with the reason), ``"off"`` never.

    Everything that can be refused without weights is refused before any weight or data is read. Collective (every
    rank calls it with the same arguments). Returns this rank's :class:`PipelineResult`.
    """
    options = options if options is not None else CalibrationOptions()
    if stream not in STREAM_MODES:
        raise UsageError(f"{input_name(input_names, 'stream')} {stream!r}: expected one of {', '.join(STREAM_MODES)}")
    rank, world = init_distributed()
    created = sorted({d for p in (out_dir, options.checkpoint_dir) if p is not None for d in missing_ancestors(p)},
                     key=lambda d: len(d.parts), reverse=True)  # fmt: skip
    try:
        return _calibrate_to_checkpoint(
            model_dir, out_dir, recipe, data=data, num_samples=num_samples, seq_len=seq_len, options=options,
            keep_checkpoint=keep_checkpoint, overwrite=overwrite, model_impl=model_impl, force=force,
            shard_root=shard_root, cpu_offload=cpu_offload, format=format, export_dtype=export_dtype,
            input_names=input_names, stream=stream, data_options=data_options,
        )  # fmt: skip
    finally:
        if rank == 0:  # the directories this call created for the export or the checkpoint, when left empty
            remove_empty_dirs(created)


def _calibrate_to_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    recipe: str | Path | Recipe,
    *,
    data: DataArgument,
    num_samples: int,
    seq_len: int | None,
    options: CalibrationOptions,
    keep_checkpoint: bool,
    overwrite: bool,
    model_impl: str,
    force: bool,
    shard_root: bool,
    cpu_offload: bool,
    format: str | ExportFormat,
    export_dtype: str | None,
    input_names: Mapping[str, str] | None,
    stream: str,
    data_options: DataOptions | None,
) -> PipelineResult:
    """:func:`calibrate_to_checkpoint` once the process group is joined."""
    called = time.perf_counter()
    rank, world = init_distributed()
    baseline = memory_baseline()
    inputs = check_calibration_inputs(
        model_dir, out_dir, recipe, data=data, checkpoint_dir=options.checkpoint_dir, overwrite=overwrite,
        model_impl=model_impl, format=format, export_dtype=export_dtype, input_names=input_names,
        data_options=data_options,
    )  # fmt: skip
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    with interrupted_as(f"interrupted before calibrating {model_dir}: nothing was written"):
        ids, source = read_token_data(
            model_dir, inputs.vocab_size, data=data, num_samples=num_samples, seq_len=seq_len, split="calib",
            input_names=input_names, data_options=data_options,
        )  # fmt: skip
        streamed, planned = _streaming_decision(stream, model_dir, inputs, data_shape(ids), options, shard_root,
                                                cpu_offload, force, input_names)  # fmt: skip
        start = time.perf_counter()
        if not streamed:
            model = _load(model_dir, inputs, shard_root, cpu_offload)
            loaded = time.perf_counter()
    if streamed:
        flag = input_name(input_names, "checkpoint_dir")
        lost = f"{out_dir} was not written" + ("" if options.checkpoint_dir is not None else
                                               f" and the calibration is lost; pass {flag} to keep it next time")  # fmt: skip
        try:
            with interrupted_as(f"interrupted during a streamed run: {lost}"):
                run = calibrate_streamed(
                    model_dir, out_dir, inputs.recipe, ids, options, overwrite=overwrite, shard_root=shard_root,
                    export_format=inputs.export_format, export_dtype=inputs.export_dtype, impl=inputs.impl,
                )  # fmt: skip
        except CalibrationInterrupted as exc:
            if exc.checkpoint_dir is not None:  # what is committed, and where the rerun resumes
                raise
            raise RunInterrupted(f"interrupted at layer {exc.done} of {exc.total} of a streamed run: {lost}") from None
        report = run.report
        phases = PhaseSeconds(load=run.load_seconds, calibration=run.calibration_seconds, export=run.export_seconds)
    else:
        report = calibrate(model, ids, inputs.recipe, options)  # Ctrl-C here: CalibrationInterrupted, how far it got
        calibrated = time.perf_counter()
        with interrupted_as(_export_interrupted(out_dir, options.checkpoint_dir, input_names)):
            export_checkpoint(model, out_dir, recipe=inputs.recipe, report=report, tokenizer_dir=model_dir,
                              overwrite=overwrite, format=inputs.export_format, dtype=inputs.export_dtype,
                              source=model_dir)  # fmt: skip
        phases = PhaseSeconds(load=loaded - start, calibration=calibrated - loaded,
                              export=time.perf_counter() - calibrated)  # fmt: skip
    with interrupted_as(f"interrupted after the export: {out_dir} is complete"):
        peaks = all_gather_floats(torch_peak_memory_mb())
        growth = all_gather_floats(memory_growth_mib(baseline))
        baselines = all_gather_floats(reported_baseline_mib(baseline))
        plot, removed = None, None
        if rank == 0 and (damage := damage_warning(report, inputs.recipe)) is not None:
            warnings.warn(damage, stacklevel=2)
        if rank == 0:
            threshold = inputs.recipe.min_layer_sqnr_db
            plot = report.save_plot(out_dir / PLOT_NAME, threshold) if out_dir.exists() else None
            if options.checkpoint_dir is not None and not keep_checkpoint:
                removed = remove_checkpoint(options.checkpoint_dir)
    return PipelineResult(
        out_dir=out_dir, report=report, recipe=inputs.recipe, rank=rank, world_size=world,
        data_shape=data_shape(ids), data_source=source, seconds=phases.load + phases.calibration,
        phases=phases, wall_seconds=time.perf_counter() - called, peak_memory_mb=peaks,
        checkpoint_dir=options.checkpoint_dir, plot=plot, checkpoint_removed_bytes=removed,
        memory_growth_mib=growth, memory_baseline_mib=baselines, planned_growth_mib=planned, streamed=streamed,
    )  # fmt: skip


def _export_interrupted(out_dir: Path, checkpoint_dir: str | Path | None, input_names: Mapping[str, str] | None) -> str:
    """What Ctrl-C during the export leaves: no ``out_dir``, and the calibration committed or lost."""
    if checkpoint_dir is not None:
        return (
            f"interrupted during the export: {out_dir} was not written; the calibration is committed in "
            f"{checkpoint_dir}: rerun the same command to export it without calibrating again"
        )
    flag = input_name(input_names, "checkpoint_dir")
    return (
        f"interrupted during the export: {out_dir} was not written and the calibration is lost; pass {flag} to "
        "keep it next time"
    )


def _streaming_decision(
    stream: str,
    model_dir: Path,
    inputs: CalibrationInputs,
    data_shape: tuple[int, ...],
    options: CalibrationOptions,
    shard_root: bool,
    cpu_offload: bool,
    force: bool,
    input_names: Mapping[str, str] | None,
) -> tuple[bool, list[float] | None]:
    """Whether this run streams (``stream``: auto / on / off), and every rank's predicted peak growth (MiB) of the
    run chosen (None unchecked). ``auto`` streams when the planner refuses the resident run and the run can stream;
    a run that cannot stream keeps the planner's refusal, which then says why it cannot stream (collective)."""
    refusal = streaming_refusal(inputs.recipe, inputs.impl)
    if stream == "on" and refusal is not None:
        raise UsageError(f"{input_name(input_names, 'stream')} on: cannot stream this run: {refusal}")
    if stream == "on":
        return True, None if force else _refuse_before_loading(model_dir, inputs.recipe, data_shape, options,
                                                                shard_root, cpu_offload, inputs.impl, streamed=True)  # fmt: skip
    if force:
        return False, None
    try:
        return False, _refuse_before_loading(
            model_dir, inputs.recipe, data_shape, options, shard_root, cpu_offload, inputs.impl
        )
    except InsufficientMemoryError as resident:
        if stream == "off":
            raise
        if refusal is not None:
            raise InsufficientMemoryError(f"{resident}; streaming cannot help: {refusal}") from None
        try:
            planned = _refuse_before_loading(
                model_dir, inputs.recipe, data_shape, options, shard_root, cpu_offload, inputs.impl, streamed=True
            )
        except InsufficientMemoryError:
            raise resident from None
        warnings.warn(
            f"the model does not fit in memory resident ({resident}); streaming its decoder layers from disk instead, "
            f"one at a time ({input_name(input_names, 'stream')} off refuses instead)",
            stacklevel=3,
        )
        return True, planned


def _refuse_before_loading(
    model_dir: Path,
    recipe: Recipe,
    data_shape: tuple[int, ...],
    options: CalibrationOptions,
    shard_root: bool,
    cpu_offload: bool,
    impl: str,
    streamed: bool = False,
) -> list[float] | None:
    """The planner's check (collective): stop every rank before loading when the predicted peak (of a ``streamed``
    run, or a resident one) does not fit; a model the planner cannot build (it has no decoder layers the registry
    finds, say) runs with a warning (None). Returns every rank's predicted peak growth (MiB), in rank order."""
    from ..errors import ConfigError, PlanError
    from ..plan.planner import check_before_loading, check_plannable

    try:
        check_plannable(model_dir, impl)
    except (ConfigError, PlanError) as exc:  # a model the planner cannot build: say so, and run unchecked
        warnings.warn(f"the memory check before loading was skipped: {exc}", stacklevel=2)
        return None
    plan = check_before_loading(
        model_dir,
        recipe,
        data_shape,
        options,
        cpu_offload=cpu_offload,
        shard_root=shard_root,
        impl=impl,
        streamed=streamed,
    )
    return [r.peak / 2**20 for r in sorted(plan.ranks, key=lambda r: r.rank)]


def _load(model_dir: Path, inputs: CalibrationInputs, shard_root: bool, cpu_offload: bool) -> nn.Module:
    """The model, FSDP2-sharded over the ranks, each rank reading its own rows (collective)."""
    from ..loading.foreign import load_transformers_sharded
    from ..loading.sharded import load_pretrained

    load = load_pretrained if inputs.impl == "shardcal" else load_transformers_sharded
    untie = inputs.recipe.rotates_residual  # a residual rotation parts head and embeddings
    return load(model_dir, shard_root=shard_root, cpu_offload=cpu_offload, untie_word_embeddings=untie)


def _on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def memory_baseline() -> int:
    """This process's resident size now (``VmRSS``, bytes; 0 where unknown), what :func:`memory_growth_mib`
    measures from; the high-water mark (and, when CUDA is initialized, the accelerator's peak) restarts here."""
    from ..runtime.hostmem import reset_peak_rss, rss_bytes

    if _on_cuda():
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    return rss_bytes() or 0


def reported_baseline_mib(baseline: int) -> float:
    """The baseline :class:`PipelineResult` reports (MiB): ``baseline`` on CPU, 0 on CUDA (where the growth is the
    accelerator's peak allocation)."""
    return 0.0 if _on_cuda() else baseline / 2**20


def memory_growth_mib(baseline: int) -> float:
    """The peak growth (MiB) since :func:`memory_baseline` returned ``baseline``: what the planner predicts (on CPU
    ``VmHWM - baseline``; on CUDA the peak allocation)."""
    from ..runtime.hostmem import peak_rss_bytes

    if _on_cuda():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = peak_rss_bytes()
    if peak is None:  # no /proc: the process peak since it started
        return max(0.0, torch_peak_memory_mb() - baseline / 2**20)
    return max(0, peak - baseline) / 2**20


def torch_peak_memory_mb() -> float:
    """This process's peak resident memory (MiB), or the accelerator's peak allocation when on CUDA."""
    if _on_cuda():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
