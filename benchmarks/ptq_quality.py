"""PTQ quality per recipe on a reference model: perplexity and calibration time, measured in one run.

    python benchmarks/ptq_quality.py [--model smollm2|gemma3-270m] [--samples 32] [--seq-len 256]
                                     [--eval-samples 8] [--eval-seed 0]
                                     [--recipes fp8 w4a16-gptq ... | path/to/recipe.toml ...]
                                     [--no-save] [--results-dir DIR]

``--model``: the embedded SmolLM2-135M (default), or Gemma-3-270M (see vs_peers.py; transformers' class).
Every shipped recipe by default. The table is written to ``docs/results/ptq_quality_<model>.json`` (what
``shardcal recipes`` shows and ``tools/results_page.py`` renders) unless ``--no-save``; a run whose ``--recipes``
leave out a shipped recipe (or name a file) writes only with ``--results-dir DIR``.

Calibration data: ``--samples`` blocks of ``--seq-len`` tokens from the Wikipedia summaries' "calib" split;
perplexity on ``--eval-samples`` held-out blocks of the "eval" split (its articles shuffled with ``--eval-seed``;
another seed draws the blocks from another order of articles). One process, a fresh model per recipe,
``calibrate`` with the recipe's default propagation (``qdq`` for GPTQ, else ``fp``). Prints one table: perplexity,
its ratio to FP32, calibration seconds.

Recipes run as shipped. SmolLM2-135M's hidden size (576) is not a multiple of 128: the W4A16 recipes (groups of
128) fit groups of 64 on the 576-wide Linears and keep 128 on down_proj (1536 wide); the notes column counts the
Linears that fell back (see docs/reference/quant-recipes.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from _results import ORDER, add_save_options, save_table  # this folder

MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma-3-270M"}


def quality_table(rows: list[tuple], *, model: str, args: argparse.Namespace) -> dict:
    """The table of a run (``write_table``'s keywords): ``rows`` are ``(recipe, algorithm, perplexity, calibration
    seconds or None, notes)``, FP32's first. ``shardcal recipes`` reads these columns by name."""
    fp32 = rows[0][2]
    return {
        "title": f"PTQ quality per recipe, {model}",
        "columns": ["recipe", "algorithm", "perplexity", "vs FP32", "calibration s", "notes"],
        "rows": [
            [n, a, round(p, 3), None if n == "FP32" else f"{p / fp32 - 1:+.1%}", s and round(s, 1), note]
            for n, a, p, s, note in rows
        ],
        "notes": [
            f"Calibration: {args.samples} x {args.seq_len} tokens of the Wikipedia summaries' calib split, "
            f"batch {args.batch_size}; perplexity on {args.eval_samples} x {args.seq_len} held-out tokens "
            f"(eval split, seed {args.eval_seed}). One process, a fresh model per recipe, each recipe's default "
            "propagation; fake-quant perplexity of the calibrated model, exp(mean cross-entropy) of every "
            "next-token prediction, float32.",
            "Recipes as shipped: where a recipe's group size does not divide a Linear's inputs the runner fits a "
            "smaller one, and the notes column counts those Linears (SmolLM2's hidden size 576 is no multiple of "
            "128: its W4A16 recipes use groups of 64 there and 128 on down_proj). The notes column also names the "
            "propagation: the next layer's inputs are this layer's full-precision outputs (fp) or its outputs with "
            "its quantizers on (qdq).",
            "Calibration seconds are wall time on the machine named above, shared with other jobs: compare them "
            "with each other, within this table. Perplexities depend on the CPU's kernels as well as on the code "
            "(AVX-512 and AVX2 kernels round differently); compare rows measured on one machine.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", choices=list(MODEL_NAMES), default="smollm2")
    parser.add_argument("--recipes", nargs="*", default=None, help="default: every shipped recipe")
    add_save_options(parser)
    args = parser.parse_args(argv)
    from vs_peers import gemma3_dir, load_model

    from shardcal import calibrate, load_recipe
    from shardcal.calib.recipes import shipped_recipes
    from shardcal.data.perplexity import perplexity
    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer

    recipes = args.recipes or list(shipped_recipes())
    model_dir = embedded_model_dir() if args.model == "smollm2" else gemma3_dir()
    eval_batch = 8 if args.model == "smollm2" else 2
    tokenizer = Tokenizer.from_dir(model_dir)
    calib = token_blocks(tokenizer, args.samples, args.seq_len, split="calib")
    held_out = token_blocks(tokenizer, args.eval_samples, args.seq_len, split="eval", seed=args.eval_seed)
    title = MODEL_NAMES[args.model]
    print(
        f"{title}, calibration {args.samples} x {args.seq_len} tokens, eval {args.eval_samples} x {args.seq_len}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )

    rows = []
    model = load_model(model_dir)
    fp32 = perplexity(model, held_out, batch_size=eval_batch)
    rows.append(("FP32", "", fp32, None, ""))
    print(f"  FP32: perplexity {fp32:.3f}", flush=True)
    for name in recipes:
        model = load_model(model_dir)
        recipe = load_recipe(name)
        start = time.perf_counter()
        report = calibrate(model, calib, recipe, batch_size=args.batch_size, progress=False)
        seconds = time.perf_counter() - start
        ppl = perplexity(model, held_out, batch_size=eval_batch)
        fitted = report.group_sizes
        note = f"{len(fitted)} Linears g{'/'.join(sorted({str(v) for v in fitted.values()}))}" if fitted else ""
        rows.append((name, recipe.algorithm["name"], ppl, seconds, f"{report.propagate}{', ' + note if note else ''}"))
        print(f"  {name}: perplexity {ppl:.3f}, calibration {seconds:.1f} s", flush=True)

    print()
    print(
        f"| {'recipe':<18} | {'algorithm':<11} | {'perplexity':>10} | {'x FP32':>6} | {'calib s':>7} | {'notes':<12} |"
    )
    print(f"|{'-' * 20}|{'-' * 13}|{'-' * 11}:|{'-' * 7}:|{'-' * 8}:|{'-' * 14}|")
    for name, algorithm, ppl, seconds, note in rows:
        secs = "" if seconds is None else f"{seconds:.1f}"
        print(f"| {name:<18} | {algorithm:<11} | {ppl:>10.3f} | {ppl / fp32:>6.3f} | {secs:>7} | {note:<12} |")
    left_out = sorted(set(shipped_recipes()) - set(recipes))
    files = [str(r) for r in recipes if str(r).endswith(".toml")]
    why = f"--recipes names a file ({files[0]})" if files else f"--recipes leaves out {', '.join(left_out)}"
    save_table(
        args,
        f"ptq_quality_{args.model}",
        off_reference=why if files or left_out else None,
        order=ORDER["quality"] + list(MODEL_NAMES).index(args.model),
        **quality_table(rows, model=title, args=args),
    )
    w8 = [(p, n) for n, a, p, s, _ in rows if n.startswith("w8a8")]
    w4 = [(p, n) for n, a, p, s, _ in rows if n.startswith("w4a16")]
    if w8:
        print(f"best W8A8 int8: {min(w8)[1]} ({min(w8)[0]:.3f})")
    if w4:
        print(f"best W4A16: {min(w4)[1]} ({min(w4)[0]:.3f})")
    return 0 if all(math.isfinite(r[2]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
