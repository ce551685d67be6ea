"""SmoothQuant's alpha grid and AWQ's scale search score candidate weights as vLLM will compute them: where vLLM
computes a fused layer's members with one range (fp8 per-tensor weights of q/k/v), the candidate's quantization uses
the members' largest range — checked against the searches written out here as plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from shardcal.algorithms.awq import AWQ
from shardcal.algorithms.mappings import layer_smoothings
from shardcal.algorithms.smoothquant import SmoothQuant, smoothing_scales
from shardcal.calib.attach import quantize_modules
from shardcal.calib.recipes import parse_recipe
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_TENSOR = '[weight]\nformat = "fp8_e4m3"\n[input]\nformat = "fp8_e4m3"\n'


def _attn_in(recipe_text: str, v_times: float = 8.0):
    """Layer 0's q/k/v smoothing pair, quantized as ``recipe_text`` says; v_proj ``v_times`` larger than q/k (a
    range of its own, as in real models)."""
    model = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=1)))
    randomize_(model, seed=0)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.self_attn.v_proj.weight.mul_(v_times)
    quantize_modules(layer, parse_recipe(recipe_text, "t.toml"), prefix="model.layers.0")
    (pair,) = layer_smoothings(layer, ("attn_in",), prefix="model.layers.0")
    return pair


def _fp8_qdq(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = amax / 448.0
    return torch.clamp(w / scale, -448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def _weight_amax(weights: list[torch.Tensor], shared: bool) -> list[torch.Tensor]:
    own = [w.abs().max() for w in weights]
    return [torch.stack(own).max()] * len(own) if shared else own


def _awq_by_hand(weights, h, x_mean, w_mean, grid: int, shared: bool) -> float:
    """AWQ's grid (its module docstring): the exponent r whose scaled, quantized, unscaled weights give the least
    output error summed over q/k/v."""
    best = (math.inf, -1.0)
    for i in range(-1, grid):
        r = i / grid
        s = torch.ones_like(x_mean) if i < 0 else (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        s = s / torch.sqrt(s.max() * s.min())
        scaled = [w * s[None, :] for w in weights]
        loss = 0.0
        for w, ws, amax in zip(weights, scaled, _weight_amax(scaled, shared), strict=True):
            e = _fp8_qdq(ws, amax) / s[None, :] - w
            loss += float(((e @ h) * e).sum(dtype=torch.float64))
        if loss < best[0]:
            best = (loss, r)
    return best[1]


def test_awq_search_scores_fp8_qkv_with_their_shared_range(monkeypatch):
    """Every candidate of AWQ's grid quantizes q, k and v with their largest range (recorded where AWQ quantizes),
    and the exponent chosen is the plain loop's."""
    from shardcal.algorithms import awq as awq_module

    pair = _attn_in(FP8_TENSOR)
    weights = [c.weight.detach().float() for c in pair.consumers]
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 4.0, 64)
    h, x_mean = x.T @ x, x.abs().mean(dim=0)
    w_mean = torch.cat([w.abs() / (w.abs().amax(dim=1, keepdim=True) + 1e-6) for w in weights]).mean(dim=0)
    calls = []
    real = awq_module._max_qdq
    monkeypatch.setattr(awq_module, "_max_qdq", lambda w, q, amax=None: calls.append((w, amax)) or real(w, q, amax))
    r, _ = AWQ({"grid": 20})._search(pair, h, x_mean)
    assert len(calls) == 21 * 3
    for k in range(0, len(calls), 3):
        top = torch.stack([w.abs().max() for w, _ in calls[k : k + 3]]).max()
        assert all(amax is not None and float(amax) == float(top) for _, amax in calls[k : k + 3])
    assert r == _awq_by_hand(weights, h, x_mean, w_mean, 20, shared=True)


def _smoothquant_by_hand(pair, act_max, w_max, samples, grid, shared: bool) -> list[list[float]]:
    """SmoothQuant's per-alpha losses (its module docstring): smoothed weights and inputs, both fp8 per tensor (the
    input's amax what a max observer would record), summed squared output error per batch."""
    weights = [c.weight.detach().float() for c in pair.consumers]
    out = []
    for alpha in grid:
        s = smoothing_scales(act_max, w_max, alpha)
        scaled = [w * s[None, :] for w in weights]
        amaxes = _weight_amax(scaled, shared)
        per_batch = [0.0] * len(samples)
        for w, ws, amax in zip(weights, scaled, amaxes, strict=True):
            wq = _fp8_qdq(ws, amax)
            for b, x in enumerate(samples):
                xq = _fp8_qdq(x / s[None, :], (act_max / s).max())
                per_batch[b] += float((xq @ wq.T - x @ w.T).double().pow(2).sum())
        out.append(per_batch)
    return out


def test_smoothquant_alpha_grid_scores_fp8_qkv_with_their_shared_range():
    pair = _attn_in(FP8_TENSOR)
    gen = torch.Generator().manual_seed(4)
    samples = [torch.randn(16, 64, generator=gen) * torch.linspace(0.1, 8.0, 64) for _ in range(2)]
    act_max = torch.stack([x.abs().amax(dim=0) for x in samples]).amax(dim=0)
    w_max = pair.weight_max()
    grid = [0.3, 0.6, 0.9]
    got = SmoothQuant({"alpha_grid": grid})._losses(pair, act_max, w_max, samples)
    want = _smoothquant_by_hand(pair, act_max, w_max, samples, grid, shared=True)
    flat = [v for row in got for v in row]
    assert flat == pytest.approx([v for row in want for v in row], rel=1e-6)
    unshared = _smoothquant_by_hand(pair, act_max, w_max, samples, grid, shared=False)
    assert flat != pytest.approx([v for row in unshared for v in row], rel=1e-3)


def test_per_channel_weights_keep_their_own_ranges_in_the_search():
    """int8 per-channel weights: vLLM keeps each row's scale, and so does the search."""
    pair = _attn_in('[weight]\nformat = "int8"\ngranularity = "channel"\naxis = 0\n[input]\nformat = "int8"\n')
    weights = [c.weight.detach().float() for c in pair.consumers]
    assert not pair.shares_weight_range(pair.consumers)
    for got, w in zip(pair.shared_weight_amax(pair.consumers, weights), weights, strict=True):
        assert torch.equal(got, w.abs().amax(dim=1, keepdim=True))
    fp8 = _attn_in(FP8_TENSOR)
    fp8_weights = [c.weight.detach().float() for c in fp8.consumers]
    assert fp8.shares_weight_range(fp8.consumers)
    top = torch.stack([w.abs().max() for w in fp8_weights]).max()
    assert all(float(a) == float(top) for a in fp8.shared_weight_amax(fp8.consumers, fp8_weights))
