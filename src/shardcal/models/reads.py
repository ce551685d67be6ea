"""Reading safetensors tensors with plain reads instead of a memory map, for a model that is streamed.

:class:`~shardcal.models.checkpoint.CheckpointReader` memory-maps the files: every page it touches stays mapped,
and counts in the process's resident size, until the file is closed — a whole model's worth when each layer is
read once. :class:`ReadingReader` reads the bytes of the rows asked for into a new tensor (``os.preadv``, one call
per tensor slice) and keeps nothing: the page cache may hold the file, the process does not. Same interface as
``CheckpointReader`` (``keys``, ``shape``, ``dtype``, ``get``, ``get_rows``, ``in``), same errors naming the file
and the tensor. The headers are parsed here (the safetensors layout: an 8-byte little-endian length, a JSON header
of ``{name: {dtype, shape, data_offsets}}``, then the data), bounded, and checked against the file size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import CheckpointError
from .checkpoint import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME, read_index
from .published import PublishedReads

#: A safetensors JSON header larger than this is refused (the largest real ones are a few megabytes).
MAX_HEADER_BYTES = 100 * 2**20
#: The most bytes :meth:`ReadingReader._raw_get_staged` reads into its thread's staging buffer; more get their own.
STAGING_MAX_BYTES = 64 * 2**20


class _Entry:
    __slots__ = ("dtype", "file", "offset", "shape")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset


def _header(file: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file: dtype, shape and absolute byte offset, each checked against the file."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{file}: not a readable safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file}: not a readable safetensors file (a header of {length} bytes)")
            text = f.read(length)
        size = file.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a readable safetensors file (its header is not an object)")
    start = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry ({exc!r})") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}, which torch cannot load")
        torch_dtype = SAFETENSORS_DTYPES[dtype]
        if end - begin != math.prod(shape) * torch_dtype.itemsize or begin < 0 or start + end > size:
            raise CheckpointError(f"{file}: tensor {name!r}: its data offsets do not fit its shape or the file")
        out[name] = _Entry(file, torch_dtype, shape, start + begin)
    return out


class ReadingReader(PublishedReads):
    """Tensors of a model directory by name, read with plain reads into new tensors (no memory map); a checkpoint
    published in FP8 with block scales reads as the float weights it stands for (:mod:`.published`)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        index, single = self.model_dir / INDEX_NAME, self.model_dir / SINGLE_NAME
        if index.is_file():
            self.source = index
            files = sorted(set(read_index(index, self.model_dir).values()))
        elif single.is_file():
            self.source, files = single, [single]
        else:
            raise CheckpointError(f"{self.model_dir}: no {SINGLE_NAME} or {INDEX_NAME} found")
        self._entries: dict[str, _Entry] = {}
        for file in files:
            self._entries.update(_header(file))
        self._fds: dict[Path, int] = {}
        self._staging = threading.local()  # each thread's buffer while it stages (:meth:`staging`)
        self._find_published(self.model_dir, self._entries)

    def __enter__(self) -> ReadingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _raw_keys(self) -> list[str]:
        return list(self._entries)

    def _raw_contains(self, key: str) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> _Entry:
        if key not in self._entries:
            raise CheckpointError(f"{self.source}: tensor {key!r} is missing from the checkpoint")
        return self._entries[key]

    def _raw_file_of(self, key: str) -> Path:
        return self._entry(key).file

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def _raw_dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def _raw_get(self, key: str) -> torch.Tensor:
        """The whole tensor as stored, in a new buffer."""
        entry = self._entry(key)
        return self._raw_get_rows(key, 0, entry.shape[0]) if entry.shape else self._read(entry, entry.offset, ())

    def _raw_get_rows(self, key: str, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 as stored, read into ``into`` (their shape and dtype, contiguous) or a new
        buffer; the other rows are not read."""
        entry = self._entry(key)
        if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
            raise CheckpointError(f"{entry.file}: tensor {key!r} has no rows {start}:{stop} (shape {entry.shape})")
        row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        return self._read(entry, entry.offset + start * row_bytes, (stop - start, *entry.shape[1:]), into)

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """While it lasts, this thread's staged reads (:meth:`_raw_get_staged`) share one buffer, freed at its end:
        a layer's FP8 codes, or rows cast into their parameter, are read without a new block each."""
        self._staging.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            yield
        finally:
            self._staging.buffer = None

    def _raw_get_staged(self, key: str, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        buffer = getattr(self._staging, "buffer", None)
        if into is None and buffer is not None:  # staging: into the thread's buffer, grown as needed
            entry = self._entry(key)
            shape = (max(stop - start, 0), *entry.shape[1:])
            nbytes = math.prod(shape) * entry.dtype.itemsize
            if nbytes <= STAGING_MAX_BYTES:  # else too large to keep: a new buffer
                if buffer.numel() < nbytes:
                    buffer = self._staging.buffer = torch.empty(nbytes, dtype=torch.uint8)
                into = buffer[:nbytes].view(entry.dtype).view(shape)
        return self._raw_get_rows(key, start, stop, into)

    def _read(
        self, entry: _Entry, offset: int, shape: tuple[int, ...], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=entry.dtype) if out is None else out
        if not out.is_contiguous():  # the bytes go into a flat view of it
            raise ValueError(f"{entry.file}: a tensor is read into contiguous memory only")
        flat = out.reshape(-1)  # a 0-d tensor's bytes through a 1-d view of it
        view = memoryview(flat.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        done = 0
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{entry.file}: cannot be read ({exc.strerror or exc})") from None
            if got == 0:
                raise CheckpointError(f"{entry.file}: ends before the data of a tensor (truncated?)")
            done += got
        return out
