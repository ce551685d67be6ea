"""The numbers a user gets: each recipe run as a user runs it, its export judged from disk against the source model.

    python benchmarks/user_path.py [--model smollm2|gemma3-270m] [--recipes fp8-dynamic ...] [--ranks 2]
                                   [--eval-samples 64] [--seq-len 256] [--work runs/user-path] [--resume]
                                   [--speed-only] [--no-save] [--results-dir DIR]

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
recipes`` shows (docs/results.md). ``--resume`` keeps the rows the saved table holds when it was measured with the same
settings and runs the rest (with ``--recipes``: those of them it lacks); the table says which rows an earlier run
measured and how many of the shipped recipes it holds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _results import ORDER, RESULTS_DIR, save_table  # this folder

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


def calibrate(source: Path, recipe: str, out: Path, ranks: int, log: Path, extra: Sequence[str] = ()) -> dict:
    """``shardcal calibrate`` as a user runs it (``extra``: more flags, such as ``--data``); its summary's times and
    SQNR (or the error)."""
    start = time.perf_counter()
    proc = _run([*SHARDCAL, "calibrate", str(source), "--recipe", recipe, "--out", str(out), "--nproc-per-node",
                 str(ranks), "--overwrite", *extra], log)  # fmt: skip
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


#: The recommended recipes' schemes as llm-compressor documents them (benchmarks/peer_run.py's ``RECIPES``).
PEER_SCHEMES = {"fp8-dynamic": "fp8-dynamic", "w8a8-int8-dynamic-sq": "w8a8-int8-dynamic-sq",
                "w4a16-awq-gptq": "w4a16-gptq", "w4a16-gptq": "w4a16-gptq", "nvfp4-sq-gptq": "nvfp4"}  # fmt: skip


def llmcompressor_run(scheme: str, source: Path, args: argparse.Namespace) -> dict:
    """llm-compressor's documented recipe for ``scheme`` on the same model and calibration tokens (the command's default
    data), in the peers' venv (``make bench-peers``): its calibration time (its ``oneshot`` call) and its process's,
    timed from outside (the perplexity it also computes is on one block only, to keep that out of the comparison)."""
    from safetensors.torch import save_file

    from shardcal.data.token_data import token_blocks
    from shardcal.io.tokenizer import Tokenizer

    folder = args.work / "peers"
    folder.mkdir(exist_ok=True)
    tokenizer = Tokenizer.from_dir(source)
    save_file({"input_ids": token_blocks(tokenizer, 32, 256, split="calib")}, str(folder / "calib.safetensors"))
    save_file({"input_ids": token_blocks(tokenizer, 1, 256, split="eval")}, str(folder / "eval.safetensors"))
    out = folder / f"{args.model}-{scheme}.json"
    group = 64 if args.model == "smollm2" else 128  # SmolLM2's 576 is no multiple of 128 (as shardcal fits it)
    argv = [str(args.peers_python), str(Path(__file__).resolve().parent / "peer_run.py"), "--tool", "llmcompressor",
            "--scheme", scheme, "--model-dir", str(source), "--calib", str(folder / "calib.safetensors"), "--eval",
            str(folder / "eval.safetensors"), "--out", str(out), "--group-size", str(group), "--eval-batch", "1"]  # fmt: skip
    if scheme.startswith("w4a16-awq"):
        argv.append("--cpu-pin-patch")
    start = time.perf_counter()
    proc = _run(argv, args.work / f"{args.model}-llmcompressor-{scheme}.log")
    process = time.perf_counter() - start
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return {"process": process, "calibration": json.loads(out.read_text()).get("calib_seconds")}


def speed_rows(recipes: list[str], runs: dict[str, dict], source: Path, args: argparse.Namespace) -> list[list]:
    """Each recommended recipe's time beside llm-compressor's same scheme, measured in this run."""
    from shardcal.calib.recipes import load_recipe

    rows = []
    for name in recipes:
        if not load_recipe(name).recommended or name not in PEER_SCHEMES or "error" in runs[name]:
            continue
        theirs = llmcompressor_run(PEER_SCHEMES[name], source, args)
        ours = runs[name]
        ratio = None if "error" in theirs else round(ours["process"] / theirs["process"], 2)
        rows.append([name, round(ours["process"], 1), round(ours["calibration"], 1), PEER_SCHEMES[name],
                     theirs.get("process") and round(theirs["process"], 1),
                     theirs.get("calibration") and round(theirs["calibration"], 1), ratio, theirs.get("error", "")])  # fmt: skip
        print(f"  vs llm-compressor {PEER_SCHEMES[name]}: {rows[-1][1:]}", flush=True)
    return rows


QUALITY_COLUMNS = ["recipe", "algorithm", "mean KL", "KL se", "p99 KL", "top-1 %", "perplexity", "vs source",
                   "process s", "wall s", "calibration s", "evaluated by", "notes"]  # fmt: skip


def quality_notes(args: argparse.Namespace, title: str, baseline: float | None) -> list[str]:
    """What the quality table's numbers are (also what ``--resume`` compares: the same settings write the same
    notes)."""
    return [
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


def resumed_rows(args: argparse.Namespace, title: str) -> tuple[list[list], float | None, str]:
    """``--resume``: the rows of the saved quality table, when it was measured with these settings (same columns and
    notes), its source perplexity, and its date; else nothing."""
    path = (args.results_dir or RESULTS_DIR) / f"user_path_{args.model}.json"
    if not path.is_file():
        return [], None, ""
    saved = json.loads(path.read_text(encoding="utf-8"))
    match = re.search(r"its perplexity on these tokens: ([0-9.]+)\.", " ".join(saved["notes"]))
    baseline = float(match.group(1)) if match else None
    settings = [n for n in saved["notes"] if not n.startswith(("This run was stopped", "This table holds", "Resumed:"))]
    if saved["columns"] != QUALITY_COLUMNS or settings != quality_notes(args, title, baseline):
        print(f"--resume: {path} was measured with other settings; every recipe runs again")
        return [], None, ""
    return list(saved["rows"]), baseline, saved["date"]


def save_quality(
    args: argparse.Namespace, title: str, rows: list[list], baseline: float | None, resumed: str = ""
) -> None:
    """The quality table of this run so far (written after each recipe, so that a run stopped early leaves what it
    measured, saying how many of the shipped recipes it holds; ``resumed``: the note on rows an earlier run
    measured)."""
    columns = QUALITY_COLUMNS
    notes = quality_notes(args, title, baseline)
    if resumed:
        notes.insert(0, resumed)
    from shardcal.calib.recipes import shipped_recipes

    missing = len(shipped_recipes()) - len(rows)
    if missing:
        notes.insert(0, f"This table holds {len(rows)} of the {len(shipped_recipes())} shipped recipes (the run was "
                        f"stopped, or given --recipes): the other {missing} are not measured here.")  # fmt: skip
    save_table(
        args, f"user_path_{args.model}", title=f"The numbers a user gets, {title}: bf16 source, the CLI on "
        f"{args.ranks} ranks, the export from disk", columns=columns, rows=sorted(rows), notes=notes,
        order=ORDER["quality"] - 10 + list(MODEL_NAMES).index(args.model),
        off_reference="--recipes leaves out shipped recipes" if args.recipes and not args.resume else None,
    )  # fmt: skip


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
    parser.add_argument(
        "--peers-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python",
        help="the peers' venv (make bench-peers): each recommended recipe's time beside llm-compressor's (skipped "
        "without it)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the recipes the saved quality table already holds (measured with the same settings) and run the "
        "others; the table says which rows an earlier run measured",
    )  # fmt: skip
    parser.add_argument(
        "--speed-only", action="store_true",
        help="only the recommended recipes' times beside llm-compressor's (no evaluation; the quality table is not "
        "written)",
    )  # fmt: skip
    add_save_options(parser)
    args = parser.parse_args(argv)
    from shardcal.calib.recipes import load_recipe, shipped_recipes

    args.eval_batch = args.eval_batch or (4 if args.model == "smollm2" else 2)
    args.work.mkdir(parents=True, exist_ok=True)
    recipes = args.recipes or list(shipped_recipes())
    recipes = sorted(recipes, key=lambda n: not load_recipe(n).recommended)  # the recommended ones first
    if args.speed_only:
        recipes = [n for n in recipes if load_recipe(n).recommended]
    source = published_source(args.model, args.work)
    title = MODEL_NAMES[args.model]
    print(f"{title}: source {source} (bf16, 100 MB files); {args.ranks} ranks; eval {args.eval_samples} x "
          f"{args.seq_len} held-out tokens", flush=True)  # fmt: skip
    rows, baseline, runs, resumed = [], None, {}, ""
    if args.resume and not args.speed_only:
        rows, baseline, date = resumed_rows(args, title)
        if rows:
            resumed = (f"Resumed: {', '.join(r[0] for r in rows)} were measured on {date} by an earlier run of this "
                       "benchmark with the same settings, the others by this run.")  # fmt: skip
            print(f"--resume: {len(rows)} recipes kept from {date}", flush=True)
    for name in recipes:
        if any(r[0] == name for r in rows):
            continue
        out = args.work / args.model / name
        start = time.perf_counter()
        run = runs[name] = calibrate(source, name, out, args.ranks, args.work / f"{args.model}-{name}-calibrate.log")
        if args.speed_only:
            shutil.rmtree(out, ignore_errors=True)
            continue
        consumer = consumer_of(name, args.model)
        judged = {} if "error" in run else evaluate(out, consumer, args, args.work / f"{args.model}-{name}-eval.log")
        if "error" in judged and consumer == "transformers" and args.model == "smollm2":
            consumer = "shardcal"
            judged = evaluate(out, consumer, args, args.work / f"{args.model}-{name}-eval.log")
        baseline = judged.get("source_perplexity", baseline)
        rows.append(row(name, str(load_recipe(name).algorithm.get("name", "rtn")), run, judged, consumer))
        print(f"  {name}: {rows[-1][2:]} ({time.perf_counter() - start:.0f} s)", flush=True)
        shutil.rmtree(out, ignore_errors=True)  # the exports of 22 recipes would fill a small disk
        save_quality(args, title, rows, baseline, resumed=resumed)
    if not args.peers_python.is_file():
        print(f"llm-compressor's times skipped: {args.peers_python} is missing (make bench-peers creates it)")
        return 0
    save_table(
        args, f"user_path_speed_{args.model}", title=f"Time of each recommended recipe beside llm-compressor's same "
        f"scheme, {title}: the same bf16 source and calibration tokens, one run",
        columns=["recipe", "shardcal process s", "shardcal calibration s", "llm-compressor scheme",
                 "llm-compressor process s", "llm-compressor calibration s", "process ratio", "notes"],
        rows=speed_rows(recipes, runs, source, args), order=ORDER["speed"] - 10 + list(MODEL_NAMES).index(args.model),
        notes=[
            f"shardcal: `shardcal calibrate SOURCE --recipe R --nproc-per-node {args.ranks}`, each recommended recipe "
            "run by this benchmark, then llm-compressor's (with --speed-only, not the quality table's runs); process s "
            "includes loading, the export and the ranks' start; calibration s is the summary's phase, which for a "
            "data-free recipe is the SQNR report's forward on 1024 tokens.",
            "llm-compressor: its documented recipe for the scheme (benchmarks/peer_run.py RECIPES: FP8_DYNAMIC; "
            "SmoothQuant 0.8 + GPTQ W8A8; GPTQ W4A16; NVFP4), one process on the same source and the same 32 x 256 "
            "calibration tokens; calibration s is its oneshot call; its process also loads the model in float32 "
            "and scores one held-out block (no export is written).",
        ],
        off_reference="--recipes leaves out recommended recipes" if args.recipes else None,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
