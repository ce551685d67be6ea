"""Tiny random Hugging Face-format checkpoints for tests, built without transformers.

``make_tiny_checkpoint(tmp_path, "qwen3_moe")`` writes ``config.json`` + ``model.safetensors`` for one of
:data:`TINY_CONFIGS`' families (hidden 64, 4 heads / 2 kv heads, vocab 256; MoE: 4 experts, top-2) and
returns the directory. Weights are random with std 0.05 (norm weights around 1, routers std 0.5 so that
routing is decisive), so activations and logits are non-trivial.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardcal.models import CausalLM, ModelConfig

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_MOE: dict[str, Any] = {"num_experts_per_tok": 2}

#: One tiny config per supported model_type (what ``config.json`` gets, before overrides).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "mistral": {**_COMMON, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None},
    "qwen2": {**_COMMON, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False},
    "qwen3": {**_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
    "mixtral": {
        **_COMMON,
        **_MOE,
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": 64,
        "num_local_experts": 4,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
    },
    "qwen2_moe": {
        **_COMMON,
        **_MOE,
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],  # layer 0 dense, layer 1 sparse
    },
    "qwen3_moe": {
        **_COMMON,
        **_MOE,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 16,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.05, router_std: float = 0.5) -> None:
    """Fill every parameter of ``model`` in place: weights N(0, std), norm weights 1 + N(0, 0.1), biases
    N(0, std), MoE router weights N(0, router_std). Works for our models and transformers' alike (by name)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            leaf = ["", "", *name.rsplit(".", 2)]
            if "norm" in leaf[-2] and leaf[-1] == "weight":
                value = 1.0 + 0.1 * noise
            elif leaf[-2] == "gate" and ("mlp" in name or "block_sparse_moe" in name):
                value = router_std * noise
            else:
                value = std * noise
            param.copy_(value.to(param.dtype))


def make_tiny_checkpoint(
    tmp_dir: str | Path,
    model_type: str = "llama",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint (``config.json`` + ``model.safetensors``) under ``tmp_dir``.

    The directory is ``tmp_dir / f"tiny-{model_type}"`` (``-1``, ``-2``, ... appended if it exists). Config
    overrides replace or add ``config.json`` fields (e.g. ``num_hidden_layers=3``, ``tie_word_embeddings=True``);
    the weights' dtype is ``dtype`` and ``config.json`` says so. A tied checkpoint omits ``lm_head.weight``,
    as transformers writes it.
    """
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for model_type {model_type!r} (have: {', '.join(TINY_CONFIGS)})")
    raw = copy.deepcopy(TINY_CONFIGS[model_type])
    raw.update(copy.deepcopy(config_overrides))
    raw["torch_dtype"] = _DTYPE_NAMES[dtype]
    model = CausalLM(ModelConfig.from_dict(raw, source=f"TINY_CONFIGS[{model_type!r}]"))
    randomize_(model, seed=seed)
    state = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (raw.get("tie_word_embeddings") and name == "lm_head.weight")
    }
    base = Path(tmp_dir) / f"tiny-{model_type}"
    out, n = base, 0
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def starve_experts_2_and_3(model: Any) -> None:
    """Make a 4-expert tiny MoE (shardcal's layout) route every token to experts 0 and 1 only: a constant positive
    residual feature (embedding column 0, kept out of attention and the experts' outputs) that the routers weigh
    3, 2, 1, -5. Experts 2 and 3 never get a token."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 5.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.post_attention_layernorm.weight.fill_(1.0)
            for expert in layer.mlp.experts:
                expert.down_proj.weight[0].zero_()
            gate = layer.mlp.gate.weight
            gate.zero_()
            gate[:, 0] = torch.tensor([3.0, 2.0, 1.0, -5.0])


#: A few paragraphs of English: calibration and evaluation text for tiny models with a byte-level tokenizer.
TINY_TEXT = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea. "
    "In spring the meadows on both banks are full of flowers, and the town holds a market every Saturday. "
    "Scientists measured the temperature of the water for ten years and found that it rose slowly. "
)


#: A ChatML template (SmolLM2's and Qwen's turn format) over the tiny tokenizer's <|im_start|> / <|im_end|>.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_text_model(tmp_dir: str | Path, model_type: str = "llama", **config_overrides: Any) -> Path:
    """:func:`make_tiny_checkpoint` with a byte-level ``tokenizer.json`` (vocab 300, positions 512) and a ChatML
    chat template in ``tokenizer_config.json``, so that the commands and examples that take text (``.jsonl``,
    ``.txt``, chat messages) run on it."""
    from test_gguf_tokenizer import byte_level_tokenizer_json

    overrides = {"vocab_size": 300, "max_position_embeddings": 512, **config_overrides}
    model_dir = make_tiny_checkpoint(tmp_dir, model_type, **overrides)
    (model_dir / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    return model_dir


def write_chat_data(path: str | Path, conversations: int = 12) -> Path:
    """A ``.jsonl`` file of ``conversations`` lines ``{"messages": [user, assistant]}`` of different lengths."""
    path = Path(path)
    words = TINY_TEXT.split()
    lines = []
    for i in range(conversations):
        user, answer = " ".join(words[i : i + 3 + i % 4]), " ".join(words[i + 2 : i + 8 + 2 * i])
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet_text(folder: str | Path, documents: int = 40) -> Path:
    """A Hub-style dataset directory (``data/train-00000-of-00001.parquet``) of ``text`` rows; needs pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"{i}. {TINY_TEXT}"} for i in range(documents)]
    pq.write_table(pa.Table.from_pylist(rows), str(folder / "data" / "train-00000-of-00001.parquet"))
    return folder


def write_text_data(path: str | Path, documents: int = 40) -> Path:
    """A ``.jsonl`` file of ``documents`` lines ``{"text": ...}`` (about 350 bytes each)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"text": f"{i}. {TINY_TEXT}"}) + "\n" for i in range(documents)))
    return path
