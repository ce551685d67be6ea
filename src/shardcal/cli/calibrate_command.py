"""``shardcal calibrate``: its flags, the request they make of :func:`shardcal.pipeline.calibrate_to_checkpoint`,
one rank's job, and the lines it prints."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import interrupted_as
from ..layerwise.options import DEFAULT_SQNR_TOKENS, CalibrationOptions
from .commands import (
    CLI_INPUT_NAMES,
    check_sqnr_tokens,
    cli_warnings,
    command,
    data_arguments,
    data_options,
    model_impl_argument,
    run_ranks,
)

if TYPE_CHECKING:
    from ..data.sources import DataOptions
    from ..pipeline.calibrate import PipelineResult
    from ..pipeline.inputs import CalibrationInputs


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (config.json + safetensors)"
    )
    parser.add_argument(
        "--recipe",
        required=True,
        metavar="NAME|FILE",
        help="a shipped recipe name or a .toml file; `shardcal recipes` helps choose (recommended: fp8-dynamic, "
        "w8a8-int8-dynamic-sq, w4a16-awq-gptq, nvfp4-sq-gptq, fp8-block, w8a16, w4afp8-gptq, nvfp4a16-gptq, "
        "mxfp4-gptq, mxfp4a16-gptq, mxfp8)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="OUT_DIR",
        help="where the compressed-tensors checkpoint goes (must not exist or be empty)",
    )
    data_arguments(parser, num_samples=32, seq_len=None, batch_size=8)
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N local processes (ranks) yourself; under torchrun leave it out",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="commit progress after each layer here; a rerun resumes; removed after a successful export",
    )
    parser.add_argument(
        "--keep-checkpoint", action="store_true", help="keep --checkpoint-dir after a successful export"
    )
    parser.add_argument(
        "--propagate",
        choices=["fp", "qdq"],
        default=None,
        help="inputs of layer i+1: full-precision or quantized outputs of layer i (default: the recipe's algorithm's choice, else fp)",
    )
    parser.add_argument(
        "--sqnr-tokens",
        type=int,
        default=DEFAULT_SQNR_TOKENS,
        metavar="N",
        help="measure each layer's output SQNR on the first sequences holding N real tokens (0: none; default "
        "%(default)s)",
    )
    parser.add_argument(
        "--no-shard-root", action="store_true", help="keep embeddings / final norm / lm_head replicated"
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="keep parameter shards in host memory (FSDP2 CPUOffloadPolicy)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier shardcal export, none of its files edited since (a directory "
        "holding any other file, or an edited export, is never replaced)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="run even when the plan predicts more memory than is free (see shardcal plan)",
    )
    parser.add_argument(
        "--format",
        default="compressed-tensors",
        metavar="FORMAT",
        help="checkpoint format of the export: compressed-tensors, the one there is (default %(default)s)",
    )
    parser.add_argument(
        "--export-dtype",
        default="auto",
        metavar="DTYPE",
        help="dtype of the export's unquantized tensors (embeddings, norms, LM head): bfloat16, float16, float32, or "
        "auto: the checkpoint's own (default %(default)s)",
    )
    parser.add_argument(
        "--stream", choices=["auto", "on", "off"], default="auto",
        help="keep the decoder layers on disk until their step and export each at the end of it, so that a rank holds "
        "one layer at a time: auto streams when the resident run would not fit in memory (a warning says so), on "
        "always, off never (default %(default)s)",
    )  # fmt: skip
    model_impl_argument(parser)


@command(
    "calibrate",
    help="calibrate a model layer by layer (sharded over ranks) and export it as compressed-tensors",
    arguments=_calibrate_arguments,
)
def _calibrate(args: argparse.Namespace) -> int:
    with interrupted_as(f"interrupted before calibrating {args.model_dir}: nothing was written"):
        request = calibrate_request(args)
        return run_ranks(args, lambda _: check_request(request), calibrate_job, request)


@dataclass(frozen=True, kw_only=True)
class CalibrateRequest:
    """The arguments of :func:`shardcal.pipeline.calibrate_to_checkpoint` that ``shardcal calibrate``'s flags ask for
    (what ``--nproc-per-node`` hands each rank)."""

    model_dir: str
    out_dir: str
    recipe: str
    data: list[str] | None
    num_samples: int
    seq_len: int | None
    options: CalibrationOptions
    keep_checkpoint: bool
    overwrite: bool
    model_impl: str
    force: bool
    shard_root: bool
    cpu_offload: bool
    format: str
    export_dtype: str
    stream: str = "auto"
    data_options: DataOptions | None = None
    input_names: Mapping[str, str] = field(default_factory=lambda: dict(CLI_INPUT_NAMES))

    def arguments(self) -> dict[str, Any]:
        """The request as ``calibrate_to_checkpoint``'s keyword arguments (the options object as it is)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def calibrate_request(args: argparse.Namespace) -> CalibrateRequest:
    """The request for the parsed ``calibrate`` flags, with the
    :class:`~shardcal.layerwise.options.CalibrationOptions` built once, here."""
    check_sqnr_tokens(args)
    options = CalibrationOptions(propagate=args.propagate, batch_size=args.batch_size, sqnr_tokens=args.sqnr_tokens,
                                 checkpoint_dir=args.checkpoint_dir)  # fmt: skip
    return CalibrateRequest(
        model_dir=args.model_dir, out_dir=args.out, recipe=args.recipe, data=args.data, num_samples=args.num_samples,
        seq_len=args.seq_len, options=options, keep_checkpoint=args.keep_checkpoint, overwrite=args.overwrite,
        model_impl=args.model_impl, force=args.force, shard_root=not args.no_shard_root, cpu_offload=args.cpu_offload,
        format=args.format, export_dtype=args.export_dtype, stream=args.stream, data_options=data_options(args),
    )  # fmt: skip


