"""Pure-torch decoder-only causal LMs (Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE), readable in one file.

Module and parameter names equal Hugging Face's state-dict keys, so a checkpoint loads with no renaming and a
saved state dict is a Hugging Face checkpoint again. Decoder layers are plain modules called as
``layer(hidden_states, position_embeddings=(cos, sin), attention_mask=mask)``: the model computes the rotary
tables and the (padding) mask once, so a calibration runner can call any layer directly on cached inputs. A
sliding-window layer (Mistral, Qwen with ``use_sliding_window``) narrows the mask itself, so every layer takes
the same inputs.

The arithmetic follows transformers' modules (RMSNorm in float32, rotary tables cast to the activations'
dtype, routing softmax in float32), so a checkpoint gives the same logits as there.

Caches follow transformers' protocol: an attention called with ``cache`` hands its keys (after the rotary embedding
and the q/k norms) and values to ``cache.update(key_states, value_states, layer_idx)`` and attends over what that
returns. An attention may also hold a ``kv_cache_quantizer`` (any object with that ``update``; None by default),
used when the caller passes no cache: that is where shardcal's KV-cache quantization sits, so the model's own
forward computes with fake-quantized keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary

_ACT = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACT[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """Mixtral's expert, with its checkpoint names: ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act = _ACT[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    """Top-k routed experts (per-expert Linear modules), with Qwen2-MoE's optional gated shared expert.

    Routing follows transformers: softmax over all experts in float32, top-k, optionally renormalised
    (always for Mixtral). Mixtral weights the expert outputs with the float32 routing weights; the Qwen MoE
    models first cast them to the router's dtype. The router ``gate`` may be kept in float32 in a bf16 model
    (as real checkpoints store it); its input is cast to the router's dtype.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.float32_routing_weights = cfg.model_type == "mixtral"
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.model_type == "mixtral":
            self.experts = nn.ModuleList(
                MixtralExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act) for _ in range(cfg.num_experts)
            )
        else:
            self.experts = nn.ModuleList(
                MLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act) for _ in range(cfg.num_experts)
            )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert indices [T, k])`` for flattened tokens ``x`` [T, hidden]."""
        logits = self.gate(x.to(self.gate.weight.dtype))
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_routing_weights else weights.to(logits.dtype)), experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(experts == e)
            # Every expert runs, on zero tokens if none were routed to it: under FSDP2 a skipped expert would
            # leave its parameters' collectives unmatched across ranks.
            y = expert(x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[seq, seq]`` mask (True = attend): causal, and each query sees only its last ``window`` keys."""
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, optional q/k RMSNorm (Qwen3) and sliding window."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.sliding_window = cfg.layer_sliding_window(index)
        self.layer_idx = index
        #: The cache used when the caller passes none (see the module docstring): shardcal's KV-cache quantizer.
        self.kv_cache_quantizer: nn.Module | None = None
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: object | None = None,
    ) -> torch.Tensor:
        """``attention_mask``: boolean, broadcastable to ``[batch, 1, seq, seq]`` (True = attend), already
        causal; None means plain causal. A sliding-window layer narrows it further itself. ``cache``: an object
        with ``update(key_states, value_states, layer_idx)`` returning the keys and values to attend over (None:
        ``kv_cache_quantizer``, if set)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        cache = cache if cache is not None else self.kv_cache_quantizer
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.num_kv_heads != self.num_heads:
            repeats = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        if self.sliding_window is not None and s > self.sliding_window:
            band = sliding_window_mask(s, self.sliding_window, x.device)
            attention_mask = band if attention_mask is None else attention_mask & band
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DecoderLayer(nn.Module):
    """Pre-norm attention + (dense or sparse) MLP. Called directly by the calibration runner."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        feed_forward: nn.Module
        if cfg.layer_is_sparse(index):
            feed_forward = SparseMoeBlock(cfg)
        else:
            feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        # Checkpoint names: Mixtral's block is `block_sparse_moe`, every other family's `mlp`.
        self.feed_forward_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        self.add_module(self.feed_forward_name, feed_forward)

    @property
    def feed_forward(self) -> nn.Module:
        """The MLP or sparse MoE block, whatever its checkpoint name."""
        return getattr(self, self.feed_forward_name)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: object | None = None,
    ) -> torch.Tensor:
        """``cache`` is passed to the attention (see :class:`Attention`)."""
        h = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache=cache
        )
        return h + self.feed_forward(self.post_attention_layernorm(h))


@dataclass
class DecoderInputs:
    """What every decoder layer is called with, computed once from token ids."""

    hidden_states: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor | None


def attention_mask_4d(padding_mask: torch.Tensor | None, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[batch, 1, seq, seq]`` mask (True = attend): causal AND key not padding; None when no padding.

    A query always sees itself, so a padded query row is never fully masked (which would give NaN); its output
    is meaningless and ignored by callers.
    """
    if padding_mask is None or bool(padding_mask.all()):
        return None
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return mask | torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]


class DecoderModel(nn.Module):
    """The HF ``model`` submodule: embeddings, decoder layers, final norm (rotary tables computed here)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DecoderInputs:
        """Embeddings, rotary tables and mask for ``input_ids`` [batch, seq] — the decoder stack's inputs.

        ``attention_mask`` [batch, seq] (1 = token, 0 = padding) is optional; with padding, positions count
        only the real tokens (as in transformers' generation), so a left-padded row gets the same rotary
        positions as unpadded.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {list(attention_mask.shape)}, input_ids {list(input_ids.shape)}"
            )
        hidden = self.embed_tokens(input_ids)
        if attention_mask is not None and not bool(attention_mask.all()):
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(
                input_ids.shape[0], -1
            )
        cos_sin = self.rotary_emb(position_ids, hidden.dtype)
        mask = attention_mask_4d(attention_mask, input_ids.shape[1], input_ids.device)
        return DecoderInputs(hidden, cos_sin, mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        inputs = self.embed(input_ids, attention_mask)
        h = inputs.hidden_states
        for layer in self.layers:
            h = layer(h, position_embeddings=inputs.position_embeddings, attention_mask=inputs.attention_mask)
        return self.norm(h)


class CausalLM(nn.Module):
    """``model(input_ids) -> logits``; names as in HF's ``*ForCausalLM`` (``model.*``, ``lm_head``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with the embeddings when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, attention_mask))
