"""``QuantizerSpec``: the plain-data description of one quantizer (what a recipe says, what export reads).

A spec names a number format, a granularity (how many scales and over which elements), and the observer that
calibrates the amax. It holds no tensors, so it can be written to JSON (calibration checkpoints, export
manifests) and compared. Validation here raises :class:`SpecError` (a ValueError that knows which field is wrong); the recipe
loader turns that into a :class:`shardcal.errors.RecipeError` naming the file and key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..runtime.params import Schema, SpecError, check_params, integer, number

#: Number formats, in the names recipes use.
FORMATS: tuple[str, ...] = ("int8", "int4", "fp8_e4m3", "nvfp4", "mxfp4", "mxfp8")
#: Granularities: one scale per tensor, per channel (along ``axis``), per group of ``group_size`` on the last dim,
#: per token (each row of the last dim; dynamic activations only: the scales are taken at run time), or per 2-D
#: block of ``block_size`` (rows, columns) of a weight's last two dims (FP8 block, as DeepSeek-V3 publishes).
GRANULARITIES: tuple[str, ...] = ("tensor", "channel", "group", "token", "block")
#: NVFP4's block size: every 16 consecutive elements of the last dim share one FP8 E4M3 scale.
NVFP4_BLOCK_SIZE = 16
#: The OCP microscaling formats (E2M1 or E4M3 values, one E8M0 power-of-two scale per 32 of the last dim).
MX_FORMATS: tuple[str, ...] = ("mxfp4", "mxfp8")
MX_BLOCK_SIZE = 32


@dataclass(frozen=True)
class ObserverKind:
    """What an observer is, as plain data: how many passes over the data it needs and which parameters it takes.

    The observers themselves (:mod:`shardcal.quant.observers`) implement these; a spec is checked against this
    table, so a recipe naming an unknown observer or parameter fails before anything is built.
    """

    name: str
    num_passes: int
    params: Schema


#: Observers by name (see :mod:`shardcal.quant.observers` for what each computes).
OBSERVER_KINDS: dict[str, ObserverKind] = {
    kind.name: kind
    for kind in (
        ObserverKind("max", 1, {}),
        ObserverKind(
            "percentile", 2, {"percentile": (99.99, number(0.0, 100.0, lo_open=True)), "bins": (2048, integer(2))}
        ),
        ObserverKind(
            "mse",
            2,
            {
                "grid": (100, integer(1)),
                "max_shrink": (0.2, number(0.0, 1.0, hi_open=True)),
                "norm": (2.0, number(0.0, 16.0, lo_open=True)),
            },
        ),
    )
}


#: Observers that calibrate an asymmetric range (min and max per slot).
ASYMMETRIC_OBSERVERS: tuple[str, ...] = ("max", "mse")


def validate_observer(name: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` checked and completed with defaults; :class:`SpecError` for an unknown observer or parameter."""
    if name not in OBSERVER_KINDS:
        raise SpecError("observer", f"unknown observer {name!r} (known: {', '.join(OBSERVER_KINDS)})")
    return check_params(f"observer {name!r}", params, OBSERVER_KINDS[name].params, key_prefix="observer.")


