"""Where a model's decoder layers live between their steps: the one question a resident and a streamed run answer
differently.

Resident (:class:`ResidentLayers`, every model by default): each rank holds its FSDP2 shard of every layer from
load to export, and a step gathers its layer (:func:`~shardcal.sharding.fsdp2.layer_unsharded`). Streamed (a
subclass set by :func:`shardcal.loading.streamed.load_streamed`): a layer's parameters exist only while it is held —
read from the checkpoint just before, released right after. :func:`shardcal.layer_steps` asks the model's residency
to hold each layer for its step; whatever must happen while a layer is still there (its export) happens before the
hold ends. The runner, the algorithms, resume and the
export call the same methods either way and do not know which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .fsdp2 import layer_unsharded

#: The attribute a model's residency is set on (absent: resident).
RESIDENCY_ATTR = "_shardcal_residency"


class ResidentLayers:
    """Every layer's parameters stay on every rank (sharded or whole); holding a layer gathers it."""

    streamed = False

    def held(self, index: int, layer: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """The layer, its full parameters present on every rank for the block (collective)."""
        return layer_unsharded(layer)


RESIDENT = ResidentLayers()


def residency_of(model: nn.Module) -> ResidentLayers:
    """The model's residency: the one :func:`shardcal.loading.streamed.load_streamed` set, else resident."""
    return getattr(model, RESIDENCY_ATTR, RESIDENT)


@contextlib.contextmanager
def held_layer(model: nn.Module, index: int, layer: nn.Module) -> Iterator[nn.Module]:
    """Hold decoder layer ``index`` of ``model`` for a step (collective): gathered, or read in, for the block."""
    with residency_of(model).held(index, layer) as module:
        yield module


@contextlib.contextmanager
def decoder_layers_replaced(model: nn.Module, layers: nn.ModuleList, replacement: nn.ModuleList) -> Iterator[None]:
    """``model`` with its decoder stack ``layers`` replaced by ``replacement`` for the block (put back after)."""
    parent, attr = next((m, n) for m in model.modules() for n, child in m.named_children() if child is layers)
    setattr(parent, attr, replacement)
    try:
        yield
    finally:
        setattr(parent, attr, layers)
