"""Which input channels of each MLP's down projection carry outliers? Activation statistics, layer by layer.

    python examples/collect_activations.py MODEL_DIR --data calib.jsonl [--save-dir ACTS_DIR]

``collect_activations`` walks the (sharded) model one decoder layer at a time, like calibration, and merges the
statistics of every rank exactly: per channel absmax, mean and mean of squares, a histogram, the top channels.
With ``--save-dir`` the raw activations are written too, readable in the original sample order with
``shardcal.ActivationDataset`` (e.g. to train a probe or a sparse autoencoder).
"""

from __future__ import annotations

import argparse

import shardcal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--data", required=True, help="text (.jsonl, .txt) or token ids (.npy, .safetensors)")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--save-dir", default=None, help="also write the raw activations here")
    args = parser.parse_args()

    rank, _ = shardcal.init_distributed()  # torchrun's environment, or one process
    model = shardcal.load_pretrained(args.model_dir)
    tokenizer = shardcal.Tokenizer.from_dir(args.model_dir)
    ids = shardcal.load_token_data(args.data, tokenizer, seq_len=args.seq_len, num_samples=args.num_samples)
    target = "model.layers.*.mlp.down_proj:input"
    report = shardcal.collect_activations(model, ids, [target], save_dir=args.save_dir)
    if rank == 0:
        for name in report.targets:
            channel, absmax = report[name].top_channels[0]
            print(f"{name}: largest input channel {channel} (absmax {absmax:.2f})")
    if args.save_dir is not None and rank == 0:
        samples = sum(1 for _ in shardcal.ActivationDataset(args.save_dir))
        print(f"raw activations of {samples} samples in {args.save_dir}")


if __name__ == "__main__":
    main()
