"""Atomic writes: all or nothing, and the permissions a plain open() gives."""

import os

import pytest

from shardcal.runtime.fsutil import atomic_path, atomic_write_text


def test_atomic_write_gets_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        path = atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert path.read_text() == "{}" and (path.stat().st_mode & 0o777) == 0o640


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
