"""How many tokens the per-layer SQNR needs: the SQNR on the first sequences against the SQNR on all of them.

    python benchmarks/sqnr_sample.py [--samples 32] [--seq-len 256] [--recipes w8a8-int8 w4a16 ...]

SmolLM2-135M (the embedded model), one process. Each recipe is calibrated once per sample size with the SQNR
measured on the first 2, 4 and 8 sequences and on all ``--samples`` of them (``sqnr_tokens``; the statistics
themselves do not depend on it); printed: per sample size, the largest and the mean difference over the layers
from the SQNR on all sequences, in dB.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--recipes", nargs="+", default=["w8a8-int8", "w4a16"])
    args = parser.parse_args()

    from shardcal import calibrate, load_recipe
    from shardcal.data.calibration import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer
    from shardcal.models import from_pretrained

    model_dir = embedded_model_dir()
    data = token_blocks(Tokenizer.from_dir(model_dir), args.samples, args.seq_len, split="calib")
    sizes = [n for n in (2, 4, 8) if n < args.samples] + [args.samples]
    print(f"SmolLM2-135M, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}: per-layer SQNR on the first")
    print("n sequences against all of them (dB)")
    print("| recipe | sequences (tokens) | max difference | mean difference |\n|---|---:|---:|---:|")
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
            print(f"| {name} | {n} ({n * args.seq_len}) | {max(diff):.2f} | {sum(diff) / len(diff):.2f} |", flush=True)


if __name__ == "__main__":
    main()
