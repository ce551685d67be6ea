"""Calibrate an instruct model on conversations rendered with its own chat template, mixed with plain text.

    python examples/chat_data.py MODEL_DIR OUT_DIR --chat chat.jsonl --text wiki/ [--samples 128] [--seq-len 2048]
    torchrun --nproc-per-node 8 examples/chat_data.py MODEL_DIR OUT_DIR --chat chat.jsonl --text wiki/

``chat.jsonl`` holds one conversation per line, ``{"messages": [{"role": "user", "content": ...}, ...]}`` (a
``.parquet`` file or a Hub dataset directory with a ``messages`` column works the same); ``wiki/`` holds text
(``.jsonl`` with a ``text`` field, or parquet). Each conversation is one sample, rendered with ``MODEL_DIR``'s chat
template (``tokenizer_config.json`` or ``chat_template.jinja``) and padded where it is shorter than ``--seq-len``;
the text is packed into full blocks. The recipe is INT8 weights and activations with SmoothQuant, whose scales come
from exactly these activations; ``vllm serve OUT_DIR`` serves the export. Needs ``pip install '.[data]'``.
"""

from __future__ import annotations

import argparse

import shardcal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--chat", required=True, help="conversations: .jsonl / .parquet / directory with 'messages'")
    parser.add_argument("--text", required=True, help="plain text: .jsonl / .parquet / directory with 'text'")
    parser.add_argument("--samples", type=int, default=128, help="samples of each source")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="which records are taken from each source")
    args = parser.parse_args()

    options = shardcal.DataOptions(seed=args.seed)
    rank, _ = shardcal.init_distributed()  # torchrun's environment, or one process
    data, where = shardcal.load_calibration_data(
        args.model_dir, f"{args.chat}:{args.samples}", f"{args.text}:{args.samples}", seq_len=args.seq_len,
        options=options,
    )  # fmt: skip
    model = shardcal.load_pretrained(args.model_dir)  # FSDP2-sharded: each rank reads its own rows
    report = shardcal.calibrate(model, data, "w8a8-int8-dynamic-sq")
    shardcal.export_checkpoint(model, args.out_dir, recipe="w8a8-int8-dynamic-sq", report=report,
                               tokenizer_dir=args.model_dir)  # fmt: skip
    if rank == 0:
        ids = data["input_ids"] if isinstance(data, dict) else data
        print(f"calibrated on {ids.shape[0]} samples of up to {ids.shape[1]} tokens: {where}")
        print(f"mean output SQNR {report.mean_sqnr_db:.1f} dB; serve it with: vllm serve {args.out_dir}")


if __name__ == "__main__":
    main()
