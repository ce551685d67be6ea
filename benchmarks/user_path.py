"""The numbers a user gets: each recipe run as a user runs it, its export judged from disk against the source model.

    python benchmarks/user_path.py [--model smollm2|gemma3-270m] [--recipes fp8-dynamic ...] [--ranks 2]
                                   [--eval-samples 64] [--seq-len 256] [--work runs/user-path]
                                   [--no-save] [--results-dir DIR]

The source is the reference model as published: bfloat16, in files of at most 100 MB, as transformers saves it
(``save_pretrained``) — built once from the GGUF the embedded packages ship (the float32 import holds its values
exactly) and kept in ``--work``. Each recipe then runs through the command a user types, on ``--ranks`` ranks with the
default data (32 x 256 tokens of the Wikipedia summaries' calibration split):
``shardcal calibrate SOURCE --recipe R --out OUT --nproc-per-node 2``, and its export is evaluated from disk with
``shardcal eval OUT --kl`` on ``--eval-samples`` x ``--seq-len`` held-out tokens (the evaluation split; 64 x 256 gives
16,320 predictions): the mean KL divergence of every next-token distribution from the source model's, its standard
error over those tokens, the 99th percentile, top-1 agreement, and perplexity against the source's (with the standard
error of the mean negative log-likelihood: a perplexity is that many percent uncertain). The export is read by
transformers with compressed-tensors wherever transformers serves it (``shardcal.export.consumers``), else by
shardcal's own reload; the table says which.

Each run is a separate process, as a user's is; its wall time (the command's: checks, loading, calibration, export)
and calibration time come from the command's summary line. The tables ``user_path_<model>`` are what ``shardcal
recipes`` shows (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _results import ORDER, save_table  # this folder

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma-3-270M"}
#: The summary line of ``shardcal calibrate``: wall time, its phases, the mean layer SQNR.
SUMMARY = re.compile(
    r" in (?P<wall>[0-9.]+) s \(load (?P<load>[0-9.]+) s, calibration (?P<calibration>[0-9.]+) s, export "
    r"(?P<export>[0-9.]+) s\); mean layer SQNR (?P<sqnr>n/a|[0-9.-]+)"
)
#: What ``shardcal`` is run as: this interpreter's module, not whatever ``shardcal`` is on the PATH.
SHARDCAL = [sys.executable, "-m", "shardcal"]


def published_source(model: str, work: Path) -> Path:
    """The reference model as published: bfloat16 in files of at most 100 MB, written by transformers'
    ``save_pretrained`` from the float32 import of the embedded GGUF (made once, kept in ``work``)."""
    import torch
    from transformers import AutoModelForCausalLM

    target = work / f"{model}-bf16"
    if (target / "model.safetensors.index.json").is_file():
        return target
    if model == "smollm2":
        from shardcal.io.gguf import embedded_gguf_path, import_gguf_cached

        float32 = import_gguf_cached(embedded_gguf_path(), work / f"{model}-float32")
    else:
        from vs_peers import gemma3_dir  # this folder

        float32 = gemma3_dir()
    staging = work / f".{model}-bf16.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    AutoModelForCausalLM.from_pretrained(float32, dtype=torch.bfloat16).save_pretrained(staging, max_shard_size="100MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (float32 / name).is_file():
            shutil.copy(float32 / name, staging / name)
    staging.rename(target)
    return target


def _run(argv: list[str], log: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    log.write_text(f"$ {' '.join(argv)}\n{proc.stdout}\n--- stderr\n{proc.stderr[-20000:]}")
    return proc


def calibrate(source: Path, recipe: str, out: Path, ranks: int, log: Path) -> dict:
    """``shardcal calibrate`` as a user runs it; its summary's times and SQNR (or the error)."""
    start = time.perf_counter()
    proc = _run([*SHARDCAL, "calibrate", str(source), "--recipe", recipe, "--out", str(out), "--nproc-per-node",
                 str(ranks), "--overwrite"], log)  # fmt: skip
    process = time.perf_counter() - start
    found = SUMMARY.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        return {"error": (proc.stderr.strip().splitlines() or ["no summary"])[-1][:300]}
    return {"process": process, **{k: (None if v == "n/a" else float(v)) for k, v in found.groupdict().items()}}


def evaluate(out: Path, consumer: str, args: argparse.Namespace, log: Path) -> dict:
    """``shardcal eval OUT --kl`` with ``consumer``'s class (``transformers`` or ``shardcal``); its JSON."""
    argv = [*SHARDCAL, "eval", str(out), "--kl", "--json", "--num-samples", str(args.eval_samples), "--seq-len",
            str(args.seq_len), "--batch-size", str(args.eval_batch), "--baseline-cache", str(args.work / "cache"),
            "--model-impl", consumer]  # fmt: skip
    proc = _run(argv, log)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def consumer_of(recipe: str, model: str) -> str:
    """Who reads the export back: transformers with compressed-tensors where it serves it (and always for a model
    only transformers has a class for: shardcal applies the online rotations transformers ignores), else shardcal."""
    from shardcal.calib.recipes import load_recipe
    from shardcal.export.consumers import deployment

    if model != "smollm2" or deployment(load_recipe(recipe)).transformers.usable:
        return "transformers"
    return "shardcal"


