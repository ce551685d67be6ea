"""The model configuration, parsed and checked from a Hugging Face ``config.json``.

Only the fields our decoder models use are read; each is type-checked so that a wrong value fails here, with
the file and field named, instead of deep inside a tensor op. Both transformers 4.x and 5.x spellings are
accepted (``torch_dtype``/``dtype``, ``rope_scaling``/``rope_parameters``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """What a decoder model needs to know; built by :func:`load_config` / :meth:`from_dict`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Mixture of experts (mixtral, qwen2_moe, qwen3_moe).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    #: The config.json as read, so that export can write it back with only quantization_config added.
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_MODEL_TYPES and self.num_experts > 0

    def layer_is_sparse(self, index: int) -> bool:
        """Whether decoder layer ``index`` has a sparse MoE block (HF's decoder_sparse_step / mlp_only_layers rule)."""
        if not self.is_moe:
            return False
        if self.model_type == "mixtral":
            return True
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse and check a config dict; ``source`` names the file in error messages."""
        return _parse(raw, source)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` from ``model_dir``; raise :class:`ConfigError` naming the file and field when it is bad."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory (expected a Hugging Face-format model directory)")
    if not path.is_file():
        raise ConfigError(f"{path}: missing (a model directory needs a config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return _parse(raw, str(path))


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: field 'model_type' is missing")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    get = _FieldReader(raw, source)
    hidden = get.int("hidden_size", minimum=1)
    heads = get.int("num_attention_heads", minimum=1)
    kv_heads = get.int("num_key_value_heads", default=heads, minimum=1)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = get.int("head_dim", default=None, minimum=1, allow_none=True)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")

    rope_params = raw.get("rope_parameters")
    rope_scaling = raw.get("rope_scaling")
    rope_theta = raw.get("rope_theta")
    if isinstance(rope_params, dict):  # transformers 5: theta and scaling live together
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if rope_theta is None:
        rope_theta = 10000.0
    if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool) or rope_theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, got {rope_theta!r}")
    rope_scaling = _check_rope_scaling(rope_scaling, source)

    is_moe_type = model_type in MOE_MODEL_TYPES
    num_experts = 0
    if is_moe_type:
        key = "num_local_experts" if model_type == "mixtral" else "num_experts"
        num_experts = get.int(key, minimum=1)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=get.int("vocab_size", minimum=1),
        hidden_size=hidden,
        intermediate_size=get.int("intermediate_size", minimum=1),
        num_hidden_layers=get.int("num_hidden_layers", minimum=1),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get.float("rms_norm_eps", default=1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=get.int("max_position_embeddings", default=2048, minimum=1),
        tie_word_embeddings=get.bool("tie_word_embeddings", default=False),
        attention_bias=get.bool("attention_bias", default=model_type == "qwen2" or model_type == "qwen2_moe"),
        mlp_bias=get.bool("mlp_bias", default=False),
        hidden_act=get.str("hidden_act", default="silu"),
        torch_dtype=_parse_dtype(raw.get("torch_dtype", raw.get("dtype")), source),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        eos_token_id=raw.get("eos_token_id"),
        num_experts=num_experts,
        num_experts_per_tok=get.int("num_experts_per_tok", minimum=1) if is_moe_type else 0,
        moe_intermediate_size=get.int("moe_intermediate_size", minimum=1) if model_type != "mixtral" and is_moe_type else 0,
        shared_expert_intermediate_size=(
            get.int("shared_expert_intermediate_size", default=0, minimum=0) if model_type == "qwen2_moe" else 0
        ),
        norm_topk_prob=get.bool("norm_topk_prob", default=model_type in ("mixtral", "qwen3_moe")),
        decoder_sparse_step=get.int("decoder_sparse_step", default=1, minimum=1),
        mlp_only_layers=get.int_list("mlp_only_layers"),
        raw=dict(raw),
    )
    if model_type == "mixtral":
        cfg.norm_topk_prob = True  # Mixtral always renormalises its top-k weights
    if cfg.hidden_act not in _ACTIVATIONS:
        raise ConfigError(f"{source}: hidden_act {cfg.hidden_act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    if is_moe_type and cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} exceeds the number of experts {num_experts}")
    return cfg


_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _check_rope_scaling(scaling: Any, source: str) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{source}: rope_scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if rope_type == "default":
        return None
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0:
        raise ConfigError(f"{source}: rope_scaling 'factor' must be a positive number, got {factor!r}")
    return {**scaling, "rope_type": rope_type}


def _parse_dtype(value: Any, source: str) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"{source}: field 'torch_dtype' {value!r} is not one of {', '.join(sorted(_DTYPES))}")


class _FieldReader:
    """Typed access to config fields, with errors naming the file and field."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    _MISSING = object()

    def _value(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, self._MISSING)
        if value is self._MISSING:
            if default is self._MISSING:
                raise ConfigError(f"{self.source}: field {key!r} is missing")
            return default
        return value

    def int(self, key: str, default: Any = _MISSING, minimum: int | None = None, allow_none: bool = False) -> Any:
        value = self._value(key, default)
        if value is None and allow_none:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.source}: field {key!r} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.source}: field {key!r} must be >= {minimum}, got {value}")
        if value > 2**31:
            raise ConfigError(f"{self.source}: field {key!r} is implausibly large ({value})")
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._value(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.source}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: field {key!r} must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.source}: field {key!r} must be a string, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._value(key, None)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{self.source}: field {key!r} must be a list of integers, got {value!r}")
        return list(value)
