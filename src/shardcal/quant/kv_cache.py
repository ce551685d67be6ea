"""KV-cache quantization: per-tensor FP8 scales for the keys and values an attention layer caches.

An attention module computes its keys (after the rotary embedding and any q/k norm) and values, then hands them to
its cache as ``cache.update(key_states, value_states, layer_idx, ...)`` and attends over what the cache returns —
transformers' attention does this whenever a cache object is passed, and shardcal's own attention
(:mod:`shardcal.models.decoder`) does the same. :class:`KVCacheQuantizer` speaks that protocol: held by the attention
module as its ``kv_cache_quantizer`` child, it owns one :class:`~.quantizer.TensorQuantizer` for the keys and one for
the values and, passed as the layer's cache, returns them unchanged while observing (``collect``), fake-quantized
(``quantize``) or as they are (``disabled``). Nothing is patched or hooked: the runner passes the quantizer (a
per-batch view of it that knows the batch's padding mask) as the cache argument of each layer call.

Calibration is the quantizers' ordinary protocol (one amax per tensor, merged with MAX across ranks: exact), so the
KV quantizers calibrate, checkpoint and report like every other activation quantizer. Padding tokens are left out of
the statistics when the keys have the batch's ``[batch, heads, seq, head_dim]`` layout (or ``[batch, seq, ...]``).
The export writes ``<attention>.k_scale`` / ``<attention>.v_scale`` (``amax / 448``) and compressed-tensors'
``kv_cache_scheme``, which is what vLLM reads for an FP8 KV cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .quantizer import QuantMode, TensorQuantizer
from .spec import QuantizerSpec
from .tokens import real_tokens_of

#: The attribute an attention module holds its KV-cache quantizer under.
KV_CACHE_ATTR = "kv_cache_quantizer"
#: Projections that mark a module as an attention that computes keys and values (fused ``qkv_proj`` included).
KV_PROJECTIONS = ("k_proj", "v_proj", "qkv_proj", "kv_proj")
#: Forward arguments through which attention modules take a cache, newest name first.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def cache_argument(module: nn.Module) -> str | None:
    """The name of the cache argument of ``module.forward`` (``cache``, ``past_key_values`` or
    ``past_key_value``), or None when it takes none by name."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


def is_cached_attention(module: nn.Module) -> bool:
    """Duck typing: ``module`` has key/value projections and takes a cache argument (as compressed-tensors tests)."""
    return any(isinstance(getattr(module, p, None), nn.Linear) for p in KV_PROJECTIONS) and (
        cache_argument(module) is not None
    )


def attention_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(full name, module)`` of every cached attention under ``module`` (see :func:`is_cached_attention`)."""
    return [(n, m) for n, m in module.named_modules(prefix=prefix) if is_cached_attention(m)]


def _device(attention: nn.Module) -> torch.device:
    from torch.distributed.tensor import DTensor

    for p in attention.parameters():
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")


def _observed(x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` without its padding positions when the mask ``[batch, seq]`` lines up with dims (0, 2) or (0, 1)."""
    if token_mask is None or x.dim() < 3 or x.shape[0] != token_mask.shape[0]:
        return x
    mask = token_mask.to(device=x.device, dtype=torch.bool)
    if x.dim() == 4 and x.shape[2] == mask.shape[1]:  # [batch, heads, seq, head_dim]
        return x.transpose(1, 2)[mask]
    if x.shape[1] == mask.shape[1]:  # [batch, seq, ...]
        return x[mask]
    return x


