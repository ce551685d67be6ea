"""Tiny random models built with transformers (a test-only dependency), and one causal LM written here.

``hf_model(family)`` builds a transformers model from a seed: Llama, Qwen3, Gemma 3 (sliding and full layers mixed,
window 4 so that the masks really differ), Phi-3 (fused qkv and gate_up), Qwen3-MoE (fused 3-D experts), a
Llava VLM (tiny CLIP vision tower), and the MoE families of ``HF_MOE_FAMILIES``: DeepSeek-V3 (MLA attention, a
sigmoid router with a persistent ``e_score_correction_bias`` buffer, shared experts, a dense first layer) and
GPT-OSS (transposed, interleaved fused experts with biases, a clamped gate, attention sinks). ``TinyLM`` is a causal LM of its own layout, registered with the registry by
``register_tiny_lm``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

HF_FAMILIES = ("llama", "qwen3", "gemma3", "phi3", "qwen3_moe")
HF_MOE_FAMILIES = ("deepseek_v3", "gpt_oss")


def _quiet():
    warnings.filterwarnings("ignore", module="transformers")


def hf_config(family: str):
    _quiet()
    import transformers as T

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128,
    )  # fmt: skip
    if family == "llama":
        return T.LlamaConfig(**common, num_hidden_layers=3)
    if family == "qwen3":
        return T.Qwen3Config(**common, num_hidden_layers=2, head_dim=16)
    if family == "gemma3":
        types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        return T.Gemma3TextConfig(**common, num_hidden_layers=4, head_dim=16, sliding_window=4, layer_types=types)
    if family == "phi3":
        return T.Phi3Config(**common, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **common, num_hidden_layers=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True,
        )  # fmt: skip
    if family == "deepseek_v3":
        return T.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    if family == "gpt_oss":
        return T.GptOssConfig(
            **{**common, "intermediate_size": 32}, num_hidden_layers=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4,
        )  # fmt: skip
    if family == "llava":
        vision = T.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
        text = T.LlamaConfig(**{**common, "vocab_size": 300}, num_hidden_layers=2)
        return T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=299)
    raise KeyError(family)


def hf_model(family: str, seed: int = 0, **overrides) -> nn.Module:
    """A transformers model of ``family`` with random weights from ``seed`` (std 0.05: non-trivial activations);
    ``overrides`` set config fields (``intermediate_size=64``)."""
    _quiet()
    import transformers as T

    classes = {
        "llama": T.LlamaForCausalLM, "qwen3": T.Qwen3ForCausalLM, "gemma3": T.Gemma3ForCausalLM,
        "phi3": T.Phi3ForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM, "llava": T.LlavaForConditionalGeneration,
        "deepseek_v3": T.DeepseekV3ForCausalLM, "gpt_oss": T.GptOssForCausalLM,
    }  # fmt: skip
    torch.manual_seed(seed)
    config = hf_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = classes[family](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a persistent buffer: not zero, so that loading it counts
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def hf_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, use_cache=False)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


# ----------------------------------------------------------------------------------------------- a user's own model


class TinyBlock(nn.Module):
    """A pre-norm block with its own names and call convention: ``block(x, bias=...)`` returns ``(x, extras)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.ff_in = nn.Linear(dim, 2 * dim)
        self.ff_out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, dict]:
        h = x + self.mix(self.norm(x)) + bias
        return h + self.ff_out(F.gelu(self.ff_in(h))), {"aux": None}


class TinyLM(nn.Module):
    """A causal LM with its own layout (``stack.blocks``); not a layout the registry knows by itself."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 3):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.stack = nn.Module()
        self.stack.blocks = nn.ModuleList(TinyBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)
        self.config = _TinyConfig(vocab, dim, depth)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)
        bias = torch.linspace(-0.1, 0.1, x.shape[-1])
        for block in self.stack.blocks:
            x, _ = block(x, bias=bias)
        return self.head(x)


class _TinyConfig:
    def __init__(self, vocab: int, dim: int, depth: int):
        self.vocab_size, self.dim, self.depth = vocab, dim, depth

    def to_dict(self) -> dict:
        return {"model_type": "tiny_lm", "vocab_size": self.vocab_size, "dim": self.dim, "depth": self.depth}


def tiny_lm_layers(model: nn.Module) -> nn.ModuleList | None:
    stack = getattr(model, "stack", None)
    return getattr(stack, "blocks", None)


def is_tiny_lm(model: nn.Module) -> bool:
    return isinstance(model, TinyLM)


def register_tiny_lm() -> None:
    from shardcal import LayerActivationCollector

    LayerActivationCollector.register_decoder_layer_support(is_tiny_lm, tiny_lm_layers)


def tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().eval()
