"""Shard files laid out as their tensors come (a streamed run whose layers may fall back): the same files, byte for
byte, as the writer that knows the layout up front, cut where the export plan cuts them; safetensors reads them."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardcal.errors import ExportError
from shardcal.export import shards
from shardcal.export.layout import Entry, Unit, split_into_shards
from shardcal.export.shards import RankShardWriter, RunningShardWriter

DTYPES = (torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn, torch.int32)


def _tensors(seed: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)))
        values = torch.randn(shape, generator=g) * 50
        out[f"m.{i}.w"] = values.to(dtype) if dtype.is_floating_point else values.clamp(-100, 100).to(dtype)
    return out


def _entries(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    return [Entry(k, t.dtype, tuple(t.shape), ("param", k)) for k, t in tensors.items()]


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("max_shard_bytes", [1, 300, 1000, 10**9])
def test_files_are_the_planned_writers_cut_where_the_plan_cuts(tmp_path, max_shard_bytes):
    tensors = _tensors(seed=max_shard_bytes, count=23)
    entries = _entries(tensors)
    planned = split_into_shards([Unit(0, "<root>", "root", None, 0, entries)], 1, max_shard_bytes)
    (tmp_path / "planned").mkdir()
    (tmp_path / "running").mkdir()
    fixed = RankShardWriter(tmp_path / "planned", planned)
    running = RunningShardWriter(tmp_path / "running", 0, max_shard_bytes)
    for e in entries:
        fixed.write(e, tensors[e.key])
        running.write(e, tensors[e.key])
    files = running.seal()
    assert [[e.key for e in f] for f in files] == [[e.key for e in s.entries] for s in planned]
    if max_shard_bytes == 1:
        assert len(files) == len(entries)  # each tensor alone in its file
    running.rename([s.file for s in planned])
    assert sorted(p.name for p in (tmp_path / "running").iterdir()) == sorted(s.file for s in planned)
    for s in planned:
        assert (tmp_path / "running" / s.file).read_bytes() == (tmp_path / "planned" / s.file).read_bytes()
        for k, t in _read(tmp_path / "running" / s.file).items():
            assert t.dtype == tensors[k].dtype and torch.equal(t.view(torch.uint8), tensors[k].view(torch.uint8))


def test_a_file_filled_exactly_takes_the_next_tensor_in_the_next_file(tmp_path):
    """Two 4-byte tensors fill an 8-byte file exactly: they share it, as the plan says; the third starts the next."""
    tensors = {f"m.{i}.w": torch.tensor([float(i)]) for i in range(3)}
    running = RunningShardWriter(tmp_path, 0, 8)
    for e in _entries(tensors):
        running.write(e, tensors[e.key])
    assert [[e.key for e in f] for f in running.seal()] == [["m.0.w", "m.1.w"], ["m.2.w"]]


def test_without_a_kernel_copy_the_data_goes_through_a_buffer(tmp_path, monkeypatch):
    tensors = _tensors(seed=7, count=9)
    entries = _entries(tensors)

    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    monkeypatch.setattr(shards, "COPY_CHUNK_BYTES", 7)  # many short reads and writes
    planned = split_into_shards([Unit(0, "<root>", "root", None, 0, entries)], 1, 500)
    running = RunningShardWriter(tmp_path, 0, 500)
    for e in entries:
        running.write(e, tensors[e.key])
    running.seal()
    running.rename([s.file for s in planned])
    got = {k: t for s in planned for k, t in _read(tmp_path / s.file).items()}
    assert list(got) == list(tensors)
    assert all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)) for k, t in tensors.items())
    assert not list(tmp_path.glob(".rank*"))  # the data files are gone


def test_a_tensor_unlike_its_entry_and_an_unwritable_folder_are_named(tmp_path):
    running = RunningShardWriter(tmp_path / "missing", 0, 100)
    entry = Entry("m.w", torch.float32, (2, 3), ("param", "m.w"))
    with pytest.raises(RuntimeError, match=r"'m.w' is torch.float32 \[3, 2\], planned torch.float32 \[2, 3\]"):
        running.write(entry, torch.zeros(3, 2))
    with pytest.raises(ExportError, match=r"missing/\.rank0-0\.data: cannot write"):
        running.write(entry, torch.zeros(2, 3))
