"""``shardcal collect``: its flags, the checks before loading, the collection options, and one rank's job."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CollectionError
from .commands import cli_warnings, command, data_arguments, data_options, load_data, model_impl_argument, run_ranks

if TYPE_CHECKING:
    from ..collect.options import CollectionOptions


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
    model_impl_argument(parser)


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
    from ..pipeline.inputs import check_data_tokenizer, protected_inputs
    from ..plan.preflight import check_targets_fit, meta_skeleton
    from ..runtime.fsutil import check_apart, check_creatable

    model_dir, out_dir = Path(args.model_dir), Path(args.out)
    patterns = parse_targets(args.targets)
    collection_options(args)  # the library's checks of --stats, --bins, --top-k, --batch-size, --save-dtype
    protected = protected_inputs(model_dir, args.data, data_options(args))
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
    check_data_tokenizer(model_dir, args.data, data_options(args))
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
    from ..data.sources import data_shape
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
    shape = data_shape(ids)
    report = collect_activations(model, ids, args.targets, collection_options(args, progress=rank == 0))
    seconds = time.perf_counter() - start
    if rank == 0:
        report.save(out_dir)
        plot = report.save_plot(out_dir / "activations.png")
        top = max(report.targets.values(), key=lambda t: t.hist_range)
        channel = f" (channel {top.top_channels[0][0]})" if top.top_channels else ""
        print(
            f"collected {len(report.targets)} targets in {len({t.layer for t in report.targets.values()})} layers on "
            f"{shape[0]} x {shape[1]} tokens of {source} over {world} rank(s) in {seconds:.1f} s; largest "
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
