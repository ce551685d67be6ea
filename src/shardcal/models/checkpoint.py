"""Reading Hugging Face-format weights: ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

Only safetensors is read (never pickle). Files are memory-mapped, so a reader can take a row slice of a tensor
without reading the rest — the distributed loader relies on that. Every failure is a :class:`CheckpointError`
naming the file and, where there is one, the tensor key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..runtime.fsutil import read_json_object
from .published import PublishedReads

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

#: safetensors dtype names -> torch dtypes (those this torch build has).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U64": getattr(torch, "uint64", None),
        "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None),
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }.items()
    if dtype is not None
}


def read_index(index: Path, model_dir: Path) -> dict[str, Path]:
    """``{tensor name: shard path}`` from a sharded checkpoint's index, every shard checked to exist."""
    data = read_json_object(index, CheckpointError)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: field 'weight_map' must be a non-empty object mapping tensor names to files")
    root = model_dir.resolve()
    files: dict[str, Path] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index}: 'weight_map' entry for tensor {key!r} must be a file name, got {name!r}")
        file = (model_dir / name).resolve()
        if file.parent != root:
            raise CheckpointError(f"{index}: tensor {key!r} points outside the model directory ({name!r})")
        if not file.is_file():
            raise CheckpointError(f"{index}: tensor {key!r} is in {name!r}, which does not exist")
        files[key] = file
    return files


def _one_line(exc: Exception) -> str:
    """A library error's text on one line (safetensors quotes header bytes, newlines included)."""
    return " ".join(str(exc).split())


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"{file}: not a readable safetensors file ({_one_line(exc)})") from None


class CheckpointReader(PublishedReads):
    """Tensors of a model directory by name; each file is opened once, lazily, memory-mapped.

    ``source`` is the file that lists the tensors (the index, or the single ``model.safetensors``): error
    messages about the checkpoint as a whole name it. A checkpoint published in FP8 with block scales reads as the
    float weights it stands for (:mod:`.published`).
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._handles: dict[Path, Any] = {}
        self._file_keys: dict[Path, set[str]] = {}
        index, single = self.model_dir / INDEX_NAME, self.model_dir / SINGLE_NAME
        if index.is_file():
            self.source = index
            self._file_of = read_index(index, self.model_dir)
        elif single.is_file():
            self.source = single
            self._file_of = {key: single for key in self._keys_in(single)}
        else:
            hint = ""
            if any(self.model_dir.glob("*.bin")) or any(self.model_dir.glob("*.pt")):
                hint = " (only safetensors weights are read; pickled .bin/.pt files are not)"
            raise CheckpointError(f"{self.model_dir}: no {SINGLE_NAME} or {INDEX_NAME} found{hint}")
        self._find_published(self.model_dir, self._file_of)

    def _open_file(self, file: Path) -> Any:
        if file not in self._handles:
            handle = _open(file).__enter__()
            self._handles[file] = handle
            self._file_keys[file] = set(handle.keys())
        return self._handles[file]

    def _keys_in(self, file: Path) -> set[str]:
        self._open_file(file)
        return self._file_keys[file]

    def _raw_keys(self) -> list[str]:
        return list(self._file_of)

    def _raw_contains(self, key: str) -> bool:
        return key in self._file_of

    def _raw_file_of(self, key: str) -> Path:
        if key not in self._file_of:
            raise CheckpointError(f"{self.source}: tensor {key!r} is missing from the checkpoint")
        return self._file_of[key]

    def _handle(self, key: str) -> Any:
        """The open file holding ``key``, checked to really contain it (an index can be wrong)."""
        file = self._raw_file_of(key)
        handle = self._open_file(file)
        if key not in self._file_keys[file]:
            raise CheckpointError(f"{file}: tensor {key!r} is listed in {self.source.name} but not in the file")
        return handle

    def _slice(self, key: str) -> Any:
        handle = self._handle(key)
        try:
            return handle.get_slice(key)
        except Exception as exc:
            raise CheckpointError(
                f"{self._raw_file_of(key)}: tensor {key!r} is unreadable ({_one_line(exc)})"
            ) from None

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The safetensors dtype name (``F32``, ``BF16``, ``I8``, ...) of a stored tensor."""
        return self._slice(key).get_dtype()

    def _raw_dtype(self, key: str) -> torch.dtype:
        name = self.dtype_name(key)
        if name not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self._raw_file_of(key)}: tensor {key!r} has dtype {name}, which torch cannot load")
        return SAFETENSORS_DTYPES[name]

    def _raw_get(self, key: str) -> torch.Tensor:
        """The whole tensor, as stored."""
        handle = self._handle(key)
        try:
            return handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(
                f"{self._raw_file_of(key)}: tensor {key!r} cannot be read ({_one_line(exc)})"
            ) from None

    def _raw_get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 as stored, read from the memory map without touching the other rows."""
        tensor_slice = self._slice(key)
        try:
            return tensor_slice[start:stop]
        except Exception as exc:
            raise CheckpointError(
                f"{self._raw_file_of(key)}: tensor {key!r} rows {start}:{stop} cannot be read ({_one_line(exc)})"
            ) from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._file_keys.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.get(key)

    def floating_dtype(self) -> torch.dtype | None:
        """The floating dtype that holds most of the checkpoint's elements (``torch.bfloat16`` for a bf16
        checkpoint), read from the headers alone; None when no tensor is floating (:func:`dominant_floating_dtype`)."""
        return dominant_floating_dtype((self.dtype(key), math.prod(self.shape(key))) for key in self.keys())


def dominant_floating_dtype(tensors: Iterable[tuple[torch.dtype | None, int]]) -> torch.dtype | None:
    """Of ``(dtype, element count)`` pairs, the floating dtype of at least 16 bits that holds the most elements (what
    an export stores a checkpoint's unquantized tensors in by default: the planner asks too); None when there is
    none. Scale tensors of 8-bit formats do not count."""
    counts: dict[torch.dtype, int] = {}
    for dtype, numel in tensors:
        if dtype is not None and dtype.is_floating_point and dtype.itemsize >= 2:
            counts[dtype] = counts.get(dtype, 0) + numel
    return max(counts, key=counts.get) if counts else None
