"""Quantize a model's weights to INT4 (activations stay 16-bit) with AWQ + GPTQ, then compare its perplexity with
the original's — the recipe ``shardcal recipes`` recommends for INT4.

    python examples/int4_weights.py MODEL_DIR OUT_DIR --data calib.jsonl --eval-data eval.jsonl

The export is compressed-tensors ``pack-quantized`` (eight 4-bit values per int32, a scale per group of 128):
vLLM serves it with its Marlin / Machete kernels at any tensor-parallel size, transformers loads it too.
GPTQ calibrates each layer on the already-quantized layers' outputs, so expect several passes over the data per
layer: minutes on a small model, hours on a large one (``shardcal plan`` estimates it).
"""

from __future__ import annotations

import argparse
import math

import torch

import shardcal


def perplexity(model: torch.nn.Module, ids: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token cross-entropy) of ``model`` on the token rows ``ids``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in ids.split(batch_size):
            logits = model(batch).float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total, count = total + loss.item(), count + batch[:, 1:].numel()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--data", required=True, help="calibration text (.jsonl, .txt) or token ids (.npy)")
    parser.add_argument("--eval-data", required=True, help="held-out text or token ids for the perplexity")
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()

    result = shardcal.calibrate_to_checkpoint(
        args.model_dir, args.out_dir, "w4a16-awq-gptq", data=args.data, num_samples=args.num_samples,
        seq_len=args.seq_len,
    )  # fmt: skip
    if result.rank != 0:
        return
    tokenizer = shardcal.Tokenizer.from_dir(args.model_dir)
    held_out = shardcal.load_token_data(args.eval_data, tokenizer, seq_len=args.seq_len, num_samples=16)
    before = perplexity(shardcal.from_pretrained(args.model_dir), held_out)
    after = perplexity(shardcal.from_pretrained(args.out_dir), held_out)  # the export, reloaded as fake-quant
    print(f"perplexity: original {before:.3f}, INT4 export {after:.3f} ({after / before - 1:+.1%})")


if __name__ == "__main__":
    main()
