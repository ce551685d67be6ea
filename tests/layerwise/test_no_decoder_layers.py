"""A model in which no registered layout finds decoder layers is refused the same way by every entry point.

``calibrate``, ``collect_activations``, ``layer_steps``, ``fsdp2_wrap`` and the preflight checks raise one
:class:`ModelLayoutError` (``shardcal.sharding.registry.no_decoder_layers``): one line naming the model's class and
how to register its layout. Registering the layout makes the same module usable.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardcal import LayerActivationCollector, calibrate, collect_activations, layer_steps
from shardcal.errors import ModelLayoutError
from shardcal.layerwise.batches import make_batches
from shardcal.plan.preflight import check_targets_fit
from shardcal.sharding.fsdp2 import fsdp2_wrap
from shardcal.sharding.registry import no_decoder_layers

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))


class Blocks(nn.Module):
    """Decoder layers where no built-in layout looks (``blocks``), so the registry finds none."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tokens(input_ids)
        for block in self.blocks:
            x = block(x)
        return x


ENTRY_POINTS = {
    "calibrate": lambda m: calibrate(m, IDS, "w8a8-int8", progress=False),
    "collect_activations": lambda m: collect_activations(m, IDS, "blocks.*:output", progress=False),
    "layer_steps": lambda m: next(iter(layer_steps(m, make_batches(IDS, batch_size=2)))),
    "fsdp2_wrap": fsdp2_wrap,
    "check_targets_fit": lambda m: check_targets_fit(m, []),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_raises_the_one_error(entry):
    model = Blocks()
    with pytest.raises(ModelLayoutError) as info:
        ENTRY_POINTS[entry](model)
    message = str(info.value)
    assert message == str(no_decoder_layers(model))
    assert message.startswith("Blocks: no decoder layers found") and "\n" not in message
    assert "shardcal.LayerActivationCollector.register_decoder_layer_support" in message


def test_registering_the_layout_is_the_fix():
    def predicate(m: nn.Module) -> bool:
        return isinstance(m, Blocks)

    def discoverer(m: nn.Module) -> nn.ModuleList:
        return m.blocks

    LayerActivationCollector.register_decoder_layer_support(predicate, discoverer)
    try:
        steps = list(layer_steps(Blocks(), make_batches(IDS, batch_size=2)))
    finally:
        LayerActivationCollector.unregister_decoder_layer_support(predicate, discoverer)
    assert [s.name for s in steps] == ["blocks.0", "blocks.1"]
