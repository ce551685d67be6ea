"""Fused-experts layouts: found from shapes, flags, the module's gate function and, where nothing names the split,
from the module's own forward on a probe input; per-expert slices equal what the forward uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardcal.errors import ModelLayoutError
from shardcal.quant.expert_layout import (
    ExpertsLayout,
    bias_slice,
    expert_forward,
    fused_experts_layout,
    probe_layout,
    weight_slice,
)

E, H, I = 3, 8, 4  # noqa: E741


class _Experts(nn.Module):
    """Fused experts with no flags and no gate function: only the forward says how gate and up are laid out."""

    def __init__(self, transposed: bool, interleaved: bool, biased: bool, swap: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.transposed, self.interleaved, self.swap = transposed, interleaved, swap
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) if transposed else torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, I, H) if transposed else torch.randn(E, H, I))
        if biased:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I))
            self.down_proj_bias = nn.Parameter(torch.randn(E, H))
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.where(index == e)
            h = x[rows] @ self.gate_up_proj[e] if self.transposed else x[rows] @ self.gate_up_proj[e].T
            if hasattr(self, "gate_up_proj_bias"):
                h = h + self.gate_up_proj_bias[e]
            gate, up = (h[:, ::2], h[:, 1::2]) if self.interleaved else h.chunk(2, dim=-1)
            if self.swap:  # up first: a layout shardcal does not know
                gate, up = up, gate
            y = self.act_fn(gate) * up
            y = y @ self.down_proj[e] if self.transposed else y @ self.down_proj[e].T
            if hasattr(self, "down_proj_bias"):
                y = y + self.down_proj_bias[e]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_the_forward_decides_the_split_and_slices_reproduce_it(transposed, interleaved, biased):
    module = _Experts(transposed, interleaved, biased)
    structural = fused_experts_layout(module, "experts")
    assert structural == ExpertsLayout(
        experts=E, hidden=H, inter=I, transposed=transposed, interleaved=False, biased=biased
    )  # nothing names the split: halves
    layout = probe_layout(module, "experts")
    assert layout == ExpertsLayout(
        experts=E, hidden=H, inter=I, transposed=transposed, interleaved=interleaved, biased=biased
    )
    assert fused_experts_layout(module, "experts") == layout  # kept
    x = torch.randn(5, H)
    index = torch.full((5, 1), 2)
    with torch.no_grad():
        torch.testing.assert_close(module(x, index, torch.ones(5, 1)), expert_forward(module, 2, x))
    assert weight_slice(module, 1, "down_proj").shape == (H, I) and weight_slice(module, 1, "gate_proj").shape == (I, H)
    assert (bias_slice(module, 1, "up_proj") is not None) == biased


def test_a_forward_no_layout_reproduces_is_refused_naming_the_module():
    with pytest.raises(ModelLayoutError, match=r"^layers\.0\.mlp\.experts: a fused-experts layout shardcal does not"):
        probe_layout(_Experts(False, False, False, swap=True), "layers.0.mlp.experts")


def test_the_gate_function_names_the_split_without_the_weights():
    """GPT-OSS's own ``_apply_gate`` (interleaved, clamped) on a module with its flags removed and meta weights."""
    pytest.importorskip("transformers")
    import transformers

    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E)
    with torch.device("meta"):
        experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    for flag in ("is_transposed", "is_concatenated"):
        delattr(experts, flag)
    assert fused_experts_layout(experts, "experts") == ExpertsLayout(
        experts=E, hidden=H, inter=I, transposed=True, interleaved=True, biased=True
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I), "gate_up_proj_bias": (E, 2 * I)}, "parameters"),
        ({"gate_up_proj": (E, 3 * I, H), "down_proj": (E, H, I)}, "gate_up_proj [3, 12, 8] and down_proj [3, 8, 4]"),
        (
            {
                "gate_up_proj": (E, 2 * I, H),
                "down_proj": (E, H, I),
                "gate_up_proj_bias": (E, I),
                "down_proj_bias": (E, H),
            },
            "gate_up_proj_bias [3, 4]",
        ),
    ],
)
def test_unknown_layouts_get_one_line_errors(params, message):
    module = nn.Module()
    for name, shape in params.items():
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    module.act_fn = F.silu
    with pytest.raises(ModelLayoutError) as info:
        fused_experts_layout(module, "model.layers.3.mlp.experts")
    text = str(info.value)
    assert (
        text.startswith("model.layers.3.mlp.experts: a fused-experts layout") and message in text and "\n" not in text
    )
    assert fused_experts_layout(module, "x", strict=False) is None