def check_request(request: CalibrateRequest) -> CalibrationInputs:
    """The checks before loading (:func:`shardcal.pipeline.inputs.check_calibration_inputs`) of a
    :class:`CalibrateRequest`: what ``--nproc-per-node`` runs here before any rank starts."""
    from ..pipeline.inputs import check_calibration_inputs

    return check_calibration_inputs(
        request.model_dir, request.out_dir, request.recipe, data=request.data,
        checkpoint_dir=request.options.checkpoint_dir, overwrite=request.overwrite, model_impl=request.model_impl,
        format=request.format, export_dtype=request.export_dtype, input_names=request.input_names,
        data_options=request.data_options,
    )  # fmt: skip


def calibrate_job(request: CalibrateRequest) -> PipelineResult:
    """One rank's part of ``shardcal calibrate`` (also what ``--nproc-per-node`` runs in each process): the pipeline
    (:func:`shardcal.pipeline.calibrate_to_checkpoint`) on the :func:`calibrate_request`, then rank 0 prints."""
    from ..pipeline.calibrate import calibrate_to_checkpoint
    from ..runtime.distributed import init_distributed
    from ..runtime.hostmem import pin_mmap_threshold

    rank, _ = init_distributed()
    cli_warnings(rank)
    pin_mmap_threshold()  # freed activations go back to the OS (see shardcal.runtime.hostmem)
    result = calibrate_to_checkpoint(**request.arguments())
    if rank == 0:
        print("\n".join(calibrate_summary(result)))
    return result


def calibrate_summary(result: PipelineResult) -> list[str]:
    """The lines ``shardcal calibrate`` prints (rank 0) for a finished :class:`~shardcal.pipeline.PipelineResult`."""
    report, (rows, length) = result.report, result.data_shape
    sqnr = report.mean_sqnr_db
    data = f"on {rows} x {length} tokens of {result.data_source}"
    if report.data_free:  # nothing observed the data: only the SQNR sample ran through the layers, or nothing
        sample = f"the SQNR sample of {report.layer_tokens} tokens" if report.layer_tokens else "no SQNR sample"
        data = f"without data ({result.recipe.name} reads no activation statistics; {sample})"
    lines = [
        f"calibrated {len(report.layers)} layers {data} "
        f"with {result.recipe.name} over {result.world_size} rank(s){' streamed from disk' if result.streamed else ''} "
        f"in {time_summary(result)}; mean layer SQNR {'n/a' if sqnr is None else f'{sqnr:.1f} dB'}",
        memory_summary(result),
    ]
    if (moe_line := report.moe_summary()) is not None:
        lines.append(moe_line)
    lines.append(f"exported -> {result.out_dir}" + (f" (plot: {result.plot.name})" if result.plot else ""))
    if result.checkpoint_removed_bytes:
        where = result.checkpoint_dir
        what = (  # a directory that also holds files shardcal did not write keeps them, and stays
            f"the calibration checkpoint's files from {where}, which keeps the other files it holds"
            if Path(where).exists()
            else f"the calibration checkpoint {where}"
        )
        lines.append(f"removed {what} ({result.checkpoint_removed_bytes / 1e6:.1f} MB; --keep-checkpoint keeps it)")
    return lines


def time_summary(result: PipelineResult) -> str:
    """``147.2 s (load 40.1 s, calibration 52.0 s, export 50.2 s)``: the whole command's wall time on rank 0 (checks,
    data and plot included), and its three phases."""
    phases = result.phases
    if phases is None or result.wall_seconds is None:
        return f"{result.seconds:.1f} s"
    return (
        f"{result.wall_seconds:.1f} s (load {phases.load:.1f} s, calibration {phases.calibration:.1f} s, "
        f"export {phases.export:.1f} s)"
    )


def _mib_list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values) + " MiB"


def memory_summary(result: PipelineResult) -> str:
    """``peak memory per rank: growth X MiB (planned Z MiB), process peak W MiB``: the measured growth over the
    baseline taken after imports (what ``shardcal plan`` predicts), the plan's figure, and the process's peak."""
    growth, peak = result.memory_growth_mib, result.process_peak_mib
    if growth is None or peak is None:
        return f"peak memory per rank: process peak {_mib_list(result.peak_memory_mb)}"
    planned = "not planned" if result.planned_growth_mib is None else f"planned {_mib_list(result.planned_growth_mib)}"
    return f"peak memory per rank: growth {_mib_list(growth)} ({planned}), process peak {_mib_list(peak)}"
