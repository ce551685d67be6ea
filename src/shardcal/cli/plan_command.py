"""``shardcal plan``: per-rank memory, traffic, disk and time of a calibration, before anything is loaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UsageError
from ..layerwise.options import DEFAULT_SQNR_TOKENS
from .commands import check_sqnr_tokens, command, model_impl_argument


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
        "--export-dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto", metavar="DTYPE",
        help="as calibrate: the dtype of the export's unquantized tensors, for its size; auto: the checkpoint's own "
        "(default %(default)s)",
    )  # fmt: skip
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
    model_impl_argument(parser)


def _plan_settings(args: argparse.Namespace, device: str) -> PlanSettings:  # noqa: F821
    from ..layerwise.options import CalibrationOptions
    from ..plan.planner import PlanSettings

    world = args.world_size or args.nproc_per_node or 1
    if args.world_size is not None:
        local = args.ranks_per_node or (min(world, 8) if device == "cuda" else world)
    else:
        local = args.ranks_per_node or world
    check_sqnr_tokens(args)
    options = CalibrationOptions(batch_size=args.batch_size, propagate=args.propagate, sqnr_tokens=args.sqnr_tokens)
    return PlanSettings(world_size=world, local_world_size=min(local, world), num_samples=args.num_samples,
                        seq_len=args.seq_len, device=device, cpu_offload=args.cpu_offload,
                        shard_root=not args.no_shard_root, options=options, export_dtype=args.export_dtype)  # fmt: skip


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
    streamed, why_not = _streamed_plan(source, recipe, settings, impl, args.model_dir)
    streamed_short = planning.shortfall(streamed, budget) if streamed is not None else None
    if args.json:
        out = plan.to_dict()
        out["budget"] = {"device_bytes": budget.device, "host_bytes": budget.host}
        out["fits"] = None if budget.device is None and budget.host is None else short is None
        out["fix"] = fix
        out["baseline_bytes"] = baseline
        out["streamed"] = streamed.to_dict() if streamed is not None else {"refused": why_not}
        if streamed is not None:
            out["streamed"]["fits"] = out["fits"] if out["fits"] is None else streamed_short is None
        print(json.dumps(out))
        return 0
    print(planning.format_plan(plan, baseline=baseline))
    if short is not None:
        print("does not fit: " + planning.refusal_message(plan, short, fix).removesuffix("; --force runs anyway"))
    elif budget.device is not None or budget.host is not None:
        known = [f"{planning.fmt_bytes(v)} {w}" for v, w in ((budget.device, budget.device_what),
                 (budget.host, f"host ({budget.host_what})")) if v is not None]  # fmt: skip
        print("fits: " + ", ".join(known))
    print(_streamed_line(streamed, why_not, streamed_short, short is not None))
    return 0


def _streamed_plan(source, recipe, settings, impl: str, model_dir: str):
    """The plan of the same run streamed (``--stream on``), or None and why it cannot stream."""
    import dataclasses

    import shardcal.plan.planner as planning

    from ..pipeline.streamed import streaming_refusal

    why_not = streaming_refusal(recipe, impl)
    if why_not is not None:
        return None, why_not
    return planning.plan_source(source, recipe, dataclasses.replace(settings, streamed=True), model_dir), None


def _streamed_line(streamed, why_not: str | None, short, resident_refused: bool) -> str:
    """One line on the streamed run: its peak, whether it fits, and what calibrate does with the two."""
    import shardcal.plan.planner as planning

    if streamed is None:
        return f"streamed (--stream on): cannot stream this run: {why_not}"
    worst = max(streamed.ranks, key=lambda r: r.peak)
    text = (
        f"streamed (--stream on): peak {planning.fmt_bytes(worst.peak)} per rank (rank {worst.rank}, while "
        f"{worst.peak_phase}), reads {planning.fmt_bytes(worst.bytes_read)}"
    )
    if short is not None:
        return (
            text
            + f"; does not fit either ({planning.fmt_bytes(short.need)} needed, {planning.fmt_bytes(short.available)} {short.where})"
        )
    return text + ("; calibrate streams by itself (--stream auto)" if resident_refused else "")


def size_after_imports() -> int | None:
    """This process's resident size (bytes) with what a calibrating rank imports loaded: the baseline ``plan`` adds
    to its predicted growth for the process peak (None where unknown)."""
    import shardcal.pipeline.calibrate  # noqa: F401  (what calibrate's ranks have imported at their baseline)

    from ..runtime.hostmem import rss_bytes

    return rss_bytes()
