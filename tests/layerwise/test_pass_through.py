"""The stand-in layers a streamed transformers-class model's forward is recorded with (``PassThrough``)."""

from __future__ import annotations

import torch
from torch import nn

from shardcal.layerwise.inputs import PassThrough, stand_ins_for


class _Typed(nn.Module):
    """A decoder layer as transformers builds one: its type set per instance in ``__init__``."""

    kind = "decoder"

    def __init__(self, attention_type: str):
        super().__init__()
        self.attention_type = attention_type
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.proj(hidden_states)


def test_a_stand_in_passes_the_hidden_states_on_and_answers_for_its_layer():
    layer = _Typed("sliding_attention")
    stand_in = PassThrough(layer)
    h = torch.randn(2, 3, 4)
    assert stand_in(h, torch.ones(1)) is h
    assert stand_in(hidden_states=h, attention_mask=None) is h
    assert stand_in.attention_type == "sliding_attention"  # set on the instance, not the class
    assert stand_in.kind == "decoder" and stand_in.proj is layer.proj
    assert list(stand_in.parameters()) == []  # holds nothing of the layer: a streamed layer is not in memory


def test_each_stand_in_answers_for_its_own_layer():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    layers = nn.ModuleList(_Typed(t) for t in types)
    stand_ins = stand_ins_for(layers)
    assert [s.attention_type for s in stand_ins] == types
    assert [s.proj for s in stand_ins] == [layer.proj for layer in layers]
