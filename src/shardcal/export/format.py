"""Export formats: what the streaming export asks of a checkpoint format, and the registry of the formats it writes.

The shared export code (:mod:`.layout`, :mod:`.export`, :mod:`.shards`) decides which tensor goes where and streams
them into safetensors shards; everything that depends on the checkpoint format comes from one
:class:`ExportFormat` object: which quantizer specs it can store, the tensors (names, dtypes, shapes) one quantized
Linear becomes, how they are encoded, and the config dict written into ``config.json``. The planner
(:mod:`shardcal.plan.planner`) asks the same object for the sizes of the tensors before anything is loaded.

``compressed-tensors`` (:mod:`.compressed_tensors`) is the one format today.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ExportError
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import QuantizerSpec

#: The format ``export_checkpoint`` and ``shardcal calibrate`` write unless told otherwise.
DEFAULT_FORMAT = "compressed-tensors"

#: ``(weight spec, input spec or None, module format)``: the scheme of a group of quantized Linears.
SchemeKey = tuple[QuantizerSpec, QuantizerSpec | None, str]


@runtime_checkable
class ExportFormat(Protocol):
    """A checkpoint format the streaming export writes (one object per format, stateless).

    - ``name``: what ``format=`` / ``--format`` take; ``config_key``: the ``config.json`` key its config goes under.
    - ``check_spec(spec, role)``: raise :class:`ValueError` (the reason) when a ``"weight"``, ``"input"`` or
      ``"kv_cache"`` quantizer cannot be stored.
    - ``module_format(weight, input)``: how one quantized Linear with these specs is stored (a name of the format's
      own, e.g. compressed-tensors' ``int-quantized``), handed back to the two calls below.
    - ``module_tensors(module_format, weight, input, out_features, in_features, input_rotation)``:
      ``{suffix: (dtype, shape)}`` of the tensors the module's ``weight`` becomes (``weight_scale``, ...; names
      relative to the module), with what its input rotation stores (``input_rotation``: the Hadamard block, or None).
    - ``encode_module(module_format, weight_quantizer, weight, input_quantizer, input_rotation)``: those tensors,
      encoded from the full (gathered) weight and the calibrated quantizers.
    - ``config(schemes, ignore, kv_cache, rotations)``: the config dict written under ``config_key``, from the
      quantized modules' names per scheme, the Linear-like modules left unquantized, the KV-cache spec (or None)
      and the rotated modules (name -> Hadamard block).
    """

    name: str
    config_key: str

    def check_spec(self, spec: QuantizerSpec, role: str) -> None: ...

    def module_format(self, weight: QuantizerSpec, input: QuantizerSpec | None) -> str: ...

    def module_tensors(
        self,
        module_format: str,
        weight: QuantizerSpec,
        input: QuantizerSpec | None,
        out_features: int,
        in_features: int,
        input_rotation: int | None = None,
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]: ...

    def encode_module(
        self,
        module_format: str,
        weight_quantizer: TensorQuantizer,
        weight: torch.Tensor,
        input_quantizer: TensorQuantizer | None,
        input_rotation: int | None = None,
    ) -> dict[str, torch.Tensor]: ...

    def config(
        self,
        schemes: Mapping[SchemeKey, list[str]],
        ignore: list[str],
        kv_cache: QuantizerSpec | None,
        rotations: Mapping[str, int] | None = None,
    ) -> dict[str, Any]: ...


def formats() -> dict[str, ExportFormat]:
    """Every export format by name (``"compressed-tensors"`` today), in the order ``--help`` lists them."""
    from .compressed_tensors.format import COMPRESSED_TENSORS

    return {COMPRESSED_TENSORS.name: COMPRESSED_TENSORS}


def get_format(fmt: str | ExportFormat | None = None, what: str = "format") -> ExportFormat:
    """The export format named ``fmt`` (None: :data:`DEFAULT_FORMAT`; an :class:`ExportFormat` object is returned as
    it is). An unknown name is an :class:`~shardcal.errors.ExportError` naming ``what`` (the argument: ``format``,
    ``--format``) and the known ones."""
    if fmt is None:
        fmt = DEFAULT_FORMAT
    if not isinstance(fmt, str):
        if isinstance(fmt, ExportFormat):
            return fmt
        raise ExportError(f"{what}: expected a format name or an ExportFormat, got {type(fmt).__name__}")
    known = formats()
    if fmt not in known:
        raise ExportError(f"{what} {fmt!r}: unknown export format (known: {', '.join(known)})")
    return known[fmt]


def module_sizes(
    fmt: ExportFormat,
    module_format: str,
    weight: QuantizerSpec,
    input: QuantizerSpec | None,
    out_features: int,
    in_features: int,
    input_rotation: int | None = None,
) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """``{suffix: (dtype, shape, bytes)}`` of the tensors one quantized Linear becomes in ``fmt``, its input
    rotation's (``input_rotation``: the Hadamard block, or None) included: what the export plan writes and the
    planner counts."""
    layout = fmt.module_tensors(module_format, weight, input, out_features, in_features, input_rotation)
    return {suffix: (dtype, shape, math.prod(shape) * dtype.itemsize) for suffix, (dtype, shape) in layout.items()}
