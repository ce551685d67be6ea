"""Calibration of a model shardcal did not write: transformers' Llama vs shardcal's own Llama, same checkpoint.

    python benchmarks/foreign_speed.py [--samples 32] [--seq-len 256] [--batch-size 8] [--recipe w8a8-int8]

SmolLM2-135M (the embedded model) is loaded twice from the same directory — transformers' ``LlamaForCausalLM`` and
shardcal's ``CausalLM`` — in one process. Interleaved, ``--repeats`` times (the minimum is kept, since this machine
is shared): the time of one plain forward over the data (after a warm-up) and of ``calibrate`` (recipe,
propagate=fp, a freshly loaded model) over the same data, and their ratio. transformers' model has no
``embed``: its layer inputs are recorded from its own forward (one extra pass of the first batch through the
layers), which the ratio includes. Also printed: the largest relative amax difference between the two runs.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--recipe", default="w8a8-int8")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    from shardcal.data.calibration import token_blocks
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


if __name__ == "__main__":
    main()
