"""How a planned calibration will run (:class:`PlanSettings`: ranks, data, device, offloading) — what ``shardcal
calibrate`` is given, and what the cheapest fix changes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from ..export.export import EXPORT_DTYPES
from ..layerwise.options import CalibrationOptions

#: The devices a calibration is planned on.
DEVICES = ("cpu", "cuda")
#: What ``export_dtype`` takes (as ``calibrate(export_dtype=)``).
EXPORT_DTYPE_NAMES = ("auto", *EXPORT_DTYPES)


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How the calibration will run: ranks, data, device, offloading (what ``shardcal calibrate`` is given)."""

    world_size: int = 1
    local_world_size: int | None = None  # ranks per node (host memory is shared by them); None: all of them
    num_samples: int = 32
    seq_len: int = 256
    device: str = "cpu"
    cpu_offload: bool = False
    shard_root: bool = True
    options: CalibrationOptions = field(default_factory=CalibrationOptions)
    #: A streamed run (:mod:`shardcal.pipeline.streamed`): decoder layers read in for their step, exported at its end.
    streamed: bool = False
    #: What the export stores unquantized floating tensors in (``--export-dtype``): ``"auto"`` (the checkpoint's
    #: own), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
    export_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("world_size", "num_samples", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "seq_len" else 1):
                raise UsageError(
                    f"{name.replace('_', '-')} must be an integer >= {2 if name == 'seq_len' else 1}, got {value!r}"
                )
        if self.local_world_size is not None and not 1 <= self.local_world_size <= self.world_size:
            raise UsageError(
                f"ranks per node must be between 1 and the world size {self.world_size}, got {self.local_world_size}"
            )
        if self.device not in DEVICES:
            raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.export_dtype not in EXPORT_DTYPE_NAMES:
            raise UsageError(f"export-dtype must be one of {', '.join(EXPORT_DTYPE_NAMES)}, got {self.export_dtype!r}")

    @property
    def local(self) -> int:
        """Ranks per node."""
        return self.local_world_size or self.world_size

    @property
    def offload_activations(self) -> bool:
        """Whether the activation cache is in host memory (the runner's default: exactly when on an accelerator)."""
        off = self.options.offload_activations
        return (self.device != "cpu") if off is None else bool(off)

    def replace(self, **changes: Any) -> PlanSettings:
        """These settings with ``changes``."""
        return dataclasses.replace(self, **changes)
