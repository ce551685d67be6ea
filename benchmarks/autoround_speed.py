"""AutoRound's calibration time against GPTQ's, measured in one run on SmolLM2-135M (W4A16, groups of 64 on every
Linear, the tokens of ``vs_peers.py``: 32 x 256 calibration, 8 x 256 held out).

    python benchmarks/autoround_speed.py [--iters 14 16] [--target fp] [--batch-size 8]

Runs GPTQ (``w4a16-gptq`` at g64), then AutoRound at each ``--iters`` (``[algorithm] name = "autoround"``, full-
precision targets by default, its guard on), then GPTQ again, each on a freshly loaded model in this one process.
Prints each run's perplexity and calibration seconds, and AutoRound's seconds over the mean of GPTQ's two (the
second GPTQ run shows how much the machine drifted meanwhile). Loading and evaluation are not timed.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from vs_peers import _recipe, load_model, write_inputs  # this folder

_G64 = {"weight": {"group_size": 64}}


def _autoround(iters: int, target: str) -> dict:
    algorithm = {"name": "autoround", "iters": iters, "target": target}
    return {**_G64, "algorithm": {**algorithm, "block_size": None, "percdamp": None, "act_order": None}}


def _run(model_dir: Path, calib: torch.Tensor, held_out: torch.Tensor, overlay: dict, batch_size: int):
    from shardcal.calib.runner import calibrate
    from shardcal.data.perplexity import perplexity

    model = load_model(model_dir)
    recipe = _recipe("w4a16-gptq", overlay)
    start = time.perf_counter()
    calibrate(model, calib, recipe, batch_size=batch_size, progress=False)
    seconds = time.perf_counter() - start
    return perplexity(model, held_out, batch_size=8), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, nargs="+", default=[14, 16], help="AutoRound's step counts")
    parser.add_argument("--target", choices=("fp", "layer"), default="fp", help="AutoRound's targets")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="where the token files go (default: a temp dir)")
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="shardcal-autoround-speed-"))
    model_dir, calib, held_out = write_inputs(work, "smollm2")
    print(f"SmolLM2-135M, W4A16 g64, calibration {tuple(calib.shape)}, {torch.get_num_threads()} threads", flush=True)
    runs = [("GPTQ", _G64)] + [(f"AutoRound {n} steps", _autoround(n, args.target)) for n in args.iters]
    runs.append(("GPTQ again", _G64))
    results = []
    for label, overlay in runs:
        ppl, seconds = _run(model_dir, calib, held_out, overlay, args.batch_size)
        results.append((label, ppl, seconds))
        print(f"  {label}: perplexity {ppl:.3f}, calibration {seconds:.1f} s", flush=True)
    gptq = (results[0][2] + results[-1][2]) / 2
    print()
    print(f"| {'run':<20} | {'perplexity':>10} | {'calib s':>7} | {'x GPTQ time':>11} |")
    print(f"|{'-' * 22}|{'-' * 11}:|{'-' * 8}:|{'-' * 12}:|")
    for label, ppl, seconds in results:
        print(f"| {label:<20} | {ppl:>10.3f} | {seconds:>7.1f} | {seconds / gptq:>11.2f} |")
    return 0 if all(math.isfinite(ppl) for _, ppl, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
