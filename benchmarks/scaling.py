"""Scaling evidence: the same calibration at N = 1, 2 and 4 ranks on this machine (gloo, CPU).

    python benchmarks/scaling.py [--ranks 1 2 4] [--skip-wide] [--json FILE]

For SmolLM2-135M (float32, w8a8-int8, 32 x 256 tokens, batch 8) and a model with Llama-3-8B's widths and 2 decoder
layers (bfloat16, random weights written here, fp8, 16 x 256 tokens, batch 4), each rank runs the real pipeline
(``load_pretrained`` -> ``calibrate`` -> ``export_checkpoint``; see ``plan_accuracy.py`` for how memory is measured)
and the table shows, per N: the largest peak resident-memory growth of any rank (measured, and the planner's
prediction), the bytes each rank read from the checkpoint (measured by the loader), the bytes one layer's all-gather
moves (the planner's count of what FSDP2 gathers: the whole layer, of which each rank sends (N - 1) / N), and the
wall time of the pipeline and of ``calibrate()``.

This machine has 2 cores: at N = 4 the ranks oversubscribe them and the times say little; the memory column is the
point (each rank holds 1/N of the model, plus one gathered unit, plus its share of the activations).
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
from plan_accuracy import LLAMA3_8B_WIDTHS, _smollm2_data, measure, predict, wide_checkpoint

MiB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip-wide", action="store_true", help="leave out the Llama-3-8B-width model (3 GB on disk)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
