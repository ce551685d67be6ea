"""Scaling evidence: the same calibration at N = 1, 2 and 4 ranks on this machine (gloo, CPU).

    python benchmarks/scaling.py [--ranks 1 2 4] [--skip-wide] [--json FILE] [--no-save] [--results-dir DIR]

For SmolLM2-135M (float32, w8a8-int8, 32 x 256 tokens, batch 8) and a model with Llama-3-8B's widths and 2 decoder
layers (bfloat16, random weights written here, fp8, 16 x 256 tokens, batch 4), each rank runs the real pipeline
(``load_pretrained`` -> ``calibrate`` -> ``export_checkpoint``; see ``plan_accuracy.py`` for how memory is measured)
and the table shows, per N: the largest peak resident-memory growth of any rank (measured, and the planner's
prediction), the bytes each rank read from the checkpoint (measured by the loader), the bytes one layer's all-gather
moves (the planner's count of what FSDP2 gathers: the whole layer, of which each rank sends (N - 1) / N), and the
wall time of the pipeline and of ``calibrate()``.

This machine has 2 cores: at N = 4 the ranks oversubscribe them and the times say little; the memory column is the
point (each rank holds 1/N of the model, plus one gathered unit, plus its share of the activations).

The table goes to ``docs/results/scaling.json`` (benchmarks/_results.py); a run that leaves out a model or a
default rank count (``--skip-wide``, ``--ranks``) writes only with ``--results-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from _results import ORDER, add_save_options, save_table  # this folder
from plan_accuracy import LLAMA3_8B_WIDTHS, _smollm2_data, measure, predict, wide_checkpoint

MiB = 2**20
DEFAULT_RANKS = [1, 2, 4]


def scaling_table(rows: list[dict]) -> dict:
    """The table of a run (``write_table``'s keywords) from the measured rows (one per model and N); the ratio
    columns compare each N with the same model's smallest N of the run."""
    first = {}
    for row in rows:
        first.setdefault(row["model"], row)
    table = [
        [row["model"], row["ranks"], round(row["peak_measured"] / MiB), round(row["peak_predicted"] / MiB),
         round(row["peak_measured"] / row["peak_predicted"], 3),
         round(row["peak_measured"] / first[row["model"]]["peak_measured"], 2),
         round(row["bytes_read_per_rank"] / MiB), round(row["bytes_read_per_rank"] / first[row["model"]]["bytes_read_per_rank"], 2),
         round(row["allgather_bytes_per_layer"] / MiB, 1), round(row["allgather_sent_per_layer_per_rank"] / MiB, 1),
         round(row["calibrate_seconds"], 1), round(row["wall_seconds"], 1)]
        for row in rows
    ]  # fmt: skip
    return {
        "title": "Scaling: the same calibration at N ranks, memory and time per rank",
        "columns": [
            "model",
            "ranks",
            "peak / rank MB",
            "predicted MB",
            "measured / predicted",
            "peak vs fewest ranks",
            "read / rank MB",
            "read vs fewest ranks",
            "all-gather / layer MB",
            "sent / rank / layer MB",
            "calibrate s",
            "pipeline wall s",
        ],
        "rows": table,
        "notes": [
            "Each rank runs the real pipeline (load_pretrained -> calibrate -> export_checkpoint; gloo, CPU), its "
            "peak resident-memory growth measured as in plan_accuracy.py (VmHWM per phase); the largest of any "
            "rank, next to the planner's prediction. Bytes read per rank: measured by the loader. The all-gather "
            "columns are the planner's count of what FSDP2 gathers for one layer (the whole layer, of which each "
            "rank sends (N - 1) / N). Times: the slowest rank's calibrate() and whole pipeline.",
            "The ratio columns compare each N with the same model's smallest N in this run: each rank holds 1/N "
            "of the model, plus one gathered layer, plus its share of the activations. With more ranks than "
            "cores the ranks oversubscribe them and the times say little; memory is the point.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=DEFAULT_RANKS)
    parser.add_argument("--skip-wide", action="store_true", help="leave out the Llama-3-8B-width model (3 GB on disk)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    add_save_options(parser)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="scaling-", dir=os.environ.get("TMPDIR")))
    smol, ids = _smollm2_data(32, 256)
    cases = [("SmolLM2-135M fp32, w8a8-int8, 32 x 256", smol, "w8a8-int8", ids, 8)]
    if not args.skip_wide:
        wide_ids = torch.randint(
            0, LLAMA3_8B_WIDTHS["vocab_size"], (16, 256), generator=torch.Generator().manual_seed(0)
        )
        cases.append(("Llama-3-8B widths x 2 layers bf16, fp8, 16 x 256", None, "fp8", wide_ids, 4))
    print(f"{os.cpu_count()} CPU cores (N = 4 oversubscribes them), torch {torch.__version__}, gloo")
    print(
        f"{'model':50} {'N':>2} {'peak/rank meas.':>15} {'predicted':>10} {'read/rank':>10} {'all-gather/layer':>17} "
        f"{'sent/rank':>10} {'calibrate':>10} {'wall':>8}"
    )
    rows = []
    try:
        for label, model_dir, recipe, data, batch in cases:
            model_dir = model_dir or wide_checkpoint(workdir / "llama3-8b-widths-2-layers")
            for nproc in args.ranks:
                plan = predict(model_dir, recipe, data.shape[0], data.shape[1], batch, nproc)
                measured, _ = measure(model_dir, recipe, data, batch, nproc)
                peak = max(r["peak"] for r in measured)
                read = max(r["bytes_read"] for r in measured)
                row = {
                    "model": label, "ranks": nproc, "peak_measured": peak, "peak_predicted": plan.peak_bytes_per_rank,
                    "bytes_read_per_rank": read, "allgather_bytes_per_layer": plan.io["allgather_bytes_per_layer"],
                    "allgather_sent_per_layer_per_rank": plan.io["allgather_sent_per_layer_per_rank"],
                    "calibrate_seconds": max(r["calibrate_seconds"] for r in measured),
                    "wall_seconds": max(r["wall_seconds"] for r in measured),
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{label:50} {nproc:>2} {peak / MiB:>12.0f} MB {row['peak_predicted'] / MiB:>7.0f} MB "
                    f"{read / MiB:>7.0f} MB {row['allgather_bytes_per_layer'] / MiB:>14.1f} MB "
                    f"{row['allgather_sent_per_layer_per_rank'] / MiB:>7.1f} MB {row['calibrate_seconds']:>8.1f} s "
                    f"{row['wall_seconds']:>6.1f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    missing = [n for n in DEFAULT_RANKS if n not in args.ranks]
    why = "--skip-wide leaves out the Llama-3-8B-width model" if args.skip_wide else None
    why = why or (f"--ranks leaves out N = {', '.join(map(str, missing))}" if missing else None)
    save_table(args, "scaling", off_reference=why, order=ORDER["memory"] + 10, **scaling_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
