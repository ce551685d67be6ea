"""Streaming safetensors shard files: headers known before their data (see :mod:`.layout`), or written once a
file is full (:class:`RunningShardWriter`, for layers laid out when they are written).

A file is ``[u64 little-endian header length][JSON header, space-padded to 8 bytes][tensor bytes in header
order]`` — the safetensors format. The header comes from the plan, so each tensor's bytes are written at their place
the moment its unit is gathered (or read in) and encoded, in whatever order the units come, and the file never sits
in memory.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import sys
from pathlib import Path

import torch

from ..errors import ExportError
from .layout import Entry, Shard

#: Bytes per read and write when a filesystem cannot copy a sealed file's data in the kernel.
COPY_CHUNK_BYTES = 1 << 24

#: torch dtype -> safetensors dtype name.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def header_bytes(entries: list[Entry]) -> bytes:
    """The length prefix and JSON header of a shard holding ``entries`` in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"tensor {e.key!r} has dtype {e.dtype}, which safetensors cannot store")
        header[e.key] = {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_tensor_at(fd: int, t: torch.Tensor, offset: int) -> None:
    """Write the tensor's raw little-endian bytes at ``offset`` of file ``fd``.

    Read through a ctypes view of the CPU copy's memory, not ``Tensor.numpy()``: numpy marks the storage
    non-resizable, and FSDP2 must free (resize to 0) the storage of a gathered parameter when it reshards.
    """
    flat = t.detach().to("cpu").contiguous()  # alive while its bytes are written
    n = flat.numel() * flat.element_size()
    if n:
        _write_at(fd, memoryview((ctypes.c_ubyte * n).from_address(flat.data_ptr())), offset)


class RankShardWriter:
    """Writes this rank's shards tensor by tensor, each at its place in its file (the headers are known up front):
    a file is created with its full header when its first tensor comes, and units may be written in any order."""

    def __init__(self, folder: Path, shards: list[Shard]):
        if sys.byteorder != "little":
            raise ExportError("safetensors export needs a little-endian host")
        self.folder = folder
        self._where: dict[int, tuple[Shard, int]] = {}  # id(entry) -> (shard, absolute offset of its data)
        for shard in shards:
            offset = len(header_bytes(shard.entries))
            for e in shard.entries:
                self._where[id(e)] = (shard, offset)
                offset += e.nbytes
        self._left = {shard.file: len(shard.entries) for shard in shards}
        self._fds: dict[str, int] = {}
        self._written: set[int] = set()

    @property
    def done(self) -> bool:
        return len(self._written) == len(self._where)

    def write(self, entry: Entry, tensor: torch.Tensor) -> None:
        if id(entry) not in self._where:
            raise RuntimeError(f"export plan: unexpected tensor {entry.key!r} (not in this rank's shards)")
        if id(entry) in self._written:
            raise RuntimeError(f"export plan: tensor {entry.key!r} written twice")
        _check_planned(entry, tensor)
        shard, offset = self._where[id(entry)]
        path = self.folder / shard.file
        try:
            fd = self._fds.get(shard.file)
            if fd is None:
                fd = self._fds[shard.file] = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
                _write_at(fd, memoryview(header_bytes(shard.entries)), 0)
            write_tensor_at(fd, tensor, offset)
        except OSError as exc:
            raise ExportError(f"{path}: cannot write ({exc.strerror or exc})") from None
        self._written.add(id(entry))
        self._left[shard.file] -= 1
        if self._left[shard.file] == 0:
            self._close_file(shard.file)

    def _close_file(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                raise ExportError(f"{self.folder / name}: cannot write ({exc.strerror or exc})") from None

    def close(self) -> None:
        """Close the files still open (after a failure; a file is closed as its last tensor is written)."""
        for name in list(self._fds):
            try:
                self._close_file(name)
            except ExportError:
                pass


def _check_planned(entry: Entry, tensor: torch.Tensor) -> None:
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise RuntimeError(
            f"export plan: {entry.key!r} is {tensor.dtype} {list(tensor.shape)}, planned {entry.dtype} {list(entry.shape)}"
        )


class RunningShardWriter:
    """Writes this rank's shards when their layout is known only as the tensors come (a streamed run whose layers
    may fall back: :func:`~.layout.laid_out_layer`). Each tensor is appended to the current file's data, and a file
    ends where :func:`~.layout.split_into_shards` ends one: before a tensor that would take it over
    ``max_shard_bytes``. A file that ended is sealed: its header written, then its data copied behind it (in the
    kernel where the filesystem can) and the data file removed. Until the export knows every rank's files and
    renames them (:meth:`rename`), the k-th is ``.rank{rank}-{k}.safetensors``."""

    def __init__(self, folder: Path, rank: int, max_shard_bytes: int):
        if sys.byteorder != "little":
            raise ExportError("safetensors export needs a little-endian host")
        self.folder, self.rank, self.max_shard_bytes = folder, rank, max_shard_bytes
        self.files: list[list[Entry]] = []  # the entries of each file, in order; the last is open while _fd is
        self._size = 0  # of the open file's data
        self._fd: int | None = None

    done = True  # the layout follows the tensors: the export checks it against its plan at the end

    def _part(self, k: int, suffix: str = "safetensors") -> Path:
        return self.folder / f".rank{self.rank}-{k}.{suffix}"

    def write(self, entry: Entry, tensor: torch.Tensor) -> None:
        _check_planned(entry, tensor)
        if self._fd is not None and self._size + entry.nbytes > self.max_shard_bytes:
            self._seal_open_file()
        k = len(self.files) if self._fd is None else len(self.files) - 1  # the next file, or the open one
        path = self._part(k, "data")
        try:
            if self._fd is None:  # the next file begins
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
                self.files.append([])
                self._size = 0
            write_tensor_at(self._fd, tensor, self._size)
        except OSError as exc:
            raise ExportError(f"{path}: cannot write ({exc.strerror or exc})") from None
        self.files[-1].append(entry)
        self._size += entry.nbytes

    def _seal_open_file(self) -> None:
        """The open file's header, then its data behind it; the data file removed."""
        k = len(self.files) - 1
        data, sealed = self._part(k, "data"), self._part(k)
        fd, self._fd = self._fd, None
        try:
            header = header_bytes(self.files[k])
            out = os.open(sealed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                _write_at(out, memoryview(header), 0)
                _copy_bytes(fd, out, self._size, len(header))
            finally:
                os.close(out)
            os.close(fd)
            fd = None
            os.unlink(data)
        except OSError as exc:
            raise ExportError(f"{sealed}: cannot write ({exc.strerror or exc})") from None
        finally:
            if fd is not None:
                os.close(fd)

    def seal(self) -> list[list[Entry]]:
        """Seal the open file; the entries of every file, in order."""
        if self._fd is not None:
            self._seal_open_file()
        return self.files

    def rename(self, names: list[str]) -> None:
        """Give the sealed files their export names, in order."""
        for k, name in enumerate(names):
            try:
                os.replace(self._part(k), self.folder / name)
            except OSError as exc:
                raise ExportError(f"{self.folder / name}: cannot write ({exc.strerror or exc})") from None

    def close(self) -> None:
        """Close the open data file (after a failure)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def _copy_bytes(src: int, dst: int, n: int, dst_offset: int) -> None:
    """Copy the first ``n`` bytes of file ``src`` to ``dst`` at ``dst_offset``: in the kernel, else through a
    buffer (a filesystem without ``copy_file_range``)."""
    done = 0
    try:
        while done < n:
            copied = os.copy_file_range(src, dst, n - done, done, dst_offset + done)
            if copied == 0:
                break
            done += copied
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    while done < n:
        chunk = os.pread(src, min(COPY_CHUNK_BYTES, n - done), done)
        if not chunk:
            raise OSError(errno.EIO, f"the data file ended {n - done} bytes early")
        _write_at(dst, memoryview(chunk), dst_offset + done)
        done += len(chunk)


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
