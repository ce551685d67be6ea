"""What an algorithm's memory model sees and returns: one decoder layer's quantized Linears and foldable pairs, as
plain data from the planner (:mod:`shardcal.plan`), and the bytes the algorithm holds on one rank while it runs.

Each algorithm class states its own model as the classmethod ``planned_memory(context, params) ->
AlgorithmMemory`` (round to nearest: nothing). The planner refuses an algorithm whose class does not define one
itself (:func:`memory_model_of`): a user-registered algorithm is never planned at zero by inheritance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..quant.formats import FORMATS
from ..quant.spec import QuantizerSpec

#: An exact sum (:class:`~.stats.ExactSum`): two float64 limbs per element.
EXACT_SUM_BYTES = 16
#: Accumulating one batch's Gram matrix into an exact sum: the float32 product and two float64 terms.
GRAM_ADD_BYTES = 20


@dataclass(frozen=True)
class PlannedLinear:
    """A Linear of the layer that the recipe quantizes: its name, sizes and the specs of its quantizers (None:
    that role is not quantized)."""

    name: str
    in_features: int
    out_features: int
    weight: QuantizerSpec | None
    input: QuantizerSpec | None
    #: The Hadamard block rotating its inputs (a recipe's ``[rotation]``), or None.
    rotation: int | None = None

    @property
    def static_int_or_fp8_weight(self) -> bool:
        """Whether the weight has a static int or fp8 quantizer (what AWQ's search and clipping take)."""
        w = self.weight
        return w is not None and FORMATS[w.format].kind in ("int", "fp8") and not w.dynamic


@dataclass(frozen=True)
class PlannedSmoothing:
    """A foldable pair of the layer (:mod:`.mappings`): its kind, the channel count its statistics have, and the
    names of the Linears that consume it."""

    kind: str
    dim: int
    consumers: tuple[str, ...]


@dataclass(frozen=True)
class LayerPlanContext:
    """One decoder layer as the planner sees it, on one rank: the quantized Linears (module order), every foldable
    pair of every kind (filter by kind), the run's world size, this rank, its number of batches and their size."""

    layer: int
    linears: tuple[PlannedLinear, ...]
    smoothings: tuple[PlannedSmoothing, ...]
    world_size: int
    rank: int
    local_batches: int
    #: This rank's tokens (its batches' rows x sequence length), the model's hidden size, and the largest live
    #: intermediates of one batch's forward through the layer (bytes; the planner's forward model).
    local_tokens: int = 0
    hidden_size: int = 0
    batch_forward: int = 0

    def smoothings_of(self, kinds: tuple[str, ...]) -> list[PlannedSmoothing]:
        """The pairs of the given kinds, in layer order."""
        return [s for s in self.smoothings if s.kind in kinds]

    def linear(self, name: str) -> PlannedLinear | None:
        """The quantized Linear called ``name`` (None: the recipe does not quantize it)."""
        return next((lin for lin in self.linears if lin.name == name), None)


@dataclass
class AlgorithmMemory:
    """One layer's algorithm memory on one rank: the peak while statistics are collected (``collect``, beside one
    batch's forward), merged across ranks (``merge``: one flat buffer beside them), and used (``solve``), and what
    is still alive while the weight scales are calibrated (``held``: AWQ's clip Hessians)."""

    name: str
    collect: int = 0
    merge: int = 0
    solve: int = 0
    held: int = 0

    @property
    def peak(self) -> int:
        return max(self.collect, self.merge, self.solve)


MemoryModel = Callable[[LayerPlanContext, Mapping[str, Any]], AlgorithmMemory]


def memory_model_of(cls: type) -> MemoryModel | None:
    """``cls.planned_memory`` when ``cls`` defines it itself (not inherited), else None."""
    if "planned_memory" not in vars(cls):
        return None
    return cls.planned_memory
