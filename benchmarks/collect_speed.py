"""Activation collection: its time against one plain forward, and the write throughput of ``save_dir``.

    python benchmarks/collect_speed.py [--samples 32] [--seq-len 256] [--batch-size 8] [--repeats 2]
                                       [--no-save] [--results-dir DIR]

SmolLM2-135M (the embedded model, float32, one process, shardcal's ``CausalLM``), calibration Wikipedia token blocks.
Targets: the residual stream after every layer (``model.layers.*:output``, 576 channels) and every down_proj input
(``model.layers.*.mlp.down_proj:input``, 1536 channels), all statistics (absmax, mean, meansq, a 2048-bin histogram,
top-8 channels). Interleaved, ``--repeats`` times (the minimum is kept: this machine is shared): one plain forward
over the data (after a warm-up; it includes the final norm and lm_head, which collection never runs) and
``collect_activations`` over the same data with statistics only; their ratio. Then once with ``save_dir`` (float32):
the extra time over statistics only, and the bytes written. Last, the write throughput: the same tensors (read back
from the saved files) written again through the collection's writer (atomic: temporary file, fsync, rename) and with
a plain ``safetensors.torch.save_file`` (no fsync), and with save_file + fsync of each file, into as many files,
alternating, best MB/s of each. The table goes to ``docs/results/collect_speed_smollm2.json`` (benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from _results import ORDER, RATIO_COLUMNS, add_save_options, ratio_row, save_table  # this folder

TARGETS = ["model.layers.*:output", "model.layers.*.mlp.down_proj:input"]


def _forward_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int) -> float:
    with torch.no_grad():
        model(data[:1, :8])
        start = time.perf_counter()
        for s in range(0, data.shape[0], batch_size):
            model(data[s : s + batch_size])
    return time.perf_counter() - start


def _collect_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int, save_dir: Path | None) -> float:
    from shardcal.collect.runner import collect_activations

    start = time.perf_counter()
    collect_activations(model, data, TARGETS, batch_size=batch_size, save_dir=save_dir, progress=False)
    return time.perf_counter() - start


def _write_throughput(saved: Path, scratch: Path, batches: list, rounds: int) -> dict[str, float]:
    """Best MB/s of the collection's writer, of a plain save_file and of save_file + fsync, writing the same tensors
    into as many files, in alternating rounds (fresh directories, removed after each round: the page cache and dirty-page writeback of one
    do not land on the other's clock)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardcal.collect.store import ActivationWriter
    from shardcal.runtime.fsutil import fsync_path

    files = {}
    for path in sorted(saved.glob("L*-B*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    total = sum(t.numel() * t.element_size() for tensors in files.values() for t in tensors.values())
    kinds = ("plain", "plain+fsync", "writer")
    best = dict.fromkeys(kinds, float("inf"))
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            out = scratch / f"{kind}-{r}"
            out.mkdir()
            writer = ActivationWriter(out, torch.float32, batches, run="benchmark")
            start = time.perf_counter()
            for name, tensors in files.items():
                if kind == "writer":
                    writer.write(int(name[1:6]), int(name[8:14]), tensors)
                else:
                    save_file(tensors, str(out / name))
                    if kind == "plain+fsync":
                        fsync_path(out / name)
            best[kind] = min(best[kind], time.perf_counter() - start)
            shutil.rmtree(out)
    return {kind: total / 2**20 / seconds for kind, seconds in best.items()}


def collect_table(m: dict[str, float], *, samples: int, seq_len: int, batch_size: int, repeats: int) -> dict:
    """The table of a run (``write_table``'s keywords): ``m`` holds the seconds (forward, collect, save), the MB
    written and the three writers' MB/s (writer, plain, plain+fsync)."""
    extra = max(m["save"] - m["collect"], 1e-9)
    return {
        "title": "Activation collection against one plain forward, and its write throughput, SmolLM2-135M",
        "columns": RATIO_COLUMNS,
        "rows": [
            ratio_row("one plain forward over the data", m["forward"], "s"),
            ratio_row(
                "collect_activations, statistics only", m["collect"], "s", "one plain forward", m["forward"], "<= 1.2"
            ),
            ratio_row("collect_activations with save_dir (float32)", m["save"], "s", "statistics only", m["collect"]),
            ratio_row("written by save_dir", m["written"], "MB"),
            ratio_row("save_dir end to end: written / extra time over statistics only", m["written"] / extra, "MB/s"),
            ratio_row(
                "the collection's writer (temp file, fsync, rename)",
                m["writer"],
                "MB/s",
                "save_file + fsync of each file",
                m["plain+fsync"],
            ),
            ratio_row(
                "the collection's writer (temp file, fsync, rename)",
                m["writer"],
                "MB/s",
                "save_file without fsync",
                m["plain"],
            ),
        ],
        "notes": [
            f"SmolLM2-135M float32, one process, shardcal's CausalLM; {samples} x {seq_len} calibration tokens, "
            f"batch {batch_size}. Targets: {' and '.join(TARGETS)}, every statistic (absmax, mean, meansq, a "
            "histogram, the top channels). Interleaved, the fastest of "
            f"{repeats}: one plain forward over the data (after a warm-up; it includes the final norm and lm_head, "
            "which collection never runs) and collect_activations with statistics only.",
            "Then once with save_dir (float32): the extra time over statistics only, and the bytes written. Last, "
            "the same tensors (read back from the saved files) written again into as many files, alternating, the "
            "best MB/s of each: through the collection's writer (atomic: temporary file, fsync, rename), with a "
            "plain safetensors save_file, and with save_file and an fsync of each file.",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    add_save_options(parser)
    args = parser.parse_args(argv)

    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer
    from shardcal.layerwise.batches import make_batches
    from shardcal.loading.plain import from_pretrained

    model_dir = embedded_model_dir()
    data = token_blocks(Tokenizer.from_dir(model_dir), args.samples, args.seq_len, split="calib")
    model = from_pretrained(model_dir)
    t_forward, t_collect = float("inf"), float("inf")
    for _ in range(args.repeats):
        t_forward = min(t_forward, _forward_seconds(model, data, args.batch_size))
        t_collect = min(t_collect, _collect_seconds(model, data, args.batch_size, None))
    scratch = Path(tempfile.mkdtemp(prefix="shardcal-collect-bench-"))
    try:
        t_save = _collect_seconds(model, data, args.batch_size, scratch / "acts")
        written = sum(p.stat().st_size for p in (scratch / "acts").iterdir())
        batches = make_batches(data, args.batch_size)
        mbs = _write_throughput(scratch / "acts", scratch, batches, 2 * args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mb = written / 2**20
    print(
        f"SmolLM2-135M float32, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}, one process, "
        f"targets {' '.join(TARGETS)}, all statistics; best of {args.repeats}"
    )
    print(f"{'measurement':58} {'value':>18}")
    print(f"{'one plain forward over the data':58} {t_forward:17.1f}s")
    print(f"{'collect_activations, statistics only':58} {t_collect:17.1f}s")
    print(f"{'ratio collection / forward (target <= 1.2)':58} {t_collect / t_forward:18.2f}")
    print(f"{'collect_activations with save_dir (float32)':58} {t_save:17.1f}s")
    print(f"{'written by save_dir':58} {mb:15.1f} MB")
    print(f"{'save_dir cost: extra time over statistics only':58} {t_save - t_collect:17.1f}s")
    print(f"{'  -> end-to-end MB/s (written / extra time)':58} {mb / max(t_save - t_collect, 1e-9):13.1f} MB/s")
    print(f"{'writer throughput (atomic: temp file, fsync, rename)':58} {mbs['writer']:13.1f} MB/s")
    print(f"{'plain safetensors save_file of the same bytes (no fsync)':58} {mbs['plain']:13.1f} MB/s")
    print(f"{'plain save_file + fsync of each file':58} {mbs['plain+fsync']:13.1f} MB/s")
    print(
        f"{'writer / plain, writer / plain + fsync':58} {mbs['writer'] / mbs['plain']:10.2f}, {mbs['writer'] / mbs['plain+fsync']:.2f}"
    )

    measured = {"forward": t_forward, "collect": t_collect, "save": t_save, "written": mb, **mbs}
    save_table(
        args,
        "collect_speed_smollm2",
        order=ORDER["speed"] + 20,
        **collect_table(measured, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size,
                        repeats=args.repeats),
    )  # fmt: skip


if __name__ == "__main__":
    main()
