"""``CalibrationOptions``: the runner's options as one typed object, shared by ``calibrate``, the CLI and the
calibration checkpoint's fingerprint.

Fields marked ``fingerprint`` change what a run computes; a checkpoint written with other values of them is
refused on resume. The others (progress, paths, how often to commit, where activations are cached) do not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError

PROPAGATE_MODES = ("fp", "qdq")
#: Real tokens of the sequences each layer's output SQNR is measured on, by default.
DEFAULT_SQNR_TOKENS = 1024


def _fingerprinted(default: Any) -> Any:
    return field(default=default, metadata={"fingerprint": True})


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    """How :func:`shardcal.calibrate` runs.

    - ``propagate``: inputs of layer i+1 — ``"fp"``, the full-precision outputs of layer i (one pass per layer), or
      ``"qdq"``, its outputs with its quantizers on; None: the recipe's algorithm's choice (``"qdq"`` for GPTQ).
    - ``batch_size``: rows per batch; batches are dealt to ranks whole, so results do not depend on the world size.
    - ``calibrate_all_experts``: every MoE expert observes every token (outputs unchanged), not only its routed ones.
    - ``sqnr_tokens``: each layer's output SQNR is measured on the first sequences of the data that hold this many
      real tokens (whole sequences, at least one; 0: no SQNR).
    - ``offload_activations``: keep the activation cache in host memory (None: when the model is on an accelerator).
    - ``checkpoint_dir`` / ``checkpoint_every``: commit after every that many layers; a rerun resumes there.
    - ``progress``: a progress bar on rank 0. ``report_path``: write the JSON report there (rank 0).
    """

    propagate: str | None = _fingerprinted(None)
    batch_size: int = _fingerprinted(8)
    calibrate_all_experts: bool = _fingerprinted(True)
    sqnr_tokens: int = _fingerprinted(DEFAULT_SQNR_TOKENS)
    offload_activations: bool | None = None
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int = 1
    progress: bool = True
    report_path: str | Path | None = None

    def __post_init__(self) -> None:
        if self.propagate is not None and self.propagate not in PROPAGATE_MODES:
            raise UsageError(f"propagate must be one of {', '.join(PROPAGATE_MODES)} or None, got {self.propagate!r}")
        for name, low in (("batch_size", 1), ("checkpoint_every", 1), ("sqnr_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("calibrate_all_experts", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def replace(self, **changes: Any) -> CalibrationOptions:
        """A copy with ``changes``; an unknown option name is a :class:`~shardcal.errors.UsageError`."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise UsageError(f"unknown calibration option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> dict[str, Any]:
        """The options that change what a run computes (``propagate`` resolved by the caller first)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("fingerprint")}
