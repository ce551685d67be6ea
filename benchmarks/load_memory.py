"""Peak resident memory per rank while loading SmolLM2-135M sharded (load_pretrained) vs plainly (from_pretrained).

    python benchmarks/load_memory.py [--nproc 2] [--no-save] [--results-dir DIR]

Each rank reports the growth of its peak RSS across the load (the process's own baseline — torch imported — is
subtracted) and the parameter bytes it read, next to the model's size. The table goes to
``docs/results/load_memory_smollm2.json`` (benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path

from _results import ORDER, add_save_options, save_table  # this folder


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(model_dir: str, out: str, sharded: bool) -> None:
    import torch

    from shardcal.models import from_pretrained, load_pretrained
    from shardcal.runtime.distributed import all_gather_tensors, world

    base = _peak_mb()
    model = load_pretrained(model_dir) if sharded else from_pretrained(model_dir)
    grown = _peak_mb() - base
    plan = getattr(model, "_shardcal_distribution_plan", None) or {}
    total = (
        sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if not plan
        else plan["model_bytes"] / 2**20
    )
    read = plan.get("bytes_read", total * 2**20) / 2**20
    rows = torch.tensor([grown, read, total], dtype=torch.float64)
    gathered = all_gather_tensors(rows)
    if world()[0] == 0:
        Path(out).write_text(json.dumps([g.tolist() for g in gathered]))


def load_table(loads: list[tuple[str, list[list[float]]]]) -> dict:
    """The table of a run (``write_table``'s keywords): ``loads`` are ``(how, [[peak RSS growth MB, MB read, model
    MB] per rank])``, plain ``from_pretrained`` first (the baseline of the growth ratio)."""
    baseline = loads[0][1][0][0]
    rows = [
        [how, len(ranks), r, round(grown), round(read), round(total), round(grown / baseline, 2),
         round(read / total, 2)]
        for how, ranks in loads
        for r, (grown, read, total) in enumerate(ranks)
    ]  # fmt: skip
    return {
        "title": "Loading memory per rank, SmolLM2-135M float32: sharded against plain",
        "columns": [
            "load",
            "ranks",
            "rank",
            "peak RSS growth MB",
            "read MB",
            "model MB",
            "growth / from_pretrained's",
            "read / model",
        ],
        "rows": rows,
        "notes": [
            "Each rank's growth of its peak resident memory (ru_maxrss) across the load, over its own baseline "
            "with torch imported, and the parameter bytes it read from the checkpoint, next to the model's size. "
            "load_pretrained reads each rank's own rows only; memory-mapped file pages count in the resident size.",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    add_save_options(parser)
    args = parser.parse_args(argv)
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.runtime.launcher import launch

    model_dir = str(embedded_model_dir())
    print(f"SmolLM2-135M (float32) from {model_dir}")
    print(f"{'load':34} {'rank':>4} {'peak RSS growth':>16} {'bytes read':>11} {'model':>9}")
    loads = []
    for name, nproc, sharded in (
        ("from_pretrained, 1 process", 1, False),
        ("load_pretrained, 1 rank", 1, True),
        (f"load_pretrained, {args.nproc} ranks", args.nproc, True),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            launch(_rank, nproc, model_dir, out, sharded)
            ranks = json.loads(Path(out).read_text())
            loads.append((name, ranks))
            for r, (grown, read, total) in enumerate(ranks):
                print(f"{name:34} {r:>4} {grown:>13.0f} MB {read:>8.0f} MB {total:>6.0f} MB")
    save_table(args, "load_memory_smollm2", order=ORDER["memory"], **load_table(loads))


if __name__ == "__main__":
    main()
