"""The ``shardcal`` command (also ``python -m shardcal``).

Each subcommand is one module (``cli/<name>_command.py``) that registers a function in
:data:`~.commands.COMMANDS` with the function that declares its arguments::

    @command("eval", help="...", arguments=_eval_arguments)
    def _eval(args) -> int: ...

A :class:`~shardcal.errors.ShardcalError` (bad input, missing package or file) prints ``error: <message>`` on one
line to stderr and exits with status 2; ``--debug`` prints its traceback too. Any other exception is a bug and
propagates with its traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ..errors import CalibrationInterrupted, RunInterrupted, ShardcalError
from . import (  # noqa: F401  (each registers its command)
    calibrate_command,
    collect_command,
    demo_command,
    eval_command,
    import_gguf_command,
    plan_command,
    recipes_command,
)
from .commands import COMMANDS, ORDER, cli_warnings

EXIT_USER_ERROR = 2


def version_line() -> str:
    """``shardcal 0.1.0 (torch 2.13.0, Python 3.11.9)``, without importing torch."""
    import platform
    from importlib import metadata

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "(not installed)"

    return f"shardcal {installed('shardcal')} (torch {installed('torch')}, Python {platform.python_version()})"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for a mistyped flag names the flags it may have meant."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._subparser(getattr(parsed, "command", None))
            (command or self).error(unrecognized_message(extras, command or self))
        return parsed

    def _subparser(self, name: str | None) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return None


def unrecognized_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with "did you mean" for each flag close to one ``parser`` takes."""
    import difflib

    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=2, cutoff=0.6)
            if close:
                hints.append(f"{extra.split('=', 1)[0]}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardcal",
        description="Layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    parser.add_argument("--version", action="version", version=version_line(), help="print the version and exit")
    # --debug is accepted after the subcommand as well; SUPPRESS keeps it from resetting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    names = [n for n in ORDER if n in COMMANDS] + [n for n in COMMANDS if n not in ORDER]
    for name in names:
        cmd = COMMANDS[name]
        sub = subparsers.add_parser(name, help=cmd.help, description=cmd.help, parents=[common])
        cmd.arguments(sub)
        sub.set_defaults(_run=cmd.run)
    return parser


def interrupted_message(exc: KeyboardInterrupt) -> str:
    """The line Ctrl-C ends a command with: for a calibration how far it got, what is lost, and where a rerun resumes
    (with ``--checkpoint-dir``) or how to keep it next time (without); what was written and lost when it came while
    loading or exporting; plain ``interrupted`` for a command that writes nothing."""
    if isinstance(exc, RunInterrupted):
        return str(exc)
    if not isinstance(exc, CalibrationInterrupted):
        return "interrupted"
    if exc.checkpoint_dir is None:
        return (
            f"{exc}: without --checkpoint-dir the {exc.done} calibrated layer(s) are lost; rerun with "
            "--checkpoint-dir DIR to resume from the last committed layer next time"
        )
    if exc.committed == 0:
        return f"{exc}: no layer was committed to {exc.checkpoint_dir} yet; a rerun starts at layer 0"
    return (
        f"{exc}: {exc.committed} layer(s) are committed in {exc.checkpoint_dir}; rerun the same command "
        f"(same --checkpoint-dir) to resume after layer {exc.committed}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardcal``; returns the exit status (0, or 2 for a user error)."""
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # this call's warning settings (cli_warnings), and each call shows its own
        cli_warnings(0)
        try:
            status = args._run(args)
        except ShardcalError as exc:
            if args.debug:
                traceback.print_exc()
            message = " ".join(str(exc).split("\n"))
            print(f"error: {message}", file=sys.stderr)
            return EXIT_USER_ERROR
        except KeyboardInterrupt as exc:
            print(interrupted_message(exc), file=sys.stderr)
            return 130
    return int(status or 0)
