"""AutoRound's calibration time against GPTQ's, measured in one run on SmolLM2-135M (W4A16, groups of 64 on every
Linear, the tokens of ``vs_peers.py``: 32 x 256 calibration, 8 x 256 held out).

    python benchmarks/autoround_speed.py [--iters 14 16] [--target fp] [--batch-size 8] [--no-save] [--results-dir DIR]

Runs GPTQ (``w4a16-gptq`` at g64), then AutoRound at each ``--iters`` (``[algorithm] name = "autoround"``, full-
precision targets by default, its guard on), then GPTQ again, each on a freshly loaded model in this one process.
Prints each run's perplexity and calibration seconds, and AutoRound's seconds over the mean of GPTQ's two (the
second GPTQ run shows how much the machine drifted meanwhile). Loading and evaluation are not timed. The table goes
to ``docs/results/autoround_speed_smollm2.json`` (benchmarks/_results.py; ``--target layer`` writes only with
``--results-dir DIR``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import ORDER, add_save_options, save_table  # this folder
from vs_peers import _recipe, load_model, write_inputs

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


def autoround_table(results: list[tuple[str, float, float]], *, target: str, calib: tuple, held_out: tuple,
                    batch_size: int) -> dict:  # fmt: skip
    """The table of a run (``write_table``'s keywords): ``results`` are ``(run, perplexity, calibration s)``, GPTQ
    first and last (their mean is the time baseline)."""
    gptq = (results[0][2] + results[-1][2]) / 2
    return {
        "title": "AutoRound's calibration time against GPTQ's, SmolLM2-135M W4A16 g64",
        "columns": ["run", "perplexity", "calibration s", "time / GPTQ's mean"],
        "rows": [
            [label, round(ppl, 3), round(seconds, 1), round(seconds / gptq, 2)] for label, ppl, seconds in results
        ],
        "notes": [
            f"W4A16 with groups of 64 on every Linear; calibration {calib[0]} x {calib[1]} tokens (batch "
            f"{batch_size}), perplexity on {held_out[0]} x {held_out[1]} held-out tokens: the inputs of vs_peers.py. "
            'GPTQ (w4a16-gptq at g64), then AutoRound at each step count ([algorithm] name = "autoround", '
            f"target = {target}, its guard on), then GPTQ again, each on a freshly loaded model in one process; "
            "the time baseline is the mean of GPTQ's two runs (their difference shows how much the machine "
            "drifted meanwhile). Loading and evaluation are not timed. AutoRound is no shipped recipe.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, nargs="+", default=[14, 16], help="AutoRound's step counts")
    parser.add_argument("--target", choices=("fp", "layer"), default="fp", help="AutoRound's targets")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="where the token files go (default: a temp dir)")
    add_save_options(parser)
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
    save_table(
        args,
        "autoround_speed_smollm2",
        off_reference=None if args.target == "fp" else "--target is not the reference fp",
        order=ORDER["speed"] + 30,
        **autoround_table(results, target=args.target, calib=tuple(calib.shape), held_out=tuple(held_out.shape),
                          batch_size=args.batch_size),
    )  # fmt: skip
    return 0 if all(math.isfinite(ppl) for _, ppl, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
