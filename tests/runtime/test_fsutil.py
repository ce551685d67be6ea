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


def test_foreign_entry_knows_only_what_a_manifest_lists(tmp_path):
    """What ``--overwrite`` may replace: the manifest's files and the writer's extras, and nothing without a readable
    manifest; a link or a directory is never shardcal's."""
    import json

    from shardcal.runtime.fsutil import foreign_entry, write_manifest

    folder = tmp_path / "out"
    folder.mkdir()
    assert foreign_entry(folder, "m.json") is None  # empty
    (folder / "a.bin").write_bytes(b"12")
    assert foreign_entry(folder, "m.json", extras=("plot.png",)) == "a.bin"  # no manifest: nothing is known
    write_manifest(folder, "m.json", writer="test")
    assert json.loads((folder / "m.json").read_text()) == {"writer": "test", "files": {"a.bin": 2}}
    assert foreign_entry(folder, "m.json") is None
    (folder / "plot.png").write_bytes(b"")
    assert foreign_entry(folder, "m.json") == "plot.png"
    assert foreign_entry(folder, "m.json", extras=("plot.png",)) is None
    (folder / "plot.png").unlink()
    (folder / "a.bin").unlink()
    (folder / "a.bin").symlink_to(tmp_path / "elsewhere")  # a listed name that is now a link
    assert foreign_entry(folder, "m.json") == "a.bin"
    (folder / "a.bin").unlink()
    (folder / "a.bin").mkdir()
    assert foreign_entry(folder, "m.json") == "a.bin"
    (folder / "a.bin").rmdir()
    (folder / "m.json").write_text("not json")
    assert foreign_entry(folder, "m.json") == "m.json"