class KVCacheQuantizer(nn.Module):
    """Per-tensor fake quantization of one attention layer's cached keys and values (see the module docstring).

    ``k_quantizer`` and ``v_quantizer`` are :class:`TensorQuantizer` s of ``spec`` (per tensor, static); their
    ``amax`` buffers are the calibrated ranges, so ``k_scale = amax / 448`` for FP8. :meth:`update` is the cache
    protocol; :meth:`for_batch` gives a view that leaves the batch's padding out of the statistics.
    """

    def __init__(self, spec: QuantizerSpec, device: torch.device | str | None = None, name: str = "kv_cache"):
        super().__init__()
        self.name = name
        self.k_quantizer = TensorQuantizer(spec, None, device=device, name=f"{name}.k_quantizer")
        self.v_quantizer = TensorQuantizer(spec, None, device=device, name=f"{name}.v_quantizer")

    @property
    def spec(self) -> QuantizerSpec:
        return self.k_quantizer.spec

    def quantize(
        self, key_states: torch.Tensor, value_states: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values through their quantizers; while observing, ``token_mask`` leaves padding out."""
        out = []
        for q, x in ((self.k_quantizer, key_states), (self.v_quantizer, value_states)):
            if q.mode is QuantMode.COLLECT:
                with real_tokens_of(None):  # the real positions are chosen here (keys are [batch, heads, seq, ...])
                    q(_observed(x, token_mask))
                out.append(x)
            else:
                out.append(q(x))
        return out[0], out[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: Any = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache protocol (``cache.update(key_states, value_states, layer_idx, ...)``): nothing is kept."""
        return self.quantize(key_states, value_states)

    def for_batch(self, token_mask: torch.Tensor | None) -> KVCacheView:
        """A cache object for one batch: :meth:`update` with the batch's padding mask ``[batch, seq]``."""
        return KVCacheView(self, token_mask)

    def export_scales(self) -> dict[str, torch.Tensor]:
        """``{"k_scale", "v_scale"}``: float32 ``[1]``, ``amax / qmax`` of the calibrated ranges."""
        return {f"{role}_scale": q.export_scales()["scale"].reshape(1) for role, q in self._roles()}

    def _roles(self) -> list[tuple[str, TensorQuantizer]]:
        return [("k", self.k_quantizer), ("v", self.v_quantizer)]


class KVCacheView:
    """One batch's cache argument: :meth:`KVCacheQuantizer.update` with that batch's padding mask."""

    def __init__(self, owner: KVCacheQuantizer, token_mask: torch.Tensor | None):
        self.owner = owner
        self.token_mask = token_mask

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: Any = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.quantize(key_states, value_states, self.token_mask)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Nothing is cached (what a cache reports before its first update)."""
        return 0


def kv_cache_attentions(module: nn.Module, prefix: str = "", select: Any = None) -> list[tuple[str, nn.Module]]:
    """``(full name, module)`` of the cached attentions under ``module`` that a ``[kv_cache]`` quantizes: those
    whose full name ``select`` accepts (every one when None)."""
    return [(n, m) for n, m in attention_modules(module, prefix) if select is None or select(n)]


def attach_kv_cache_quantizers(
    module: nn.Module, spec: QuantizerSpec, prefix: str = "", select: Any = None
) -> list[str]:
    """Give every cached attention under ``module`` (whose full name ``select`` accepts, if given) a
    :class:`KVCacheQuantizer` of ``spec`` as its ``kv_cache_quantizer``; return their names. Idempotent."""
    names = []
    for name, attention in kv_cache_attentions(module, prefix, select):
        if not isinstance(getattr(attention, KV_CACHE_ATTR, None), KVCacheQuantizer):
            setattr(attention, KV_CACHE_ATTR, KVCacheQuantizer(spec, _device(attention), f"{name}.{KV_CACHE_ATTR}"))
        names.append(name)
    return names


def kv_cache_quantizers(module: nn.Module, prefix: str = "") -> list[tuple[str, KVCacheQuantizer]]:
    """``(attention name, its KVCacheQuantizer)`` for every attention under ``module`` that has one."""
    return [
        (n, m.get_submodule(KV_CACHE_ATTR))
        for n, m in module.named_modules(prefix=prefix)
        if isinstance(getattr(m, KV_CACHE_ATTR, None), KVCacheQuantizer)
    ]