@dataclass(frozen=True)
class QuantizerSpec:
    """What one quantizer does.

    - ``format``: one of :data:`FORMATS`.
    - ``granularity``: ``"tensor"``, ``"channel"`` (``axis`` required: 0 = output channels of a weight,
      -1 = the last dim of an activation), ``"group"`` (``group_size`` consecutive elements of the last dim; with
      ``dynamic``, per token: each token's groups take their scales at run time), ``"token"`` (one scale per token,
      i.e. per row of the last dim; only with ``dynamic``) or ``"block"`` (``block_size = (rows, cols)``: one scale
      per block of a weight's last two dims, the last blocks partial where the dims are not multiples; static
      symmetric weights only).
      ``nvfp4`` is always ``"group"`` with ``group_size`` 16 (its FP8 block scales) and one calibrated global
      amax per tensor; a spec built with ``format="nvfp4"`` and nothing else gets those values.
    - ``observer`` and ``observer_params``: how the amax is calibrated (see :mod:`shardcal.quant.observers`).
    - ``symmetric``: ``True`` (one scale, zero at zero) or ``False``: asymmetric, for int weights only — a scale
      and an integer zero point per slot, from the slot's range ``[min(x, 0), max(x, 0)]`` (see
      :mod:`shardcal.quant.formats`); calibrated by the ``max`` or ``mse`` observer.
    - ``dynamic``: the amax is computed from each tensor at run time (no calibration, no stored amax).
    """

    format: str
    granularity: str = "tensor"
    axis: int | None = None
    group_size: int | None = None
    observer: str = "max"
    observer_params: Mapping[str, Any] = field(default_factory=dict)
    symmetric: bool = True
    dynamic: bool = False
    block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise SpecError("format", f"unknown format {self.format!r} (known: {', '.join(FORMATS)})")
        if self.format == "nvfp4" and self.granularity == "tensor" and self.group_size is None:
            object.__setattr__(self, "granularity", "group")
            object.__setattr__(self, "group_size", NVFP4_BLOCK_SIZE)
        if self.format in MX_FORMATS and self.granularity == "tensor" and self.group_size is None:
            object.__setattr__(self, "granularity", "group")
            object.__setattr__(self, "group_size", MX_BLOCK_SIZE)
        if self.granularity not in GRANULARITIES:
            raise SpecError(
                "granularity", f"unknown granularity {self.granularity!r} (known: {', '.join(GRANULARITIES)})"
            )
        if self.granularity == "channel":
            if not _is_int(self.axis):
                raise SpecError(
                    "axis", "granularity 'channel' needs an integer axis (0: weight output channels, -1: last dim)"
                )
        elif self.axis is not None:
            raise SpecError(
                "axis", f"axis is only valid with granularity 'channel' (granularity is {self.granularity!r})"
            )
        if self.granularity == "group":
            if not _is_int(self.group_size) or self.group_size < 1:
                raise SpecError(
                    "group_size", f"granularity 'group' needs a positive integer group_size, got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise SpecError(
                "group_size", f"group_size is only valid with granularity 'group' (granularity is {self.granularity!r})"
            )
        self._check_block()
        if self.format == "nvfp4" and (self.granularity != "group" or self.group_size != NVFP4_BLOCK_SIZE):
            raise SpecError(
                "granularity",
                f"nvfp4 always uses blocks of {NVFP4_BLOCK_SIZE} (granularity 'group', group_size {NVFP4_BLOCK_SIZE}); "
                f"got granularity {self.granularity!r}, group_size {self.group_size!r}",
            )
        if self.format in MX_FORMATS and (self.granularity != "group" or self.group_size != MX_BLOCK_SIZE):
            raise SpecError(
                "granularity",
                f"{self.format} always uses blocks of {MX_BLOCK_SIZE} (granularity 'group', group_size {MX_BLOCK_SIZE}); "
                f"got granularity {self.granularity!r}, group_size {self.group_size!r}",
            )
        if not isinstance(self.symmetric, bool):
            raise SpecError("symmetric", f"symmetric must be true or false, got {self.symmetric!r}")
        if not isinstance(self.dynamic, bool):
            raise SpecError("dynamic", f"dynamic must be true or false, got {self.dynamic!r}")
        if self.granularity == "token" and not self.dynamic:
            raise SpecError(
                "granularity",
                "granularity 'token' takes each token's scale at run time: it needs dynamic = true (activations only)",
            )
        if self.dynamic and self.format == "nvfp4":
            raise SpecError(
                "dynamic",
                "nvfp4 block scales are always computed at run time; its global amax is calibrated (dynamic = false)",
            )
        if not self.symmetric:
            self._check_asymmetric()
        params = validate_observer(self.observer, dict(self.observer_params))
        object.__setattr__(self, "observer_params", params)

    def _check_block(self) -> None:
        if self.granularity != "block":
            if self.block_size is not None:
                raise SpecError(
                    "block_size",
                    f"block_size is only valid with granularity 'block' (granularity is {self.granularity!r})",
                )
            return
        size = self.block_size
        if not isinstance(size, (tuple, list)) or len(size) != 2 or not all(_is_int(v) and v >= 1 for v in size):
            raise SpecError(
                "block_size", f"granularity 'block' needs block_size = [rows, cols] (positive integers), got {size!r}"
            )
        object.__setattr__(self, "block_size", (int(size[0]), int(size[1])))
        if self.dynamic or not self.symmetric or self.format == "nvfp4":
            raise SpecError(
                "granularity",
                "granularity 'block' is for static symmetric int / fp8 weights (dynamic = false, symmetric = true)",
            )

    def _check_asymmetric(self) -> None:
        if not self.format.startswith("int"):
            raise SpecError(
                "symmetric", f"asymmetric quantization (symmetric = false) needs an int format, not {self.format!r}"
            )
        if self.dynamic:
            raise SpecError("symmetric", "asymmetric quantization is static only (dynamic = false)")
        if self.observer not in ASYMMETRIC_OBSERVERS:
            raise SpecError(
                "symmetric",
                f"asymmetric quantization is calibrated by the {' or '.join(map(repr, ASYMMETRIC_OBSERVERS))} "
                f"observer, not {self.observer!r}",
            )

    def __hash__(self) -> int:
        return hash(
            (
                self.format,
                self.granularity,
                self.axis,
                self.group_size,
                self.observer,
                tuple(sorted(self.observer_params.items())),
                self.symmetric,
                self.dynamic,
                self.block_size,
            )
        )

    @property
    def num_bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp8_e4m3": 8, "nvfp4": 4, "mxfp4": 4, "mxfp8": 8}[self.format]

    @property
    def type(self) -> str:
        """``"int"`` or ``"float"``, as compressed-tensors' ``QuantizationArgs.type``."""
        return "int" if self.format.startswith("int") else "float"

    @property
    def calibrated_granularity(self) -> str:
        """The granularity of the calibrated amax: per tensor for nvfp4 (its global scale), else ``granularity``."""
        return "tensor" if self.format == "nvfp4" else self.granularity

    def describe(self) -> str:
        """A short human description: ``int4, groups of 128, mse``, ``fp8_e4m3, per token, dynamic``."""
        if self.format == "nvfp4":
            where = "16-blocks"
        elif self.format in MX_FORMATS:
            where = "32-blocks (E8M0 scales)" + (" per token" if self.dynamic else "")
        elif self.granularity == "group":
            where = f"groups of {self.group_size}" + (" per token" if self.dynamic else "")
        elif self.granularity == "block":
            where = f"blocks of {self.block_size[0]} x {self.block_size[1]}"
        elif self.granularity == "channel":
            where = "per channel"
        else:
            where = f"per {self.granularity}"
        sym = "" if self.symmetric else "asymmetric, "
        return f"{self.format}, {where}, {sym}" + ("dynamic" if self.dynamic else self.observer)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` gives the spec back."""
        return {
            "format": self.format,
            "granularity": self.granularity,
            "axis": self.axis,
            "group_size": self.group_size,
            "observer": self.observer,
            "observer_params": dict(self.observer_params),
            "symmetric": self.symmetric,
            "dynamic": self.dynamic,
            **({"block_size": list(self.block_size)} if self.block_size is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizerSpec:
        data = dict(data)
        if data.get("block_size") is not None:
            data["block_size"] = tuple(data["block_size"])
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
