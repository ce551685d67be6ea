"""Calibration speed and memory, as ratios measured side by side in one run (not a timed test).

    python benchmarks/calibration_speed.py [--samples 32] [--seq-len 256] [--batch-size 8] [--recipes NAME ...]
                                           [--recipes-only] [--observer-only] [--repeat N]
                                           [--no-save] [--results-dir DIR]

1. SmolLM2-135M (the embedded model), one process: calibration time (w8a8-int8, propagate=fp) divided by the
   time of one plain FP forward of the whole model over the same data. Target <= 1.3.
2. The same at 2 ranks (gloo; the model loaded sharded with load_pretrained; each rank half of the data).
3. t(2L) / t(L): calibration time of random models with L and 2L layers, the fastest of 3 each (target <= 2.1:
   O(L) layer calls).
4. Peak RSS growth per rank during calibration at 1 vs 2 ranks (model loaded with load_pretrained); also split by
   phase: the embedding (the root's parameters gathered) and the layer steps.
5. Every shipped recipe (or ``--recipes``; ``--observer-only``: those with no weight-changing algorithm), one
   process, warm: calibration time / one plain FP forward over the same data, both measured in this process, a
   forward timed just before each calibration (``--repeat N``: N such pairs per recipe, the fastest calibration
   over the fastest forward, the least disturbed run on a shared machine). Target <= 1.2 for observer-only
   recipes; for GPTQ / AWQ / SmoothQuant recipes the ratio is printed for information.

Tables (benchmarks/_results.py): part 5 goes to ``docs/results/calibration_speed_recipes.json`` (a run of a
subset of the shipped recipes writes only with ``--results-dir DIR``), parts 1-4 to
``docs/results/calibration_speed_smollm2.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import ORDER, RATIO_COLUMNS, add_save_options, ratio_row, save_table  # this folder

from shardcal.runtime.distributed import all_gather_tensors, barrier, world


def _current_rss_mb() -> float:
    """Resident memory now (ru_maxrss would carry the launching parent's peak across exec)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """The highest resident set size (MB) seen while the block runs, sampled every 10 ms by a thread; also per
    calibration phase (``by_phase``: "embedding" — the root gathered — and "layers", from what the rank reports)."""

    def __enter__(self) -> PeakRSS:
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self.by_phase: dict[str, float] = {}
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        from shardcal.runtime.health import current_phase

        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                now = int(f.read().split()[1]) * page / 2**20
            self.peak = max(self.peak, now)
            phase = current_phase()
            kind = (
                "embedding" if phase == "calibrate: embedding" else "layers" if phase.startswith("calibrate ") else None
            )
            if kind is not None:
                self.by_phase[kind] = max(self.by_phase.get(kind, 0.0), now)
            self._stop.wait(0.01)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _fp_forward_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int) -> float:
    with torch.no_grad():
        model(data[:1, :8])  # warm-up (and the FSDP2 lazy init)
        start = time.perf_counter()
        for s in range(0, data.shape[0], batch_size):
            model(data[s : s + batch_size])
    return time.perf_counter() - start


def _rank_slice(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    from shardcal.layerwise.batches import rank_batch_indices

    rank, size = world()
    idx = rank_batch_indices((data.shape[0] + batch_size - 1) // batch_size, rank, size)
    rows = [r for i in idx for r in range(i * batch_size, min((i + 1) * batch_size, data.shape[0]))]
    return data[rows]


def _measure(model_dir: str, data: torch.Tensor, batch_size: int, out: str) -> None:
    """One rank's part of the sharded measurement (runs under shardcal.runtime.launcher.launch or alone)."""
    from shardcal import calibrate
    from shardcal.models import load_pretrained

    model = load_pretrained(model_dir)
    load_rss = _current_rss_mb()
    t_fp = _fp_forward_seconds(model, _rank_slice(data, batch_size), batch_size)
    barrier()
    start = time.perf_counter()
    before = _current_rss_mb()
    with PeakRSS() as peak:
        calibrate(model, data, "w8a8-int8", batch_size=batch_size, progress=False)
    t_cal = time.perf_counter() - start
    phases = [peak.by_phase.get(k, before) - before for k in ("embedding", "layers")]
    times = torch.tensor([t_fp, t_cal, load_rss, peak.peak - before, *phases], dtype=torch.float64)
    gathered = all_gather_tensors(times)
    if world()[0] == 0:
        Path(out).write_text(json.dumps([t.tolist() for t in gathered]))


def _sharded(model_dir: str, data: torch.Tensor, batch_size: int, nproc: int) -> list[list[float]]:
    from shardcal.runtime.launcher import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        launch(_measure, nproc, model_dir, data, batch_size, out)
        return json.loads(Path(out).read_text())


def _single_plain(model_dir: str, data: torch.Tensor, batch_size: int) -> tuple[float, float]:
    from shardcal import calibrate
    from shardcal.models import from_pretrained

    model = from_pretrained(model_dir)
    t_fp = _fp_forward_seconds(model, data, batch_size)
    start = time.perf_counter()
    calibrate(model, data, "w8a8-int8", batch_size=batch_size, progress=False)
    return t_fp, time.perf_counter() - start


def _per_recipe(model_dir: str, data: torch.Tensor, batch_size: int, recipes: list[str], repeat: int) -> list[tuple]:
    """``(recipe, algorithm, calibration seconds, forward seconds, each run's ratio)`` per recipe, one process,
    after a warm-up: a plain forward and then the recipe's calibration (a fresh model each), ``repeat`` times in
    turn, the fastest of each (the least disturbed run on a shared machine)."""
    from shardcal import calibrate, load_recipe
    from shardcal.models import from_pretrained

    model = from_pretrained(model_dir)
    calibrate(model, data[: batch_size // 2, :32], "w8a8-int8", batch_size=batch_size, progress=False)  # warm-up
    rows = []
    for name in recipes:
        recipe = load_recipe(name)
        forward, calibration = [], []
        for _ in range(repeat):
            forward.append(_fp_forward_seconds(from_pretrained(model_dir), data, batch_size))
            model = from_pretrained(model_dir)
            start = time.perf_counter()
            calibrate(model, data, recipe, batch_size=batch_size, progress=False)
            calibration.append(time.perf_counter() - start)
        ratios = ", ".join(f"{c / f:.2f}" for c, f in zip(calibration, forward))
        print(
            f"  {name}: calibration {min(calibration):.1f} s, forward {min(forward):.1f} s (each run: {ratios})",
            flush=True,
        )
        rows.append((name, recipe.algorithm["name"], min(calibration), min(forward), ratios))
    return rows


def _scaling(layers: int, data: torch.Tensor, batch_size: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from shardcal import calibrate
    from shardcal.models import CausalLM, ModelConfig

    from _tiny_models import TINY_CONFIGS, randomize_

    cfg = dict(TINY_CONFIGS["llama"], hidden_size=256, intermediate_size=768, num_hidden_layers=layers, vocab_size=512)
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    calibrate(model, data[:2, :32] % 512, "w8a8-int8", batch_size=batch_size, progress=False)  # warm-up
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    start = time.perf_counter()
    calibrate(model, data % 512, "w8a8-int8", batch_size=batch_size, progress=False)
    return time.perf_counter() - start


def recipes_table(recipes: list[tuple], *, samples: int, seq_len: int, batch_size: int, repeat: int) -> dict:
    """Part 5's table (``write_table``'s keywords) from ``_per_recipe``'s rows."""
    rows = [
        [name, algorithm, round(t_cal, 1), round(t_fp, 1), round(t_cal / t_fp, 2), ratios,
         "<= 1.2" if algorithm == "rtn" else None]
        for name, algorithm, t_cal, t_fp, ratios in recipes
    ]  # fmt: skip
    return {
        "title": "Calibration time per recipe against one plain forward, SmolLM2-135M",
        "columns": [
            "recipe",
            "algorithm",
            "calibration s",
            "one FP forward s",
            "calibration / forward",
            "each run's ratio",
            "target",
        ],
        "rows": rows,
        "notes": [
            f"{samples} x {seq_len} tokens, batch {batch_size}, one process, warm (after one short calibration): "
            f"per recipe, a plain forward over the data and then the recipe's calibration of a freshly loaded model, "
            f"{repeat} time(s) in turn; the fastest calibration over the fastest forward, each run's own ratio "
            "beside it. The target holds for the recipes with no weight-changing algorithm (round to nearest); "
            "for GPTQ / AWQ / SmoothQuant + GPTQ recipes the ratio is for information.",
            "A calibration that observes activations runs each layer once over all the data (the observing pass, "
            "no lm_head) and once more, quantized, on the SQNR sample (the first sequences holding sqnr_tokens "
            "tokens) for the layer's output SQNR. A round-to-nearest recipe with dynamic inputs reads no "
            "statistic from the data and passes only its SQNR sequences through the layers. SmoothQuant "
            "calibrates in the same one pass: its statistics pass is the layer's only run over the data.",
        ],
    }


def ratios_table(m: dict[str, tuple[float, float]], *, samples: int, seq_len: int, batch_size: int,
                 layers: int) -> dict:  # fmt: skip
    """Parts 1-4's table (``write_table``'s keywords): ``m`` maps each measurement to (value, compared with)."""
    rows = [  # label, key of m, unit, compared with, target, digits
        ("calibration, 1 process, plain model", "plain", "s", "one FP forward", "<= 1.3", 1),
        ("calibration, 1 rank, FSDP2 (load_pretrained)", "one_rank", "s", "one FP forward", "<= 1.3", 1),
        ("calibration, 2 ranks, FSDP2 (slowest rank)", "two_ranks", "s", "one FP forward (slowest rank)", "<= 1.3", 1),
        (f"calibration, random model of 2L = {2 * layers} layers", "scaling", "s", f"the same with L = {layers}",
         "<= 2.1", 2),
        ("peak RSS growth per rank during calibrate, 2 ranks", "rss", "MB", "1 rank", "< 1", 0),
        ("peak RSS growth per rank, embedding step (root gathered), 2 ranks", "rss_embedding", "MB", "1 rank", "", 0),
        ("peak RSS growth per rank, the layer steps, 2 ranks", "rss_layers", "MB", "1 rank", "", 0),
        ("RSS after load_pretrained, 2 ranks (largest)", "rss_after_load", "MB", "1 rank", "", 0),
    ]  # fmt: skip
    return {
        "title": "Calibration speed and memory as ratios, SmolLM2-135M w8a8-int8",
        "columns": RATIO_COLUMNS,
        "rows": [
            ratio_row(label, m[key][0], unit, against, m[key][1], target, digits)
            for label, key, unit, against, target, digits in rows
        ],
        "notes": [
            f"{samples} x {seq_len} tokens, batch {batch_size}, recipe w8a8-int8 (propagate = fp). Each ratio is "
            "two times (or sizes) measured in this one run: calibration time over the time of one plain FP "
            "forward of the whole model over the same data (after a warm-up), for the plain model in one process "
            "and for the model loaded sharded (gloo; at 2 ranks each rank forwards its half of the data).",
            "t(2L) / t(L): calibration of random models with L and 2L decoder layers, the fastest of 3 each, "
            "interleaved; a ratio near 2 means each layer is called a fixed number of times (O(L)).",
            "Peak RSS growth: each rank's resident memory sampled every 10 ms during calibrate, over its size "
            "before; by phase, the embedding step (the root's parameters gathered: the tied embeddings) and the "
            "layer steps (where the activations live). RSS after load_pretrained includes torch itself and the "
            "memory-mapped checkpoint pages (load_memory.py measures the load alone).",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6, help="L for the t(2L)/t(L) measurement")
    parser.add_argument("--recipes", nargs="+", default=None, help="recipes for part 5 (default: every shipped one)")
    parser.add_argument("--recipes-only", action="store_true", help="run part 5 only")
    parser.add_argument("--observer-only", action="store_true", help="part 5: the shipped observer-only recipes")
    parser.add_argument(
        "--repeat", type=int, default=1, help="part 5: time each recipe and its forward N times, keep the fastest"
    )
    add_save_options(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")

    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer

    model_dir = embedded_model_dir()
    data = token_blocks(Tokenizer.from_dir(model_dir), args.samples, args.seq_len, split="calib")
    torch.set_num_threads(os.cpu_count() or 1)
    from shardcal.calib.recipes import shipped_recipes

    names = args.recipes or shipped_recipes()
    if args.observer_only:
        from shardcal import load_recipe

        names = [n for n in names if load_recipe(n).algorithm["name"] == "rtn"]
    recipes = _per_recipe(str(model_dir), data, args.batch_size, names, args.repeat)
    print(
        f"SmolLM2-135M, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}, one process, warm, "
        f"fastest of {args.repeat}"
    )
    print(f"{'recipe':24} {'algorithm':12} {'calibration':>12} {'FP forward':>11} {'ratio':>6}  target")
    for name, algorithm, t_cal, t_fp, _ in recipes:
        target = "<= 1.2" if algorithm == "rtn" else "(algorithm)"
        print(f"{name:24} {algorithm:12} {t_cal:>10.1f} s {t_fp:>9.1f} s {t_cal / t_fp:>6.2f}  {target}")
    left_out = sorted(set(shipped_recipes()) - set(names))
    save_table(
        args,
        "calibration_speed_recipes",
        off_reference=f"{'--observer-only' if args.observer_only else '--recipes'} leaves out "
        f"{', '.join(left_out)}" if left_out else None,
        order=ORDER["speed"] + 1,
        **recipes_table(recipes, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size,
                        repeat=args.repeat),
    )  # fmt: skip
    if args.recipes_only:
        return

    t_fp, t_cal = _single_plain(str(model_dir), data, args.batch_size)
    one = _sharded(str(model_dir), data, args.batch_size, 1)
    two = _sharded(str(model_dir), data, args.batch_size, 2)
    # about a second each: the fastest of 3, interleaved (the least disturbed run on a shared machine)
    times = [
        (_scaling(args.layers, data, args.batch_size), _scaling(2 * args.layers, data, args.batch_size))
        for _ in range(3)
    ]
    t_l, t_2l = min(t for t, _ in times), min(t for _, t in times)

    rows = [
        ("calibration / FP forward, 1 process, plain model", f"{t_cal:.1f} s / {t_fp:.1f} s", t_cal / t_fp, "<= 1.3"),
        (
            "calibration / FP forward, 1 rank, FSDP2 (load_pretrained)",
            f"{one[0][1]:.1f} s / {one[0][0]:.1f} s",
            one[0][1] / one[0][0],
            "<= 1.3",
        ),
        (
            "calibration / FP forward, 2 ranks, FSDP2",
            f"{max(r[1] for r in two):.1f} s / {max(r[0] for r in two):.1f} s",
            max(r[1] for r in two) / max(r[0] for r in two),
            "<= 1.3",
        ),
        (f"t(2L)/t(L), random model, L={args.layers}", f"{t_2l:.1f} s / {t_l:.1f} s", t_2l / t_l, "<= 2.1"),
        (
            "peak RSS growth per rank during calibrate, 2 ranks / 1 rank",
            f"{max(r[3] for r in two):.0f} MB / {one[0][3]:.0f} MB",
            max(r[3] for r in two) / one[0][3],
            "< 1",
        ),
    ]
    print(
        f"SmolLM2-135M, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}, recipe w8a8-int8, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}"
    )
    print(f"{'measurement':58} {'values':>22} {'ratio':>7}  target")
    for name, values, ratio, target in rows:
        print(f"{name:58} {values:>22} {ratio:7.2f}  {target}")
    print(
        "peak RSS growth per rank by phase, 2 ranks / 1 rank: embedding (the root gathered) "
        f"{max(r[4] for r in two):.0f} / {one[0][4]:.0f} MB, the layer steps {max(r[5] for r in two):.0f} / "
        f"{one[0][5]:.0f} MB"
    )
    print(
        f"RSS after load_pretrained: 1 rank {one[0][2]:.0f} MB, 2 ranks {', '.join(f'{r[2]:.0f}' for r in two)} MB "
        "(includes torch itself and the memory-mapped checkpoint pages; see load_memory.py for the load alone)"
    )
    measured = {
        "plain": (t_cal, t_fp),
        "one_rank": (one[0][1], one[0][0]),
        "two_ranks": (max(r[1] for r in two), max(r[0] for r in two)),
        "scaling": (t_2l, t_l),
        "rss": (max(r[3] for r in two), one[0][3]),
        "rss_embedding": (max(r[4] for r in two), one[0][4]),
        "rss_layers": (max(r[5] for r in two), one[0][5]),
        "rss_after_load": (max(r[2] for r in two), one[0][2]),
    }
    save_table(
        args,
        "calibration_speed_smollm2",
        order=ORDER["speed"],
        **ratios_table(measured, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size,
                       layers=args.layers),
    )  # fmt: skip


if __name__ == "__main__":
    main()
