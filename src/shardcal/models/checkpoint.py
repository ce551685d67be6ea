"""Reading Hugging Face-format weights: ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

Only safetensors is read (never pickle). Files are memory-mapped, so a reader can take a row slice of a tensor
without reading the rest — the distributed loader relies on that. Every failure is a :class:`CheckpointError`
naming the file and, where there is one, the tensor key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _weight_map(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: field 'weight_map' must be an object mapping tensor names to file names")
        files: dict[str, Path] = {}
        for key, name in weight_map.items():
            file = (model_dir / name).resolve()
            if file.parent != model_dir.resolve():
                raise CheckpointError(f"{index}: tensor {key!r} points outside the model directory ({name!r})")
            if not file.is_file():
                raise CheckpointError(f"{index}: tensor {key!r} is in {name!r}, which does not exist")
            files[key] = file
        return files
    single = model_dir / SINGLE_NAME
    if single.is_file():
        return {key: single for key in _file_keys(single)}
    raise CheckpointError(f"{model_dir}: no {SINGLE_NAME} or {INDEX_NAME} found")


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _file_keys(file: Path) -> list[str]:
    with _open(file) as handle:
        return list(handle.keys())


class CheckpointReader:
    """Tensors of a model directory by name; each file is opened once, lazily, memory-mapped."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of = _weight_map(self.model_dir)
        self._handles: dict[Path, Any] = {}
        self._checked: set[Path] = set()

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def file_of(self, key: str) -> Path:
        if key not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: tensor {key!r} is missing from the checkpoint")
        return self._file_of[key]

    def _handle(self, key: str) -> Any:
        file = self.file_of(key)
        if file not in self._handles:
            handle = _open(file)
            self._handles[file] = handle.__enter__()
            if key not in set(self._handles[file].keys()):
                raise CheckpointError(f"{file}: tensor {key!r} is listed in the index but not in the file")
        handle = self._handles[file]
        return handle

    def _slice(self, key: str) -> Any:
        handle = self._handle(key)
        try:
            return handle.get_slice(key)
        except Exception as exc:
            raise CheckpointError(f"{self.file_of(key)}: tensor {key!r} is missing or unreadable ({exc})") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPE_NAMES.get(self._slice(key).get_dtype(), torch.uint8)

    def dtype_name(self, key: str) -> str:
        return self._slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor."""
        try:
            return self._handle(key).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.file_of(key)}: tensor {key!r} cannot be read ({exc})") from None

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0, read from the memory map without touching the other rows."""
        try:
            return self._slice(key)[start:stop]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.file_of(key)}: tensor {key!r} rows {start}:{stop} cannot be read ({exc})") from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.get(key)


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
