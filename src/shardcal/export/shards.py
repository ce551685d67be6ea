"""Streaming safetensors shard files whose headers are known before their data (see :mod:`.layout`).

A file is ``[u64 little-endian header length][JSON header, space-padded to 8 bytes][tensor bytes in header
order]`` — the safetensors format. The header comes from the plan, so each tensor's bytes are appended the moment
its unit is gathered and encoded, and the file never sits in memory.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from pathlib import Path
from typing import BinaryIO

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


def write_tensor(handle: BinaryIO, t: torch.Tensor) -> None:
    """Append the tensor's raw little-endian bytes to ``handle``.

    Read through a ctypes view of the CPU copy's memory, not ``Tensor.numpy()``: numpy marks the storage
    non-resizable, and FSDP2 must free (resize to 0) the storage of a gathered parameter when it reshards.
    """
    flat = t.detach().to("cpu").contiguous()
    n = flat.numel() * flat.element_size()
    if n:
        handle.write((ctypes.c_ubyte * n).from_address(flat.data_ptr()))


class RankShardWriter:
    """Writes this rank's shards, tensor by tensor, in plan order; each file opens with its full header."""

    def __init__(self, folder: Path, shards: list[Shard]):
        if sys.byteorder != "little":
            raise ExportError("safetensors export needs a little-endian host")
        self.folder = folder
        self.queue = [(s, i) for s in shards for i in range(len(s.entries))]
        self.pos = 0
        self.handle: BinaryIO | None = None
        self.path: Path | None = None

    @property
    def done(self) -> bool:
        return self.pos == len(self.queue)

    def write(self, entry: Entry, tensor: torch.Tensor) -> None:
        if self.done:
            raise RuntimeError(f"export plan: unexpected tensor {entry.key!r} (this rank's shards are complete)")
        shard, i = self.queue[self.pos]
        expected = shard.entries[i]
        if expected is not entry:
            raise RuntimeError(f"export plan: wrote {entry.key!r} where {expected.key!r} was planned")
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise RuntimeError(
                f"export plan: {entry.key!r} is {tensor.dtype} {list(tensor.shape)}, planned {entry.dtype} {list(entry.shape)}"
            )
        if i == 0:
            self.path = self.folder / shard.file
            try:
                self.handle = open(self.path, "wb")
                self.handle.write(header_bytes(shard.entries))
            except OSError as exc:
                raise ExportError(f"{self.path}: cannot write ({exc.strerror or exc})") from None
        try:
            write_tensor(self.handle, tensor)
        except OSError as exc:
            raise ExportError(f"{self.path}: cannot write ({exc.strerror or exc})") from None
        self.pos += 1
        if i == len(shard.entries) - 1:
            self._close_file()

    def _close_file(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                handle.close()
            except OSError as exc:
                raise ExportError(f"{self.path}: cannot write ({exc.strerror or exc})") from None

    def close(self) -> None:
        """Close an open file (after a failure; complete files are closed as their last tensor is written)."""
        try:
            self._close_file()
        except ExportError:
            pass
