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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..calib.checkpoint import remove_checkpoint
from ..calib.recipes import Recipe
from ..calib.report import CalibrationReport
from ..calib.runner import calibrate
from ..export.export import export_checkpoint
from ..export.format import DEFAULT_FORMAT, ExportFormat
from ..layerwise.options import CalibrationOptions
from ..runtime.distributed import all_gather_floats, init_distributed
from .inputs import CalibrationInputs, check_calibration_inputs, read_token_data

#: The SQNR plot written into the export directory (rank 0; needs matplotlib).
PLOT_NAME = "calibration_sqnr.png"


@dataclass(frozen=True)
class PipelineResult:
    """What one rank's :func:`calibrate_to_checkpoint` did.

    ``seconds``: loading and calibration (not the export); ``peak_memory_mb``: every rank's peak (host RSS, or the
    accelerator's peak allocation on CUDA), in rank order. ``checkpoint_dir``: ``options.checkpoint_dir``. ``plot``
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


def calibrate_to_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    recipe: str | Path | Recipe,
    *,
    data: str | Path | None = None,
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
    input_names: Mapping[str, str] | None = None,
) -> PipelineResult:
    """Calibrate the Hugging Face-format model in ``model_dir`` with ``recipe``, sharded over the ranks, and export it
    to ``out_dir`` — what ``shardcal calibrate`` does, with the same checks, files and numbers.

    - ``data`` / ``num_samples`` / ``seq_len``: the token data (:func:`~.inputs.read_token_data`; None: the
      calibration half of the Wikipedia summaries).
    - ``options``: how :func:`shardcal.calibrate` runs (batch size, propagation, SQNR tokens, ``checkpoint_dir``
      ...); ``keep_checkpoint``: leave ``options.checkpoint_dir`` after a successful export (else rank 0 removes it).
    - ``overwrite``: replace a non-empty ``out_dir``; ``model_impl``: ``"auto"``, ``"shardcal"`` or
      ``"transformers"`` (whose model class loads the directory); ``force``: run even when the planner predicts more
      memory than is free; ``shard_root`` / ``cpu_offload``: as :func:`shardcal.load_pretrained`; ``format``: the
      export format (``"compressed-tensors"``).
    - ``input_names``: how errors name the inputs (:data:`~.inputs.PARAMETER_NAMES`; the CLI passes its flags).

    Everything that can be refused without weights is refused before any weight or data is read. Collective (every
    rank calls it with the same arguments). Returns this rank's :class:`PipelineResult`.
    """
    options = options if options is not None else CalibrationOptions()
    rank, world = init_distributed()
    inputs = check_calibration_inputs(
        model_dir, out_dir, recipe, data=data, checkpoint_dir=options.checkpoint_dir, overwrite=overwrite,
        model_impl=model_impl, format=format, input_names=input_names,
    )  # fmt: skip
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    ids, source = read_token_data(
        model_dir, inputs.vocab_size, data=data, num_samples=num_samples, seq_len=seq_len, split="calib",
        input_names=input_names,
    )  # fmt: skip
    if not force:
        _refuse_before_loading(
            model_dir, inputs.recipe, tuple(ids.shape), options, shard_root, cpu_offload, inputs.impl
        )
    start = time.perf_counter()
    model = _load(model_dir, inputs, shard_root, cpu_offload)
    report = calibrate(model, ids, inputs.recipe, options)
    seconds = time.perf_counter() - start
    export_checkpoint(model, out_dir, recipe=inputs.recipe, report=report, tokenizer_dir=model_dir,
                      overwrite=overwrite, format=inputs.export_format)  # fmt: skip
    peaks = all_gather_floats(torch_peak_memory_mb())
    plot, removed = None, None
    if rank == 0:
        plot = report.save_plot(out_dir / PLOT_NAME) if out_dir.exists() else None
        if options.checkpoint_dir is not None and not keep_checkpoint:
            removed = remove_checkpoint(options.checkpoint_dir)
    return PipelineResult(out_dir, report, inputs.recipe, rank, world, (int(ids.shape[0]), int(ids.shape[1])),
                          source, seconds, peaks, options.checkpoint_dir, plot, removed)  # fmt: skip


def _refuse_before_loading(
    model_dir: Path,
    recipe: Recipe,
    data_shape: tuple[int, ...],
    options: CalibrationOptions,
    shard_root: bool,
    cpu_offload: bool,
    impl: str,
) -> None:
    """The planner's check (collective): stop every rank before loading when the predicted peak does not fit; a
    model the planner cannot build (it has no decoder layers the registry finds, say) runs with a warning."""
    import warnings

    from ..errors import ConfigError, PlanError
    from ..plan.planner import check_before_loading, check_plannable

    try:
        check_plannable(model_dir, impl)
    except (ConfigError, PlanError) as exc:  # a model the planner cannot build: say so, and run unchecked
        warnings.warn(f"the memory check before loading was skipped: {exc}", stacklevel=2)
        return
    check_before_loading(
        model_dir, recipe, data_shape, options, cpu_offload=cpu_offload, shard_root=shard_root, impl=impl
    )


def _load(model_dir: Path, inputs: CalibrationInputs, shard_root: bool, cpu_offload: bool) -> nn.Module:
    """The model, FSDP2-sharded over the ranks, each rank reading its own rows (collective)."""
    from ..loading.foreign import load_transformers_sharded
    from ..loading.sharded import load_pretrained

    load = load_pretrained if inputs.impl == "shardcal" else load_transformers_sharded
    return load(model_dir, shard_root=shard_root, cpu_offload=cpu_offload)


def torch_peak_memory_mb() -> float:
    """This process's peak resident memory (MB), or the accelerator's peak allocation when on CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
