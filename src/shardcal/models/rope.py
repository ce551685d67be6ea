"""Rotary position embeddings, computed once per forward by the model and handed to every decoder layer.

The inverse frequencies follow transformers' ``rope_type`` definitions (default, linear, dynamic NTK, llama3,
yarn; the 5.x semantics) so that a checkpoint gives the same logits as in transformers. They are recomputed
from the config on each call (``head_dim / 2`` numbers): no buffer to materialise after meta-device
construction, nothing for FSDP2 to shard, and no state carried from one forward to the next (transformers'
dynamic NTK caches the longest length seen; here every forward scales for its own length).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def _default_inv_freq(base: float | torch.Tensor, dim: int, device: torch.device | None) -> torch.Tensor:
    """``1 / base^(2i / dim)`` for ``i < dim / 2``, in float32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _linear_inv_freq(cfg: ModelConfig, device: torch.device | None) -> torch.Tensor:
    """Position interpolation: every frequency divided by ``factor``."""
    assert cfg.rope_scaling is not None
    return _default_inv_freq(cfg.rope_theta, cfg.head_dim, device) / cfg.rope_scaling["factor"]


def _dynamic_inv_freq(cfg: ModelConfig, seq_len: int, device: torch.device | None) -> torch.Tensor:
    """Dynamic NTK: past ``max_position_embeddings``, the base grows with the sequence length."""
    assert cfg.rope_scaling is not None
    factor, dim, max_positions = cfg.rope_scaling["factor"], cfg.head_dim, cfg.max_position_embeddings
    if seq_len <= max_positions:
        return _default_inv_freq(cfg.rope_theta, dim, device)
    # float32 arithmetic, as transformers does it (it computes from a tensor-valued sequence length).
    length = torch.tensor(seq_len, dtype=torch.float32, device=device)
    base = cfg.rope_theta * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim, device)


def _llama3_inv_freq(cfg: ModelConfig, device: torch.device | None) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth blend in between."""
    scaling = cfg.rope_scaling
    assert scaling is not None
    inv_freq = _default_inv_freq(cfg.rope_theta, cfg.head_dim, device)
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(cfg: ModelConfig, device: torch.device | None) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones (linear ramp between), scale attention."""
    scaling = cfg.rope_scaling
    assert scaling is not None
    base, dim = cfg.rope_theta, cfg.head_dim
    factor = scaling["factor"]
    original_max = scaling["original_max_position_embeddings"]

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
        """The dimension whose wavelength makes ``rotations`` turns over the original context."""
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def inverse_frequencies(
    cfg: ModelConfig, seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_scaling)`` for a sequence of ``seq_len`` positions.

    ``attention_scaling`` multiplies cos and sin (only YaRN has one other than 1).
    """
    rope_type = cfg.rope_scaling["rope_type"] if cfg.rope_scaling else "default"
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, device)
    if rope_type == "linear":
        return _linear_inv_freq(cfg, device), 1.0
    if rope_type == "dynamic":
        return _dynamic_inv_freq(cfg, seq_len, device), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(cfg, device), 1.0
    return _default_inv_freq(cfg.rope_theta, cfg.head_dim, device), 1.0


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` of shape ``[batch, seq, head_dim]`` for position ids ``[batch, seq]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = 0
        if self.cfg.rope_scaling and self.cfg.rope_scaling["rope_type"] == "dynamic" and position_ids.numel():
            seq_len = int(position_ids.max()) + 1  # only dynamic NTK depends on it (and this syncs a GPU)
        inv_freq, scaling = inverse_frequencies(self.cfg, seq_len, position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` of shape ``[batch, heads, seq, head_dim]`` by positions' ``cos``/``sin``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
