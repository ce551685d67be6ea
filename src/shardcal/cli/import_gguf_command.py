"""``shardcal import-gguf``: a GGUF file as a Hugging Face-format model directory."""

from __future__ import annotations

import argparse
import time

from .commands import command


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .gguf file (llama, qwen2, qwen3 or gemma3 architecture)")
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="where to write the Hugging Face-format directory (must not exist or be empty)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it holds an earlier import, none of its files edited since (a directory holding "
        "any other file, or an edited import, is never replaced)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="dtype of the written weights (float32 keeps the dequantized values exactly; default %(default)s)",
    )


@command(
    "import-gguf", help="convert a GGUF file into a Hugging Face-format model directory", arguments=_import_arguments
)
def _import_gguf(args: argparse.Namespace) -> int:
    from ..io.gguf.importer import import_gguf

    start = time.perf_counter()
    out = import_gguf(args.file, args.out_dir, overwrite=args.overwrite, dtype=args.dtype)
    print(f"imported {args.file} -> {out} ({time.perf_counter() - start:.1f} s)")
    return 0
