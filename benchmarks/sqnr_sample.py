"""How many tokens the per-layer SQNR needs: the SQNR on the first sequences against the SQNR on all of them.

    python benchmarks/sqnr_sample.py [--samples 32] [--seq-len 256] [--recipes w8a8-int8 w4a16 ...]
                                     [--no-save] [--results-dir DIR]

SmolLM2-135M (the embedded model), one process. Each recipe is calibrated once per sample size with the SQNR
measured on the first 2, 4 and 8 sequences and on all ``--samples`` of them (``sqnr_tokens``; the statistics
themselves do not depend on it); printed: per sample size, the largest and the mean difference over the layers
from the SQNR on all sequences, in dB. The table goes to ``docs/results/sqnr_sample_smollm2.json``
(benchmarks/_results.py); a run that leaves out a default recipe writes only with ``--results-dir DIR``.
"""

from __future__ import annotations

import argparse

from _results import ORDER, add_save_options, save_table  # this folder

DEFAULT_RECIPES = ["w8a8-int8", "w4a16"]


def sample_table(diffs: list[tuple[str, int, list[float]]], *, samples: int, seq_len: int, batch_size: int) -> dict:
    """The table of a run (``write_table``'s keywords): ``diffs`` are ``(recipe, sequences, |SQNR on the first
    sequences - SQNR on all| per layer in dB)``."""
    return {
        "title": "Per-layer SQNR on the first sequences against all of them, SmolLM2-135M",
        "columns": ["recipe", "sequences", "tokens", "sample / all tokens", "max difference dB", "mean difference dB"],
        "rows": [
            [name, n, n * seq_len, round(n / samples, 3), round(max(d), 2), round(sum(d) / len(d), 2)]
            for name, n, d in diffs
        ],
        "notes": [
            f"Each recipe calibrated once per sample size on {samples} x {seq_len} tokens (batch {batch_size}), "
            "the layer output SQNR measured on the first n sequences (sqnr_tokens = n x the sequence length) and "
            "on all of them; the statistics, and so the calibrated model, do not depend on it. The differences "
            "are |SQNR on the first n - SQNR on all| over the decoder layers.",
            "What it decides: calibration measures each layer's SQNR in a second, quantized pass over a sample of "
            "the data (sqnr_tokens, whole sequences from the start), so that the sample's size and not the batch "
            "size sets that pass's cost.",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES)
    add_save_options(parser)
    args = parser.parse_args(argv)

    from shardcal import calibrate, load_recipe
    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer
    from shardcal.models import from_pretrained

    model_dir = embedded_model_dir()
    data = token_blocks(Tokenizer.from_dir(model_dir), args.samples, args.seq_len, split="calib")
    sizes = [n for n in (2, 4, 8) if n < args.samples] + [args.samples]
    print(f"SmolLM2-135M, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}: per-layer SQNR on the first")
    print("n sequences against all of them (dB)")
    print("| recipe | sequences (tokens) | max difference | mean difference |\n|---|---:|---:|---:|")
    diffs = []
    for name in args.recipes:
        sqnr = {}
        for n in sizes:
            report = calibrate(
                from_pretrained(model_dir),
                data,
                load_recipe(name),
                batch_size=args.batch_size,
                sqnr_tokens=n * args.seq_len,
                progress=False,
            )
            sqnr[n] = [entry.sqnr_db for entry in report.layers]
        full = sqnr[args.samples]
        for n in sizes[:-1]:
            diff = [abs(a - b) for a, b in zip(sqnr[n], full)]
            diffs.append((name, n, diff))
            print(f"| {name} | {n} ({n * args.seq_len}) | {max(diff):.2f} | {sum(diff) / len(diff):.2f} |", flush=True)
    left_out = [r for r in DEFAULT_RECIPES if r not in args.recipes]
    save_table(
        args,
        "sqnr_sample_smollm2",
        off_reference=f"--recipes leaves out {', '.join(left_out)}" if left_out else None,
        order=ORDER["quality"] + 20,
        **sample_table(diffs, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size),
    )


if __name__ == "__main__":
    main()
