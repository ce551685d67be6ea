"""User-facing errors.

Every error a user can cause with bad input derives from :class:`ShardcalError` and names the input (file,
key, value) and what is wrong with it. The CLI prints such an error on one line and exits non-zero; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ShardcalError(Exception):
    """Base class of every error caused by bad input or a failed environment, not by a bug."""


class ConfigError(ShardcalError):
    """A model's config.json is missing, unparsable, or describes something we cannot build."""


class CheckpointError(ShardcalError):
    """A weights file (safetensors, index, GGUF) is missing, corrupt, or does not match the model."""


class TokenizerError(ShardcalError):
    """A tokenizer.json (or GGUF tokenizer metadata) is missing or malformed."""


class RecipeError(ShardcalError):
    """A quantization recipe is unknown, malformed, or has an unknown key or value."""


class DataError(ShardcalError):
    """Calibration or evaluation data is empty, of the wrong type or shape, or out of the model's range."""


class ModelLayoutError(ShardcalError):
    """A model's layout is not supported (no decoder layers found, already wrapped, distribution plan)."""


class CalibrationCheckpointError(ShardcalError):
    """A calibration checkpoint directory is corrupt, unwritable, or belongs to another run (model, recipe, data,
    options) or to another kind of checkpoint. The base of :class:`CollectionCheckpointError`."""


class ExportError(ShardcalError):
    """An export destination cannot be written (exists, not writable) or the model cannot be exported."""


class NumericsError(ShardcalError):
    """A layer produced NaN or infinite activations (corrupt weights, an overflow in a low-precision dtype)."""


class UsageError(ShardcalError):
    """An option or argument has a value outside what it accepts (a batch size of 0, an unknown option name)."""


class DistributedError(ShardcalError):
    """Another rank failed, or a collective timed out."""


class CollectionError(ShardcalError):
    """An activation-collection target, statistic or directory is unusable (a pattern matching nothing, a module
    the forward never runs, a save directory that holds something else, a collected report that does not fit)."""


class PlanError(ShardcalError):
    """The planner cannot model this calibration: a recipe's algorithm that states no memory model, a model whose
    decoder layers or tensors it cannot find."""


class CollectionCheckpointError(CalibrationCheckpointError):
    """An activation-collection checkpoint directory is corrupt, unwritable, or belongs to another run (model, data,
    targets, statistics) or to another kind of checkpoint. A :class:`CalibrationCheckpointError`, so that code
    catching that (every checkpoint error, before this class existed) still catches it."""


class InsufficientMemoryError(ShardcalError):
    """The plan predicts more memory than the device or host has free (``calibrate`` stops before loading)."""


class MissingDependencyError(ShardcalError):
    """An optional package a command needs for this input is not installed (or too old); the message names the
    package and the ``pip install`` command."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a command's work outside the layer loop (loading, exporting, finishing): a
    :class:`KeyboardInterrupt` whose message says what was written and what was lost, in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)  # the args rebuild it after pickling (a rank's queue)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CalibrationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`shardcal.calibrate`: a :class:`KeyboardInterrupt` (code catching that still does) that
    says how far the run got — ``done`` of ``total`` layers calibrated, ``committed`` of them in ``checkpoint_dir``
    (None without one, when nothing is kept) — so that the command can say what was lost and where a rerun resumes.
    """

    def __init__(self, done: int, total: int, committed: int, checkpoint_dir: str | None) -> None:
        super().__init__(done, total, committed, checkpoint_dir)  # the args rebuild it after pickling (a rank's queue)
        self.done, self.total, self.committed, self.checkpoint_dir = done, total, committed, checkpoint_dir

    def __str__(self) -> str:
        return f"interrupted at layer {self.done} of {self.total}"


@contextlib.contextmanager
def interrupted_as(message: str) -> Iterator[None]:
    """Ctrl-C inside the block becomes a :class:`RunInterrupted` with ``message`` (what was written, what was lost);
    a more specific interruption (a calibration's, or an inner block's) passes through as it is."""
    try:
        yield
    except (RunInterrupted, CalibrationInterrupted):
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(message) from None
