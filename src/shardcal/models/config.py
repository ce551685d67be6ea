"""The model configuration, parsed and checked from a Hugging Face ``config.json``.

Only the fields our decoder models use are read; each is type-checked so that a wrong value fails here, with
the file and field named, instead of deep inside a tensor op. Both transformers 4.x and 5.x spellings are
accepted (``torch_dtype``/``dtype``, ``rope_theta`` + ``rope_scaling``/``rope_parameters``).

Fields that define tensor shapes (sizes, counts) are required. Behavioural fields a config may omit take the
default of the family's transformers config class, so a hand-written config means the same here as there
(e.g. Mixtral's ``rms_norm_eps`` is 1e-5 and its ``rope_theta`` 1e6, Mistral's ``sliding_window`` is 4096,
Qwen3's ``head_dim`` is 128).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..runtime.fsutil import read_json_object
from ..runtime.params import is_finite_number

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")
#: Families with an RMSNorm on each query/key head before the rotary embedding.
QK_NORM_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

ACTIVATIONS: tuple[str, ...] = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")

#: Module counts beyond any real decoder: building that many modules (even on the meta device) would take hours,
#: so a config claiming more is refused before anything is built.
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_EXPERT_MODULES = 2**16  # num_hidden_layers * num_experts


@dataclass(frozen=True)
class _FamilyDefaults:
    """transformers' config-class defaults for the optional fields we read."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    sliding_window: int | None = None


_FAMILY_DEFAULTS: dict[str, _FamilyDefaults] = {
    "llama": _FamilyDefaults(max_position_embeddings=2048),
    "mistral": _FamilyDefaults(max_position_embeddings=131072, sliding_window=4096),
    "mixtral": _FamilyDefaults(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072),
    "qwen2": _FamilyDefaults(sliding_window=4096),
    "qwen3": _FamilyDefaults(head_dim=128, sliding_window=4096),
    "qwen2_moe": _FamilyDefaults(sliding_window=4096),
    "qwen3_moe": _FamilyDefaults(sliding_window=4096),
}