def row(recipe: str, algorithm: str, run: dict, judged: dict, consumer: str) -> list:
    """One table row; a failed step leaves its cells empty and names itself in the notes."""
    if "error" in run or "error" in judged:
        what = "calibrate" if "error" in run else f"eval ({consumer})"
        note = f"{what} failed: {run.get('error') or judged.get('error')}"
        blank = [None] * 6
        return [recipe, algorithm, *blank, run.get("process"), run.get("wall"), run.get("calibration"), "", note]
    kl, source = judged["kl"], judged["source_perplexity"]
    ppl = judged["perplexity"]
    return [
        recipe, algorithm, round(kl["mean_kl"], 5), round(kl["kl_standard_error"], 5), round(kl["p99_kl"], 4),
        round(100 * kl["top1_agreement"], 2), round(ppl, 3), f"{ppl / source - 1:+.1%}", round(run["process"], 1),
        round(run["wall"], 1), round(run["calibration"], 1), consumer, f"±{100 * kl['nll_standard_error']:.1f}% ppl",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from _results import add_save_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODEL_NAMES), default="smollm2")
    parser.add_argument("--recipes", nargs="*", default=None, help="default: every shipped recipe")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-batch", type=int, default=None, help="default: 4 (SmolLM2), 2 (Gemma 3)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "user-path")
    add_save_options(parser)
    args = parser.parse_args(argv)
    from shardcal.calib.recipes import load_recipe, shipped_recipes

    args.eval_batch = args.eval_batch or (4 if args.model == "smollm2" else 2)
    args.work.mkdir(parents=True, exist_ok=True)
    recipes = args.recipes or list(shipped_recipes())
    source = published_source(args.model, args.work)
    title = MODEL_NAMES[args.model]
    print(f"{title}: source {source} (bf16, 100 MB files); {args.ranks} ranks; eval {args.eval_samples} x "
          f"{args.seq_len} held-out tokens", flush=True)  # fmt: skip
    rows, baseline = [], None
    for name in recipes:
        out = args.work / args.model / name
        start = time.perf_counter()
        run = calibrate(source, name, out, args.ranks, args.work / f"{args.model}-{name}-calibrate.log")
        consumer = consumer_of(name, args.model)
        judged = {} if "error" in run else evaluate(out, consumer, args, args.work / f"{args.model}-{name}-eval.log")
        if "error" in judged and consumer == "transformers" and args.model == "smollm2":
            consumer = "shardcal"
            judged = evaluate(out, consumer, args, args.work / f"{args.model}-{name}-eval.log")
        baseline = judged.get("source_perplexity", baseline)
        rows.append(row(name, str(load_recipe(name).algorithm.get("name", "rtn")), run, judged, consumer))
        print(f"  {name}: {rows[-1][2:]} ({time.perf_counter() - start:.0f} s)", flush=True)
        shutil.rmtree(out, ignore_errors=True)  # the exports of 22 recipes would fill a small disk
    columns = ["recipe", "algorithm", "mean KL", "KL se", "p99 KL", "top-1 %", "perplexity", "vs source",
               "process s", "wall s", "calibration s", "evaluated by", "notes"]  # fmt: skip
    notes = [
        f"Source: {title} as published, bfloat16 in files of at most 100 MB (transformers' save_pretrained of the "
        f"float32 import of the GGUF the embedded package ships); its perplexity on these tokens: "
        f"{baseline if baseline is None else round(baseline, 3)}.",
        f"Each recipe: `shardcal calibrate SOURCE --recipe R --out OUT --nproc-per-node {args.ranks}` with the default "
        "data (32 x 256 tokens of the Wikipedia summaries' calibration split), then `shardcal eval OUT --kl` on "
        f"{args.eval_samples} x {args.seq_len} held-out tokens of the evaluation split: the export read from disk by "
        "the consumer named (transformers with compressed-tensors wherever it serves the export; shardcal's reload "
        "where it does not).",
        "mean KL: the mean over every prediction of KL(source || export) of the next-token distributions, in nats; KL "
        "se: its standard error over those tokens (the run-to-run noise of this measurement: another draw of "
        "held-out tokens moves it by about that much); top-1 %: predictions whose most likely token is the source's; "
        "vs source: the export's perplexity against the source's on the same tokens, whose own uncertainty the notes "
        "give (the standard error of the mean negative log-likelihood).",
        "process s: the calibrate command as a process, timed from outside (the interpreter, imports and the ranks' "
        "start included); wall s: what its summary says (checks, loading, calibration, export); calibration s: its "
        "calibration phase. The ranks share this machine's cores. Times on a shared 2-core machine are noisy: compare "
        "within this table.",
    ]
    save_table(
        args, f"user_path_{args.model}", title=f"The numbers a user gets, {title}: bf16 source, the CLI on "
        f"{args.ranks} ranks, the export from disk", columns=columns, rows=rows, notes=notes,
        order=ORDER["quality"] - 10 + list(MODEL_NAMES).index(args.model),
        off_reference="--recipes leaves out shipped recipes" if args.recipes else None,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
