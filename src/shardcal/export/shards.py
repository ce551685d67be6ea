"""Streaming safetensors shard files whose headers are known before their data (see :mod:`.layout`).

A file is ``[u64 little-endian header length][JSON header, space-padded to 8 bytes][tensor bytes in header
order]`` — the safetensors format. The header comes from the plan, so each tensor's bytes are written at their place
the moment its unit is gathered (or read in) and encoded, in whatever order the units come, and the file never sits
in memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from pathlib import Path

import torch

from ..errors import ExportError
from .layout import Entry, Shard

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
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise RuntimeError(
                f"export plan: {entry.key!r} is {tensor.dtype} {list(tensor.shape)}, planned {entry.dtype} {list(entry.shape)}"
            )
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


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
