"""Rotary position embeddings, computed once per forward by the model and handed to every decoder layer.

The inverse frequencies follow Hugging Face's ``rope_type`` definitions (default, linear, dynamic NTK, llama3,
yarn) so that a checkpoint gives the same logits as in transformers. They are recomputed from the config on
each call (``head_dim / 2`` numbers): no buffer to materialise after meta-device construction, nothing for
FSDP2 to shard.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def _default_inv_freq(base: float, dim: int, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(cfg: ModelConfig, device: torch.device | None) -> tuple[torch.Tensor, float]:
    scaling = cfg.rope_scaling or {}
    base, dim = cfg.rope_theta, cfg.head_dim
    factor = scaling["factor"]
    if "original_max_position_embeddings" in scaling:
        original_max = scaling["original_max_position_embeddings"]
        factor = cfg.max_position_embeddings / original_max
    else:
        original_max = cfg.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def inverse_frequencies(cfg: ModelConfig, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_scaling)`` for a sequence of ``seq_len`` positions."""
    scaling = cfg.rope_scaling
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, device)
    base = cfg.rope_theta
    if rope_type == "dynamic":
        original_max = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
        if seq_len > original_max:
            dim = cfg.head_dim
            base = base * ((scaling["factor"] * seq_len / original_max) - (scaling["factor"] - 1)) ** (dim / (dim - 2))
    inv_freq = _default_inv_freq(base, cfg.head_dim, device)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` of shape ``[batch, seq, head_dim]`` for given position ids."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = int(position_ids.max()) + 1 if position_ids.numel() else 0
        inv_freq, scaling = inverse_frequencies(self.cfg, seq_len, position_ids.device)
        freqs = (inv_freq[None, :, None].float() @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` of shape ``[batch, heads, seq, head_dim]`` by positions' ``cos``/``sin``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
