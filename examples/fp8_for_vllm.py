"""Quantize a model to FP8 (weights and activations) for vLLM, on every GPU of this node or under torchrun.

    python examples/fp8_for_vllm.py MODEL_DIR OUT_DIR [--data calib.jsonl] [--num-samples 512] [--seq-len 2048]
    torchrun --nproc-per-node 8 examples/fp8_for_vllm.py MODEL_DIR OUT_DIR --data calib.jsonl

Every rank runs this script; shardcal shards the model over them (FSDP2), calibrates it layer by layer and writes
one compressed-tensors checkpoint, which ``vllm serve OUT_DIR`` serves as FP8 W8A8. ``fp8-dynamic`` needs no
activation statistics, so a few sequences of calibration text are enough; its FP8 scales for the activations are
computed by vLLM per token at run time.
"""

from __future__ import annotations

import argparse

import shardcal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--data", default=None, help="calibration text or token ids (default: Wikipedia summaries)")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None, help="commit each layer here, so that a rerun resumes")
    args = parser.parse_args()

    result = shardcal.calibrate_to_checkpoint(
        args.model_dir,
        args.out_dir,
        "fp8-dynamic",
        data=args.data,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        options=shardcal.CalibrationOptions(checkpoint_dir=args.checkpoint_dir),
    )
    if result.rank == 0:
        print(f"{len(result.report.layers)} layers, mean output SQNR {result.report.mean_sqnr_db:.1f} dB")
        print(f"serve it with: vllm serve {result.out_dir}")


if __name__ == "__main__":
    main()
