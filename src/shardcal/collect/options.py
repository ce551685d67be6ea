"""``CollectionOptions``: the collection runner's options as one typed object, shared by ``collect_activations`` and
the collection checkpoint's fingerprint (as :class:`~shardcal.layerwise.options.CalibrationOptions` is for
``calibrate``).

Fields marked ``fingerprint`` change what a run collects; a checkpoint written with other values of them is refused
on resume, naming the field. The batches (``batch_size``) are part of the data fingerprint; the others (paths, how
often to commit, where activations are cached, how much is kept for the histogram, progress) do not change results.
Every field is checked when the object is made: a bad value is a :class:`~shardcal.errors.CollectionError` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CollectionError, UsageError
from .report import DEFAULT_BINS, DEFAULT_TOP_K, STATS
from .store import dtype_name, parse_dtype


def _fingerprinted(default: Any) -> Any:
    return field(default=default, metadata={"fingerprint": True})


def parse_stats(stats: Sequence[str] | str) -> list[str]:
    """The statistics asked for, in :data:`STATS` order; a :class:`CollectionError` naming an unknown one."""
    chosen = [stats] if isinstance(stats, str) else list(stats)
    for s in chosen:
        if s not in STATS:
            raise CollectionError(f"stats: unknown statistic {s!r} (known: {', '.join(STATS)})")
    return [s for s in STATS if s in chosen or s == "absmax"]


def _check_number(name: str, value: Any, low: float, integer: bool = True) -> None:
    """A :class:`CollectionError` unless ``value`` is an integer (or with ``integer=False`` a number) >= ``low``."""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < low:
        raise CollectionError(f"{name} must be {'an integer' if integer else 'a number'} >= {low}, got {value!r}")


def _check_path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, Path)):
        raise CollectionError(f"{name} must be a path (str or Path) or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CollectionOptions:
    """How :func:`shardcal.collect_activations` runs.

    - ``stats``: which of ``absmax``, ``mean``, ``meansq``, ``histogram`` to keep (a name or a sequence; absmax and
      token counts are always kept); stored as a tuple in :data:`~shardcal.collect.report.STATS` order.
    - ``bins``: the histogram's bins; ``top_k``: the largest channels listed per target.
    - ``save_dir``: write each target's raw activations there, in ``save_dtype`` (a torch dtype or its name; None: the
      model's parameter dtype), read back with :class:`~shardcal.collect.store.ActivationDataset`.
    - ``batch_size``: rows per batch; batches are dealt to ranks whole, so results do not depend on the world size.
    - ``checkpoint_dir`` / ``checkpoint_every``: commit after every that many layers; a rerun resumes there.
    - ``offload_activations``: keep the activation cache in host memory (None: when the model is on an accelerator).
    - ``keep_mb``: how much of a layer's target activations a rank keeps from the first pass for the histogram before
      it runs a second pass instead (with ``save_dir`` they are always kept: one layer's worth).
    - ``progress``: a progress bar on rank 0.
    """

    stats: tuple[str, ...] = _fingerprinted(STATS)
    bins: int = _fingerprinted(DEFAULT_BINS)
    top_k: int = _fingerprinted(DEFAULT_TOP_K)
    save_dtype: torch.dtype | str | None = field(default=None, metadata={"fingerprint": True})
    save_dir: str | Path | None = None
    batch_size: int = 8
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int = 1
    offload_activations: bool | None = None
    keep_mb: float = 4096
    progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.stats, (str, Sequence)):
            raise CollectionError(f"stats must be a statistic's name or a sequence of them, got {self.stats!r}")
        object.__setattr__(self, "stats", tuple(parse_stats(self.stats)))
        for name, low in (("bins", 1), ("top_k", 0), ("checkpoint_every", 1), ("batch_size", 1)):
            _check_number(name, getattr(self, name), low)
        _check_number("keep_mb", self.keep_mb, 0, integer=False)
        if self.save_dtype is not None:
            parse_dtype(self.save_dtype, torch.float32)
        for name in ("save_dir", "checkpoint_dir"):
            _check_path(name, getattr(self, name))
        if self.offload_activations is not None and not isinstance(self.offload_activations, bool):
            raise CollectionError(f"offload_activations must be True, False or None, got {self.offload_activations!r}")
        if not isinstance(self.progress, bool):
            raise CollectionError(f"progress must be True or False, got {self.progress!r}")

    def replace(self, **changes: Any) -> CollectionOptions:
        """A copy with ``changes``; an unknown option name is a :class:`~shardcal.errors.UsageError`."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise UsageError(f"unknown collection option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **changes)

    def resolved(self, model_dtype: torch.dtype) -> CollectionOptions:
        """A copy whose ``save_dtype`` is what the run writes: the dtype's name (``model_dtype`` when None) with a
        ``save_dir``, None without one (what the fingerprint records)."""
        saved = dtype_name(parse_dtype(self.save_dtype, model_dtype)) if self.save_dir is not None else None
        return self.replace(save_dtype=saved)

    def fingerprint(self) -> dict[str, Any]:
        """The options that change what a run collects, as JSON values (call it on :meth:`resolved` options)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("fingerprint")}
        out["stats"] = list(self.stats)
        if isinstance(out["save_dtype"], torch.dtype):
            out["save_dtype"] = dtype_name(out["save_dtype"])
        return out