@dataclass(kw_only=True)
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
    #: Non-default rotary scaling, normalised: always has ``rope_type`` and every parameter its type reads.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    #: Bias on the q/k/v projections.
    attention_bias: bool = False
    #: Bias on the attention output projection (``o_proj``).
    attention_out_bias: bool = False
    #: Bias on the dense MLP's projections (Llama's ``mlp_bias``).
    mlp_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    #: Sliding-window size for the layers whose ``layer_types`` entry is ``sliding_attention``; None: no window.
    sliding_window: int | None = None
    #: Per layer, ``full_attention`` or ``sliding_attention``.
    layer_types: list[str] = field(default_factory=list)
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

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalises each query/key head (Qwen3)."""
        return self.model_type in QK_NORM_MODEL_TYPES

    def layer_is_sparse(self, index: int) -> bool:
        """Whether decoder layer ``index`` has a sparse MoE block (HF's decoder_sparse_step / mlp_only_layers rule)."""
        if not self.is_moe:
            return False
        if self.model_type == "mixtral":
            return True
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    def layer_sliding_window(self, index: int) -> int | None:
        """The sliding-window size of decoder layer ``index``, or None when it attends to the whole prefix."""
        if self.sliding_window is None or not self.layer_types or self.layer_types[index] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse and check a config dict; ``source`` names the file in error messages."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        return _parse(raw, source)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` from ``model_dir``; raise :class:`ConfigError` naming the file and field when it is bad."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory (expected a Hugging Face-format model directory)")
    if not path.is_file():
        raise ConfigError(f"{path}: missing (a model directory needs a config.json)")
    return _parse(read_json_object(path, ConfigError), str(path))


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: field 'model_type' is missing")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    family = _FAMILY_DEFAULTS[model_type]
    get = _FieldReader(raw, source)

    hidden = get.int("hidden_size", minimum=1)
    heads = get.int("num_attention_heads", minimum=1)
    kv_heads = get.int("num_key_value_heads", default=None, minimum=1, allow_none=True) or heads
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = get.int("head_dim", default=family.head_dim, minimum=1, allow_none=True)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")
    num_layers = get.int("num_hidden_layers", minimum=1, maximum=MAX_LAYERS)
    max_positions = get.int("max_position_embeddings", default=family.max_position_embeddings, minimum=1)
    rope_theta, rope_scaling = _parse_rope(raw, source, family.rope_theta, max_positions)

    # Biases, per family, exactly as the transformers modules create them.
    if model_type == "llama" or model_type in QK_NORM_MODEL_TYPES:
        qkv_bias = out_bias = get.bool("attention_bias", default=False)
    elif model_type == "qwen2":
        qkv_bias, out_bias = True, False
    elif model_type == "qwen2_moe":
        qkv_bias, out_bias = get.bool("qkv_bias", default=True), False
    else:  # mistral, mixtral
        qkv_bias = out_bias = False

    sliding_window, layer_types = _parse_sliding_window(get, model_type, family, num_layers)

    is_moe_type = model_type in MOE_MODEL_TYPES
    num_experts = get.num_experts() if is_moe_type else 0
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=get.int("vocab_size", minimum=1),
        hidden_size=hidden,
        intermediate_size=get.int("intermediate_size", minimum=1),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get.float("rms_norm_eps", default=family.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=get.bool("tie_word_embeddings", default=False),
        attention_bias=qkv_bias,
        attention_out_bias=out_bias,
        mlp_bias=get.bool("mlp_bias", default=False) if model_type == "llama" else False,
        hidden_act=get.str("hidden_act", default="silu"),
        torch_dtype=_parse_dtype(raw, source),
        bos_token_id=get.optional_int("bos_token_id"),
        eos_token_id=get.token_ids("eos_token_id"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        num_experts=num_experts,
        num_experts_per_tok=get.int("num_experts_per_tok", minimum=1) if is_moe_type else 0,
        moe_intermediate_size=(
            get.int("moe_intermediate_size", minimum=1) if model_type in ("qwen2_moe", "qwen3_moe") else 0
        ),
        shared_expert_intermediate_size=(
            get.int("shared_expert_intermediate_size", minimum=0) if model_type == "qwen2_moe" else 0
        ),
        # Mixtral always renormalises its top-k weights; the Qwen MoE configs default to not doing so.
        norm_topk_prob=True if model_type == "mixtral" else get.bool("norm_topk_prob", default=False),
        decoder_sparse_step=get.int("decoder_sparse_step", default=1, minimum=1) if is_moe_type else 1,
        mlp_only_layers=get.int_list("mlp_only_layers") if is_moe_type else [],
        raw=dict(raw),
    )
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConfigError(
            f"{source}: field 'hidden_act' {cfg.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    if is_moe_type and num_experts * num_layers > MAX_EXPERT_MODULES:
        raise ConfigError(
            f"{source}: {num_layers} layers x {num_experts} experts is implausibly large (at most {MAX_EXPERT_MODULES} experts in all)"
        )
    if is_moe_type and cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"{source}: field 'num_experts_per_tok' ({cfg.num_experts_per_tok}) exceeds the number of experts ({num_experts})"
        )
    return cfg


def _parse_sliding_window(
    get: _FieldReader, model_type: str, family: _FamilyDefaults, num_layers: int
) -> tuple[int | None, list[str]]:
    """``(window or None, per-layer attention types)`` following each family's transformers config rules."""
    if model_type in ("mistral", "mixtral"):  # one window for every layer; layer_types is ignored
        window = get.int("sliding_window", default=family.sliding_window, minimum=1, allow_none=True)
        return window, [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * num_layers
    if model_type == "llama":
        return None, [FULL_ATTENTION] * num_layers
    use_window = get.bool("use_sliding_window", default=False)
    window = get.int("sliding_window", default=family.sliding_window, minimum=0, allow_none=True)
    if not use_window or not window:
        return None, [FULL_ATTENTION] * num_layers
    if model_type == "qwen3_moe":  # one window for every layer
        return window, [SLIDING_ATTENTION] * num_layers
    layer_types = get.layer_types("layer_types", num_layers)
    if layer_types is None:
        max_window_layers = get.int("max_window_layers", default=28, minimum=0)
        if model_type == "qwen2_moe":  # every other layer, below max_window_layers
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % 2 and i < max_window_layers else FULL_ATTENTION
                for i in range(num_layers)
            ]
        else:  # qwen2, qwen3: the layers from max_window_layers on
            layer_types = [SLIDING_ATTENTION if i >= max_window_layers else FULL_ATTENTION for i in range(num_layers)]
    return window, layer_types


def _parse_rope(
    raw: dict[str, Any], source: str, default_theta: float, max_positions: int
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, normalised non-default scaling or None)`` from either transformers spelling."""
    rope_params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    field_name = "rope_scaling"
    if rope_params is not None:  # transformers 5: theta and scaling live together
        if not isinstance(rope_params, dict):
            raise ConfigError(f"{source}: field 'rope_parameters' must be an object, got {rope_params!r}")
        theta = rope_params.get("rope_theta", theta)
        scaling, field_name = rope_params, "rope_parameters"
    if theta is None:
        theta = default_theta
    if not is_finite_number(theta) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    partial = (scaling if isinstance(scaling, dict) else {}).get(
        "partial_rotary_factor", raw.get("partial_rotary_factor")
    )
    if partial is not None and partial != 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' {partial!r} is not supported (only 1.0)")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field {field_name!r} must be an object or null, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: field '{field_name}.rope_type' {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), None

    def number(key: str) -> float:
        value = scaling.get(key)
        if value is None:
            raise ConfigError(f"{source}: field '{field_name}.{key}' is missing (rope_type {rope_type!r} needs it)")
        if not is_finite_number(value) or value <= 0:
            raise ConfigError(f"{source}: field '{field_name}.{key}' must be a positive number, got {value!r}")
        return float(value)

    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type in ("llama3", "yarn"):
        # As in transformers 5: a top-level original_max_position_embeddings wins, then the rope dict's, then
        # max_position_embeddings.
        original = raw.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
        if original is None:
            original = max_positions
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ConfigError(
                f"{source}: field '{field_name}.original_max_position_embeddings' must be a positive integer, got {original!r}"
            )
        out["original_max_position_embeddings"] = original
    # YaRN's factor is `factor` as written (transformers 5). transformers 4.x replaced it by
    # max_position_embeddings / original_max_position_embeddings whenever the latter was given, which silently
    # changed e.g. Qwen3's factor 4; only an explicit null asks for that ratio now.
    if rope_type == "yarn" and scaling.get("factor", 0) is None:
        out["factor"] = max_positions / out["original_max_position_embeddings"]  # DeepSeek-style: the context ratio
    else:
        out["factor"] = number("factor")
    if rope_type == "llama3":
        out["low_freq_factor"] = number("low_freq_factor")
        out["high_freq_factor"] = number("high_freq_factor")
        if out["low_freq_factor"] == out["high_freq_factor"]:
            raise ConfigError(f"{source}: fields '{field_name}.low_freq_factor' and 'high_freq_factor' must differ")
    elif rope_type == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            out[key] = None if scaling.get(key) is None else number(key)
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{source}: field '{field_name}.truncate' must be true or false, got {truncate!r}")
        out["truncate"] = truncate
    return float(theta), out


def _parse_dtype(raw: dict[str, Any], source: str) -> torch.dtype | None:
    # transformers 5 writes `dtype`; 4.x wrote `torch_dtype`. As in transformers, `dtype` wins when both are set.
    key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
    value = raw.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ConfigError(f"{source}: field {key!r} {value!r} is not one of {', '.join(sorted(_DTYPES))}")


class _FieldReader:
    """Typed access to config fields, with errors naming the file and field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def _value(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, self._MISSING)
        if value is self._MISSING:
            if default is self._MISSING:
                raise ConfigError(f"{self.source}: field {key!r} is missing")
            return default
        return value

    def _fail(self, key: str, expected: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.source}: field {key!r} must be {expected}, got {value!r}")

    def int(
        self,
        key: str,
        default: Any = _MISSING,
        minimum: int | None = None,
        allow_none: bool = False,
        maximum: int = 2**31,
    ) -> Any:
        value = self._value(key, default)
        if value is None and allow_none:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, "an integer", value)
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.source}: field {key!r} must be >= {minimum}, got {value}")
        if value > maximum:
            raise ConfigError(f"{self.source}: field {key!r} is implausibly large ({value}; at most {maximum})")
        return value

    def optional_int(self, key: str) -> int | None:
        return self.int(key, default=None, allow_none=True)

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._value(key, default)
        if not is_finite_number(value) or value <= 0:
            raise self._fail(key, "a positive number", value)
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._value(key, default)
        if not isinstance(value, str):
            raise self._fail(key, "a string", value)
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._value(key, None)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self._fail(key, "a list of integers", value)
        return list(value)

    def num_experts(self) -> int:
        """The expert count, spelled ``num_local_experts`` (Mixtral; Qwen3-MoE in transformers 5) or ``num_experts``."""
        keys = [key for key in ("num_local_experts", "num_experts") if self.raw.get(key) is not None]
        if not keys:
            raise ConfigError(f"{self.source}: field 'num_local_experts' (or 'num_experts') is missing")
        values = {key: self.int(key, minimum=1, maximum=MAX_EXPERTS) for key in keys}
        if len(set(values.values())) > 1:
            raise ConfigError(f"{self.source}: fields 'num_local_experts' and 'num_experts' disagree ({values})")
        return values[keys[0]]

    def token_ids(self, key: str) -> int | list[int] | None:
        value = self._value(key, None)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        return self.int_list(key)

    def layer_types(self, key: str, num_layers: int) -> list[str] | None:
        value = self._value(key, None)
        if value is None:
            return None
        allowed = (FULL_ATTENTION, SLIDING_ATTENTION)
        if not isinstance(value, list) or len(value) != num_layers or any(v not in allowed for v in value):
            raise self._fail(key, f"a list of {num_layers} entries, each {' or '.join(map(repr, allowed))}", value)
        return list(value)
