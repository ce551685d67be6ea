"""Where per-channel scales can be folded in a decoder layer without changing its function (SmoothQuant, AWQ).

A :class:`Smoothing` is a producer whose output channels can be divided by ``s`` and the Linears that consume that
output, whose input columns are multiplied by ``s`` to compensate. In our decoder layer (and any layer with the
same module names) there are four kinds:

============  =======================================  ==================================================
kind          producer (divided by ``s``)               consumers (input columns times ``s``)
============  =======================================  ==================================================
``attn_in``   ``input_layernorm`` weight                ``q_proj``, ``k_proj``, ``v_proj``
``mlp_in``    ``post_attention_layernorm`` weight       ``gate_proj``, ``up_proj`` — for a sparse MoE block
                                                         every expert's gate/up (``w1``/``w3``), the shared
                                                         expert's, and the unquantized router ``gate`` and
                                                         ``shared_expert_gate`` (they read the same output)
``v_o``       ``v_proj`` output rows (and bias)         ``o_proj``
``up_down``   ``up_proj`` output rows (and bias)        ``down_proj`` (per expert in an MoE block)
============  =======================================  ==================================================

``v_o``: attention is linear in V (the softmax weights do not depend on it), so scaling V's channel ``(g, d)``
(kv head ``g``, dim ``d``) scales ``o_proj``'s input channel ``j = h * head_dim + d`` of every query head ``h``
that reads kv head ``g`` (``g = h // (num_heads / num_kv_heads)``, the ``repeat_interleave`` of GQA). One scale per
V channel is therefore shared by the ``num_heads / num_kv_heads`` o_proj columns it feeds: the statistics of those
columns are combined (max of maxima, mean of means). ``up_down``: ``act(gate(x)) * up(x)`` is linear in
``up(x)``'s channels, so dividing up's rows scales down_proj's inputs channel by channel.

Only normalisation producers are used whose output is ``(c + w) * norm(x) [+ b]`` with ``c`` 0 (RMSNorm, LayerNorm)
or 1 (Gemma's norms: ``c + w`` is divided by ``s``); a layer with other names is skipped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.decoder import RMSNorm
from ..quant.fused import range_groups, shared_amax
from ..quant.linear import QuantLinear, scale_input_columns_, unrotated_weight
from ..quant.spec import QuantizerSpec

KINDS = ("attn_in", "mlp_in", "v_o", "up_down")


def _is_norm(module: nn.Module | None) -> bool:
    """A normalisation a scale can be folded into (see :func:`norm_offset`)."""
    return norm_offset(module) is not None


#: The weight offsets a norm may compute with: ``w * f(x)`` (Llama, LayerNorm) and ``(1 + w) * f(x)`` (Gemma).
NORM_OFFSETS = (0.0, 1.0)


def norm_offset(module: nn.Module | None) -> float | None:
    """``c`` when ``module`` is a normalisation whose output is ``(c + weight) * f(x) [+ bias]``, ``c`` in
    :data:`NORM_OFFSETS` — what folding a scale into it needs — else None.

    Duck typed: a 1-D ``weight`` (and optional 1-D ``bias``) and nothing else of its own, and the output scales with
    ``c + weight`` (probed on a tiny input: doubling ``c + weight`` doubles ``output - bias``). Gemma's
    ``x * (1 + weight)`` norms have ``c = 1``.
    """
    if module is None:
        return None
    if isinstance(module, (RMSNorm, nn.LayerNorm)):
        return 0.0 if getattr(module, "weight", None) is not None else None
    own = dict(module.named_parameters(recurse=False))
    weight, bias = own.get("weight"), own.get("bias")
    if weight is None or weight.dim() != 1 or set(own) - {"weight", "bias"} or any(True for _ in module.children()):
        return None
    if bias is not None and bias.shape != weight.shape:
        return None
    return next((c for c in NORM_OFFSETS if _scales_with_weight(module, weight, bias, c)), None)


@torch.no_grad()
def _scales_with_weight(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, offset: float) -> bool:
    if weight.is_meta:  # a skeleton (the planner): probe a CPU copy with unit weights and zero bias
        module = copy.deepcopy(module).to_empty(device="cpu")
        weight = module.weight.fill_(1.0)
        bias = module.bias.zero_() if bias is not None else None
    elif weight.dtype != torch.float32:  # the formula, not the dtype's rounding of 2 w + c, is what is probed
        module = copy.deepcopy(module).float()
        weight, bias = module.weight, module.bias if bias is not None else None
    x = torch.linspace(-1.0, 1.0, 2 * weight.shape[0], device=weight.device).reshape(2, -1).to(weight.dtype)
    saved = weight.detach().clone()
    try:
        base = 0.0 if bias is None else bias.detach()
        first = module(x) - base
        weight.mul_(2.0).add_(offset)  # c + w' = 2 (c + w)
        second = module(x) - base
    except Exception:
        return False
    finally:
        weight.copy_(saved)
    return bool(torch.allclose(second, 2.0 * first, rtol=1e-3, atol=1e-6)) and bool(first.abs().sum() > 0)


@dataclass(kw_only=True)
class Smoothing:
    """One foldable (producer, consumers) pair; see the module docstring."""

    kind: str
    key: str
    source: nn.Module
    consumers: list[nn.Linear]
    point: tuple[nn.Module, str]  # where the consumers' input statistics are captured
    index: torch.Tensor | None = None  # consumer input channel -> producer channel (v_o); None: identity
    #: The consumers' module names (as ``consumers``), which say which of them vLLM fuses into one layer.
    consumer_names: list[str] = field(default_factory=list)
    #: The producer's :func:`norm_offset` (None: a Linear), probed once.
    offset: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.offset = norm_offset(self.source)

    @property
    def source_is_norm(self) -> bool:
        return self.offset is not None

    @property
    def dim(self) -> int:
        """Number of producer channels (scales)."""
        return int(self.source.weight.shape[0])

    def quantized(self, role: str) -> list[nn.Linear]:
        """Consumers with a ``role`` (``weight`` / ``input``) quantizer."""
        return [c for c in self.consumers if isinstance(c, QuantLinear) and getattr(c, f"{role}_quantizer") is not None]

    def shares_weight_range(self, consumers: list[nn.Linear]) -> bool:
        """Whether vLLM computes some of ``consumers``' weights with one range (members of one fused layer with
        nvfp4 or fp8 per-tensor weights: :func:`shardcal.quant.fused.range_groups`)."""
        return bool(range_groups(self._weight_specs(consumers), "weight"))

    def shared_weight_amax(self, consumers: list[nn.Linear], weights: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per consumer, the max amax of ``weights`` (its candidate weight; None without a weight quantizer), the
        largest of a fused layer's where vLLM computes its members with one range — what a search over candidate
        scales must quantize with to score what vLLM will compute."""
        names = dict(zip(map(id, self.consumers), self.consumer_names, strict=True))
        amax = {
            names[id(c)]: c.weight_quantizer.layout.amax_of(w)
            for c, w in zip(consumers, weights, strict=True)
            if getattr(c, "weight_quantizer", None) is not None
        }
        shared = shared_amax(amax, self._weight_specs(consumers), "weight")
        return [shared.get(names[id(c)]) for c in consumers]

    def _weight_specs(self, consumers: list[nn.Linear]) -> dict[str, QuantizerSpec]:
        names = dict(zip(map(id, self.consumers), self.consumer_names, strict=True))
        return {
            names[id(c)]: c.weight_quantizer.spec for c in consumers if getattr(c, "weight_quantizer", None) is not None
        }

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Per-producer-channel values as per-consumer-input-channel values."""
        return s if self.index is None else s[self.index.to(s.device)]

    def reduce(self, per_input: torch.Tensor, how: str) -> torch.Tensor:
        """Per-consumer-input-channel statistics combined per producer channel (``how``: ``max`` or ``mean``)."""
        if self.index is None:
            return per_input
        index = self.index.to(per_input.device)
        out = torch.zeros(self.dim, dtype=per_input.dtype, device=per_input.device)
        if how == "max":
            return out.scatter_reduce(0, index, per_input, reduce="amax", include_self=True)
        return out.scatter_reduce(0, index, per_input, reduce="mean", include_self=False)

    def weight_max(self, consumers: list[nn.Linear] | None = None) -> torch.Tensor:
        """Per producer channel: max |w| over the (quantized) consumers' input columns (float32)."""
        consumers = consumers if consumers is not None else self.consumers
        col = torch.stack([unrotated_weight(c).abs().amax(dim=0).float() for c in consumers]).amax(dim=0)
        return self.reduce(col, "max")

    @torch.no_grad()
    def stored_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The scales a fold of ``s`` applies, so that the folded producer survives being stored in 16 bits.

        A norm computing ``(c + w) f(x)`` with ``c = 1`` (Gemma) gets ``(c + w) / s`` as ``c + w'``: when the model
        or its export keeps ``w'`` in bfloat16, a large ``s`` leaves ``w'`` near ``-c`` and ``c + w'`` loses most
        of its digits (cancellation; a Gemma AWQ export stored in bf16 lost a third of its quality to it). So
        ``w'`` is taken as a bfloat16 number (exact in float16 and float32 too), and the consumers get the scales
        that stored multiplier implies, ``(c + w) / (c + w')``: the layer keeps its function exactly in any of
        those dtypes. A channel whose stored multiplier would vanish or change sign is not scaled. Every other
        producer keeps ``w / s`` to its dtype's relative precision: ``s`` itself. What :meth:`fold` applies, and
        what a search over scales must score."""
        if not self.source_is_norm or not self.offset:
            return s
        c, w = self.offset, self.source.weight.detach().float().to(s.device)
        target = (c + w) / s
        kept = c + _as_bfloat16(target - c)
        usable = (kept * target > 0) & (s != 1)  # a scale of 1 leaves the channel as it is
        return torch.where(usable, (c + w) / torch.where(usable, kept, torch.ones_like(kept)), torch.ones_like(s))

    @torch.no_grad()
    def fold(self, s: torch.Tensor) -> torch.Tensor:
        """Divide the producer's channels by ``s`` and multiply the consumers' input columns by it (in place; a
        consumer that rotates its inputs gets ``(W diag(s)) H``); returns the scales applied: ``s`` as the producer
        stores it (:meth:`stored_scales`)."""
        s = self.stored_scales(s.float())
        src = self.source
        if self.source_is_norm:
            c, inv = self.offset, 1.0 / s.to(src.weight.device)
            w = src.weight.float()
            folded = _as_bfloat16((w + c) * inv - c) if c else w * inv  # c + w -> (c + w) / s, as stored_scales kept it
            src.weight.copy_(torch.where(s.to(w.device) == 1, w, folded).to(src.weight.dtype))  # unscaled: untouched
            if getattr(src, "bias", None) is not None:
                _scale_(src.bias, 1.0 / s.to(src.bias.device))
        else:
            _scale_(src.weight, (1.0 / s.to(src.weight.device))[:, None])
            if src.bias is not None:
                _scale_(src.bias, 1.0 / s.to(src.bias.device))
        cols = self.expand(s)
        for c in self.consumers:
            scale_input_columns_(c, cols.to(c.weight.device))
        return s


def _as_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest bfloat16 number, in float32."""
    return x.to(torch.bfloat16).float()


def _scale_(p: torch.Tensor, factor: torch.Tensor) -> None:
    p.copy_((p.float() * factor).to(p.dtype))


def _mlp_pair(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """``(gate, up, down)`` of a gated MLP (``gate_proj/up_proj/down_proj`` or Mixtral's ``w1/w3/w2``)."""
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        mods = [getattr(mlp, n, None) for n in names]
        if all(isinstance(m, nn.Linear) for m in mods):
            return mods[0], mods[1], mods[2]
    return None


def _attention_shape(attn: nn.Module) -> tuple[object, object, object]:
    """``(heads, kv heads, head_dim)``: shardcal's attribute names, or transformers' (``config``,
    ``num_key_value_groups``)."""
    heads, kv_heads, head_dim = (getattr(attn, n, None) for n in ("num_heads", "num_kv_heads", "head_dim"))
    config = getattr(attn, "config", None)
    if heads is None:
        heads = getattr(config, "num_attention_heads", None)
    if kv_heads is None:
        groups = getattr(attn, "num_key_value_groups", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or (heads // groups if heads and groups else None)
    return heads, kv_heads, head_dim


def _v_o_index(attn: nn.Module) -> torch.Tensor | None:
    heads, kv_heads, head_dim = _attention_shape(attn)
    v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads, head_dim)) or heads % kv_heads:
        return None
    if not isinstance(v, nn.Linear) or not isinstance(o, nn.Linear):
        return None
    if v.out_features != kv_heads * head_dim or o.in_features != heads * head_dim:
        return None
    j = torch.arange(o.in_features)
    return (j // head_dim) // (heads // kv_heads) * head_dim + j % head_dim


def warn_no_pairs(algorithm: str, layer_name: str, warned: set[str]) -> None:
    """Warn once per algorithm instance that a layer with quantized Linears offers no foldable pair."""
    if "no_pairs" not in warned:
        warned.add("no_pairs")
        import warnings

        warnings.warn(
            f"{algorithm}: {layer_name} has no foldable (norm or projection -> Linear) pair with our module names "
            "(input_layernorm, self_attn.q/k/v/o_proj, post_attention_layernorm, mlp.gate/up/down_proj); "
            f"{algorithm} leaves such layers as they are",
            stacklevel=3,
        )


def layer_smoothings(
    layer: nn.Module, kinds: tuple[str, ...] = KINDS, prefix: str = "", rotated_consumers: bool = False
) -> list[Smoothing]:
    """The foldable pairs of ``layer`` of the given kinds, in the order attn_in, v_o, mlp_in, up_down. A pair whose
    consumers rotate their inputs (a recipe's ``[rotation]``) is left out unless ``rotated_consumers``: its scales
    then apply to the inputs before their rotation (:meth:`Smoothing.fold`), which the caller's statistics must
    see unrotated (``InputStats(..., rotated=False)``)."""
    found = _layer_smoothings(layer, kinds, prefix)
    return found if rotated_consumers else [s for s in found if not any(_rotates(c) for c in s.consumers)]


def _rotates(linear: nn.Module) -> bool:
    return getattr(linear, "input_rotation", None) is not None


def _smoothing(
    kind: str,
    names: dict[int, str],
    source: nn.Module,
    consumers: list[nn.Linear],
    point: tuple[nn.Module, str],
    index: torch.Tensor | None = None,
) -> Smoothing:
    """A :class:`Smoothing` keyed by its producer's name, with its consumers' names."""
    return Smoothing(
        kind=kind,
        key=names[id(source)],
        source=source,
        consumers=consumers,
        point=point,
        index=index,
        consumer_names=[names[id(c)] for c in consumers],
    )


def _layer_smoothings(layer: nn.Module, kinds: tuple[str, ...], prefix: str) -> list[Smoothing]:
    out: list[Smoothing] = []
    names = {id(m): n for n, m in layer.named_modules(prefix=prefix)}
    attn = getattr(layer, "self_attn", None)
    norm1 = getattr(layer, "input_layernorm", None)
    if attn is not None:
        qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(m, nn.Linear) for m in qkv):
            qkv = [getattr(attn, "qkv_proj", None)]  # fused (Phi-3)
        if "attn_in" in kinds and all(isinstance(m, nn.Linear) for m in qkv) and _is_norm(norm1):
            out.append(_smoothing("attn_in", names, norm1, qkv, (norm1, "output")))
        index = _v_o_index(attn)
        if "v_o" in kinds and index is not None:
            out.append(_smoothing("v_o", names, attn.v_proj, [attn.o_proj], (attn.o_proj, "input"), index))
    ff = getattr(layer, "feed_forward", None)
    if ff is None:
        ff = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    # The norm that feeds the MLP: Gemma's pre_feedforward_layernorm (its post_attention_layernorm normalises the
    # attention output before the residual add), else post_attention_layernorm.
    norm2 = getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "post_attention_layernorm", None)
    if ff is None:
        return out
    experts = getattr(ff, "experts", None)
    mlps = list(experts) if isinstance(experts, nn.ModuleList) else [ff]
    shared = getattr(ff, "shared_expert", None)
    if isinstance(experts, nn.ModuleList) and shared is not None:
        mlps.append(shared)
    pairs = [(m, _mlp_pair(m)) for m in mlps]
    pairs = [(m, p) for m, p in pairs if p is not None]
    fused_gate_up = getattr(ff, "gate_up_proj", None)
    if not pairs and isinstance(fused_gate_up, nn.Linear) and "mlp_in" in kinds and _is_norm(norm2):  # Phi-3
        out.append(_smoothing("mlp_in", names, norm2, [fused_gate_up], (norm2, "output")))
    if not pairs:
        return out
    if "mlp_in" in kinds and _is_norm(norm2):
        consumers = [lin for _, (g, u, _) in pairs for lin in (g, u)]
        if isinstance(experts, nn.ModuleList):  # the router and the shared-expert gate read the same output
            consumers += [
                m
                for m in (getattr(ff, "gate", None), getattr(ff, "shared_expert_gate", None))
                if isinstance(m, nn.Linear)
            ]
        if all(c.in_features == norm2.weight.shape[0] for c in consumers):
            out.append(_smoothing("mlp_in", names, norm2, consumers, (norm2, "output")))
    if "up_down" in kinds:
        for _, (_, up, down) in pairs:
            out.append(_smoothing("up_down", names, up, [down], (down, "input")))
    return out
