"""Quantize a mixture-of-experts model (Mixtral, Qwen2/3-MoE, or any MoE transformers has) to FP8.

    python examples/moe.py MODEL_DIR OUT_DIR --data calib.jsonl [--nproc 2]

Every expert is quantized, the routers are not (vLLM keeps them in full precision). During calibration every
expert sees every token (``calibrate_all_experts``, the default), so that experts the calibration data rarely
routes to still get statistics from real activations; the layer's outputs are computed with the router's choice
as usual. The summary says how many experts saw routed tokens.
"""

from __future__ import annotations

import argparse

import shardcal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--data", default=None)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()

    result = shardcal.calibrate_to_checkpoint(
        args.model_dir, args.out_dir, "fp8-dynamic", data=args.data, num_samples=args.num_samples,
        seq_len=args.seq_len, options=shardcal.CalibrationOptions(calibrate_all_experts=True),
    )  # fmt: skip
    if result.rank == 0:
        print(result.report.moe_summary() or "no MoE layers found")
        print(f"exported -> {result.out_dir}")


if __name__ == "__main__":
    main()
