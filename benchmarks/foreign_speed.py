"""Calibration of a model shardcal did not write: transformers' Llama vs shardcal's own Llama, same checkpoint.

    python benchmarks/foreign_speed.py [--samples 32] [--seq-len 256] [--batch-size 8] [--recipe w8a8-int8]
                                       [--repeats 2] [--no-save] [--results-dir DIR]

SmolLM2-135M (the embedded model) is loaded twice from the same directory — transformers' ``LlamaForCausalLM`` and
shardcal's ``CausalLM`` — in one process. Interleaved, ``--repeats`` times (the minimum is kept, since this machine
is shared): the time of one plain forward over the data (after a warm-up) and of ``calibrate`` (recipe,
propagate=fp, a freshly loaded model) over the same data, and their ratio. transformers' model has no
``embed``: its layer inputs are recorded from its own forward (one extra pass of the first batch through the
layers), which the ratio includes. Also printed: the largest relative amax difference between the two runs. The
table goes to ``docs/results/foreign_speed_smollm2.json`` (benchmarks/_results.py; another ``--recipe`` writes only
with ``--results-dir DIR``).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from _results import ORDER, add_save_options, save_table  # this folder


def _forward_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int, **kwargs) -> float:
    with torch.no_grad():
        model(data[:1, :8], **kwargs)
        start = time.perf_counter()
        for s in range(0, data.shape[0], batch_size):
            model(data[s : s + batch_size], **kwargs)
    return time.perf_counter() - start


def _calibrate_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int, recipe: str) -> tuple[float, dict]:
    from shardcal.calib.runner import calibrate
    from shardcal.quant.session import iter_quantizers

    start = time.perf_counter()
    calibrate(model, data, recipe, batch_size=batch_size, progress=False, propagate="fp")
    seconds = time.perf_counter() - start
    return seconds, {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}


def foreign_table(rows: list[tuple[str, float, float]], *, worst_amax: float, same_quantizers: bool, recipe: str,
                  samples: int, seq_len: int, batch_size: int, repeats: int) -> dict:  # fmt: skip
    """The table of a run (``write_table``'s keywords): ``rows`` are ``(model class, forward s, calibration s)``,
    shardcal's own class first (the baseline of the last column)."""
    base = rows[0][2] / rows[0][1]
    return {
        "title": f"Calibrating a model shardcal did not write: transformers' Llama against shardcal's, {recipe}",
        "columns": [
            "model class",
            "one FP forward s",
            "calibration s",
            "calibration / forward",
            "that ratio / shardcal CausalLM's",
        ],
        "rows": [
            [name, round(t_f, 1), round(t_c, 1), round(t_c / t_f, 2), round((t_c / t_f) / base, 2)]
            for name, t_f, t_c in rows
        ],
        "notes": [
            f"SmolLM2-135M loaded twice from the same directory, as transformers' LlamaForCausalLM and as "
            f"shardcal's CausalLM, in one process; {samples} x {seq_len} tokens, batch {batch_size}, {recipe} with "
            f"propagate = fp. Interleaved, {repeats} time(s), the fastest of each kept: one plain forward over the "
            "data (after a warm-up), then calibrate on a freshly loaded model.",
            "transformers' model has no embed step of shardcal's: its layer inputs are recorded from its own "
            "forward (one extra pass of the first batch through the layers), which its ratio includes.",
            f"Same quantizers in both: {'yes' if same_quantizers else 'NO'}; largest relative amax difference "
            f"between the two calibrations: {worst_amax:.2e}.",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--recipe", default="w8a8-int8")
    parser.add_argument("--repeats", type=int, default=2)
    add_save_options(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer
    from shardcal.loading.plain import from_pretrained

    model_dir = embedded_model_dir()
    data = token_blocks(Tokenizer.from_dir(model_dir), args.samples, args.seq_len, split="calib")
    loaders = {
        "shardcal CausalLM": (lambda: from_pretrained(model_dir), {}),
        "transformers LlamaForCausalLM": (
            lambda: transformers.LlamaForCausalLM.from_pretrained(model_dir).eval(),
            {"use_cache": False},
        ),
    }
    best: dict[str, list[float]] = {name: [float("inf"), float("inf")] for name in loaders}
    amax = {}
    for _ in range(args.repeats):
        for name, (load, kwargs) in loaders.items():
            model = load()
            t_forward = _forward_seconds(model, data, args.batch_size, **kwargs)
            t_calibrate, amax[name] = _calibrate_seconds(model, data, args.batch_size, args.recipe)
            best[name] = [min(best[name][0], t_forward), min(best[name][1], t_calibrate)]
            del model
    rows = [(name, *times) for name, times in best.items()]
    print(
        f"SmolLM2-135M, {args.samples} x {args.seq_len} tokens, batch {args.batch_size}, {args.recipe}, one process, "
        f"best of {args.repeats}"
    )
    print(f"{'model class':32} {'forward s':>10} {'calibrate s':>12} {'ratio':>7}")
    for name, t_f, t_c in rows:
        print(f"{name:32} {t_f:10.1f} {t_c:12.1f} {t_c / t_f:7.2f}")
    ours, theirs = amax["shardcal CausalLM"], amax["transformers LlamaForCausalLM"]
    worst = max(((ours[n] - theirs[n]).abs().max() / ours[n].abs().max().clamp(min=1e-12)).item() for n in ours)
    print(f"same quantizers: {ours.keys() == theirs.keys()}; largest relative amax difference {worst:.2e}")
    print(f"ratio transformers / shardcal: {(rows[1][2] / rows[1][1]) / (rows[0][2] / rows[0][1]):.2f}")
    save_table(
        args,
        "foreign_speed_smollm2",
        off_reference=None if args.recipe == "w8a8-int8" else "--recipe is not the reference recipe w8a8-int8",
        order=ORDER["speed"] + 10,
        **foreign_table(rows, worst_amax=worst, same_quantizers=ours.keys() == theirs.keys(), recipe=args.recipe,
                        samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size,
                        repeats=args.repeats),
    )  # fmt: skip


if __name__ == "__main__":
    main()
