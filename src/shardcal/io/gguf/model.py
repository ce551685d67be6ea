"""A GGUF file's model as Hugging Face's: the architecture's config.json and the tensors under HF names and shapes
(llama's q/k rows unpermuted, Gemma's norms less 1)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError
from .reader import GGUFFile, GGUFMetadata

# GGUF per-layer tensor names -> HF names, per architecture.
_LLAMA_LAYER: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS: dict[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_QKV_BIASES: dict[str, str] = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_GEMMA3_LAYER: dict[str, str] = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm.weight"},
    **_QK_NORMS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFamily:
    """How one GGUF architecture maps onto its HF model class."""

    def __init__(
        self, model_type: str, hf_class: str, layer: dict[str, str], permute_qk: bool = False, norm_offset: bool = False
    ):
        self.model_type, self.hf_class, self.layer = model_type, hf_class, layer
        #: llama.cpp permutes q/k rows only for its llama family (interleaved rope); the others use NeoX rope.
        self.permute_qk = permute_qk
        #: Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w, HF stores w.
        self.norm_offset = norm_offset


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", "LlamaForCausalLM", _LLAMA_LAYER, permute_qk=True),
    "qwen2": GGUFFamily("qwen2", "Qwen2ForCausalLM", {**_LLAMA_LAYER, **_QKV_BIASES}),
    "qwen3": GGUFFamily("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORMS}),
    "gemma3": GGUFFamily("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_LAYER, norm_offset=True),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(GGUF_FAMILIES)


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head, n_head_kv)`` on q/k rows: interleaved pairs -> two halves.

    ``n_heads`` is the head count of this projection (``num_attention_heads`` for q, ``num_key_value_heads``
    for k).
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (convert_hf_to_gguf.py ``LlamaModel.permute``), for tests and round trips."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _sizes(meta: GGUFMetadata, arch: str) -> tuple[int, int, int, int]:
    """``(hidden, heads, kv_heads, head_dim)``, checked for rotary embeddings."""
    path = meta.path
    hidden = meta.int(f"{arch}.embedding_length")
    heads = meta.int(f"{arch}.attention.head_count")
    kv_heads = meta.int(f"{arch}.attention.head_count_kv", heads)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise CheckpointError(f"{path}: head counts {heads} (attention) / {kv_heads} (key/value) are inconsistent")
    head_dim = meta.int(f"{arch}.attention.key_length", hidden // heads)
    value_dim = meta.int(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{path}: attention.value_length={value_dim} differs from attention.key_length={head_dim}; not supported"
        )
    rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) are not supported"
        )
    if head_dim == 0 or head_dim % 2:
        raise CheckpointError(
            f"{path}: head_dim {head_dim} (attention.key_length) must be even and positive for rotary embeddings"
        )
    return hidden, heads, kv_heads, head_dim


def _rope_scaling(meta: GGUFMetadata, arch: str, allowed: tuple[str, ...]) -> dict[str, Any] | None:
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return None
    if scaling not in allowed:
        raise CheckpointError(
            f"{meta.path}: metadata '{arch}.rope.scaling.type' = {scaling!r} is not supported for {arch} "
            f"(supported: none, {', '.join(allowed)})"
        )
    if scaling == "linear":
        return {"rope_type": "linear", "factor": meta.float(f"{arch}.rope.scaling.factor")}
    return {
        "rope_type": "yarn",
        "factor": meta.float(f"{arch}.rope.scaling.factor"),
        "original_max_position_embeddings": meta.int(f"{arch}.rope.scaling.original_context_length"),
    }


def _special_ids(meta: GGUFMetadata, cfg: dict[str, Any]) -> dict[str, Any]:
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            cfg[key] = value
    return cfg


def hf_config(meta: GGUFMetadata, arch: str, tensors: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The config.json transformers writes for this model (its GGUF loader's keys, llama.cpp's defaults)."""
    hidden, heads, kv_heads, head_dim = _sizes(meta, arch)
    family = GGUF_FAMILIES[arch]
    tied = "output.weight" not in tensors
    if arch == "gemma3":
        return _special_ids(meta, _gemma3_config(meta, hidden, heads, kv_heads, head_dim, vocab_size, tied))
    cfg: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.int(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.float(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, ("linear", "yarn")),
        "max_position_embeddings": meta.int(f"{arch}.context_length", 2048 if arch == "llama" else 32768),
        "tie_word_embeddings": tied,
        "attention_bias": False,
    }
    if arch == "llama":
        cfg["mlp_bias"] = False
    elif arch == "qwen2":  # Qwen2's config has neither: q/k/v always have biases, head_dim is hidden / heads
        del cfg["attention_bias"]
        if head_dim == hidden // heads:
            del cfg["head_dim"]
    if arch != "llama":  # llama.cpp has no sliding window for Qwen2/Qwen3 (nor does the HF config enable one)
        cfg.update({"use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0})
    return _special_ids(meta, cfg)


def _gemma3_config(
    meta: GGUFMetadata, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab_size: int, tied: bool
) -> dict[str, Any]:
    """Gemma 3 (text): the settings llama.cpp hard-codes for the family (``llama-model.cpp``) made explicit."""
    path, layers = meta.path, meta.int("gemma3.block_count")
    # Every sixth layer attends globally, the rest within the sliding window; newer files may state it per layer.
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise CheckpointError(
                f"{path}: metadata 'gemma3.attention.sliding_window_pattern' must be {layers} booleans, got {pattern!r}"
            )
        sliding = list(pattern)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise CheckpointError(
            f"{path}: metadata 'gemma3.attention.sliding_window_pattern' must be a positive integer, got {pattern!r}"
        )
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer 27B model: 1/sqrt(hidden / heads).
    scalar = hidden // heads if layers == 62 else head_dim
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.int("gemma3.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": meta.float("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.float("gemma3.rope.freq_base", 1000000.0),
        "rope_local_base_freq": meta.float("gemma3.rope.freq_base_swa", 10000.0),
        "rope_scaling": _rope_scaling(meta, "gemma3", ("linear",)),
        "max_position_embeddings": meta.int("gemma3.context_length", 131072),
        "sliding_window": meta.int("gemma3.attention.sliding_window", 4096),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
    }


def _hf_tensor_name(name: str, arch: str, num_layers: int, path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    layer = GGUF_FAMILIES[arch].layer
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if match and match.group(2) in layer and int(match.group(1)) < num_layers:
        return f"model.layers.{int(match.group(1))}.{layer[match.group(2)]}"
    if name == "rope_freqs.weight":
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported")
    raise CheckpointError(
        f"{path}: unexpected tensor {name!r} for a {arch} model (mixture-of-experts and other layouts are not supported)"
    )


def hf_weights(file: GGUFFile, cfg: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    path, family = file.path, GGUF_FAMILIES[arch]
    out: dict[str, np.ndarray] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for tensor in file.tensors:
        hf_name = _hf_tensor_name(tensor.name, arch, cfg["num_hidden_layers"], path)
        qtype = GGMLQuantizationType(tensor.qtype)
        try:
            array = dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} is stored as {qtype.name}, which the installed gguf package cannot dequantize"
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} ({qtype.name}) cannot be dequantized ({type(exc).__name__}: {exc})"
            ) from None
        # GGUF lists the fastest-varying dimension first: [in, out] there is [out, in] in row-major order.
        array = np.asarray(array, dtype=np.float32).reshape(tensor.hf_shape)
        if family.norm_offset and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1)  # llama.cpp stored 1 + w (convert_hf_to_gguf.py, Gemma's norm_shift)
        out[hf_name] = array
    _check_shapes(out, cfg, arch, path)  # first: un-permuting q/k needs their rows to be heads x head_dim
    for hf_name, array in out.items():
        if family.permute_qk and hf_name.endswith("q_proj.weight"):
            array = unpermute_qk(array, heads)
        elif family.permute_qk and hf_name.endswith("k_proj.weight"):
            array = unpermute_qk(array, kv_heads)
        out[hf_name] = np.ascontiguousarray(array)
    return out


def _check_shapes(weights: dict[str, np.ndarray], cfg: dict[str, Any], arch: str, path: Path) -> None:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        expected["lm_head.weight"] = (v, h)
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    layer = {name: shapes.get(name, (h,)) for name in GGUF_FAMILIES[arch].layer.values()}  # the rest are norms
    # Layer by layer, lazily: a corrupt block_count (billions of layers) fails at the first layer the file lacks.
    layers = ((f"model.layers.{n}.{k}", s) for n in range(cfg["num_hidden_layers"]) for k, s in layer.items())
    for key, shape in itertools.chain(expected.items(), layers):
        if key not in weights:
            raise CheckpointError(f"{path}: the GGUF file has no tensor for {key!r}")
        if tuple(weights[key].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor for {key!r} has shape {list(weights[key].shape)}, the metadata implies {list(shape)}"
            )
