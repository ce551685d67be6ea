"""Atomic writes: all or nothing, and the permissions a plain open() gives."""

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

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
    import hashlib
    import json

    from shardcal.runtime.fsutil import foreign_entry, write_manifest

    folder = tmp_path / "out"
    folder.mkdir()
    assert foreign_entry(folder, "m.json") is None  # empty
    (folder / "a.bin").write_bytes(b"12")
    assert foreign_entry(folder, "m.json", extras=("plot.png",)) == "a.bin"  # no manifest: nothing is known
    write_manifest(folder, "m.json", writer="test")
    sha = hashlib.sha256(b"12").hexdigest()
    assert json.loads((folder / "m.json").read_text()) == {
        "writer": "test",
        "files": {"a.bin": 2},
        "sha256": {"a.bin": sha},
    }
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


def test_a_file_named_like_an_extra_is_foreign_without_a_manifest(tmp_path):
    """A directory holding only a file named like one shardcal adds beside its output (the SQNR plot), with no
    manifest, is not an earlier output: nothing in it is known to be shardcal's."""
    from shardcal.errors import ExportError
    from shardcal.runtime.fsutil import check_replaceable, foreign_entry

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "plot.png").write_bytes(b"a user's picture")
    assert foreign_entry(folder, "m.json", extras=("plot.png",)) == "plot.png"
    with pytest.raises(ExportError, match=r"holds 'plot.png', which shardcal did not write"):
        check_replaceable(folder, "m.json", overwrite=True, flag="--overwrite", error=ExportError, extras=("plot.png",))


def test_changed_entry_sees_an_edit_by_size_or_content(tmp_path, monkeypatch):
    """A listed file whose size changed, or whose bytes changed at the same size (its SHA-256, recorded for files up
    to the threshold), is named; a removed one is not a change; a file over the threshold is compared by size."""
    from shardcal.errors import ExportError
    from shardcal.runtime import fsutil

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "big.bin").write_bytes(b"x" * 100)
    (folder / "gone.txt").write_text("soon removed")
    monkeypatch.setattr(fsutil, "HASHED_FILE_BYTES", 100)  # big.bin (100 bytes) is still hashed: the limit is inclusive
    fsutil.write_manifest(folder, "m.json")
    assert sorted(json.loads((folder / "m.json").read_text())["sha256"]) == ["big.bin", "config.json", "gone.txt"]
    assert fsutil.changed_entry(folder, "m.json") is None
    (folder / "gone.txt").unlink()
    assert fsutil.changed_entry(folder, "m.json") is None
    (folder / "big.bin").write_bytes(b"y" * 100)
    assert fsutil.changed_entry(folder, "m.json") == ("big.bin", "its content differs from what was written")
    (folder / "big.bin").write_bytes(b"x" * 100)
    (folder / "config.json").write_text('{"a": 2}')  # same size, another value
    assert fsutil.changed_entry(folder, "m.json") == ("config.json", "its content differs from what was written")
    with pytest.raises(ExportError, match=r"out: 'config.json' was changed after shardcal wrote it \(its content "):
        fsutil.check_replaceable(folder, "m.json", overwrite=True, flag="--overwrite", error=ExportError)
    fsutil.check_replaceable(  # a cache that repairs itself may replace it
        folder, "m.json", overwrite=True, flag="--overwrite", error=ExportError, replace_changed=True
    )
    (folder / "config.json").write_text('{"a": 10}')
    assert fsutil.changed_entry(folder, "m.json") == ("config.json", "9 bytes, written as 8")
    (folder / "config.json").write_text('{"a": 1}')
    monkeypatch.setattr(fsutil, "HASHED_FILE_BYTES", 99)
    fsutil.write_manifest(folder, "m.json")
    assert sorted(json.loads((folder / "m.json").read_text())["sha256"]) == ["config.json"]
    (folder / "big.bin").write_bytes(b"y" * 100)  # over the limit: its size is all that is compared
    assert fsutil.changed_entry(folder, "m.json") is None


def _failing_rename(monkeypatch, fails: Callable[[str, str], bool]):
    real = os.rename

    def rename(src, dst):
        if fails(str(src), str(dst)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)


def test_a_failed_swap_puts_the_earlier_output_back(tmp_path, monkeypatch):
    """The new directory cannot be renamed into place (a full disk): the earlier one is back where it was, nothing
    else is left beside it, and the error names the destination; an empty destination is still there."""
    from shardcal.errors import ExportError
    from shardcal.runtime.fsutil import swap_dir_into_place

    target, new = tmp_path / "out", tmp_path / ".out.tmp-1"
    target.mkdir()
    (target / "old.txt").write_text("earlier")
    new.mkdir()
    (new / "new.txt").write_text("later")
    _failing_rename(monkeypatch, lambda src, dst: src == str(new))
    with pytest.raises(ExportError, match=rf"^{target}: cannot move the finished import into place \(No space left"):
        swap_dir_into_place(new, target, ExportError, "import")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-1", "out"]
    assert [p.name for p in target.iterdir()] == ["old.txt"] and (target / "old.txt").read_text() == "earlier"
    (target / "old.txt").unlink()
    with pytest.raises(ExportError, match="cannot move the finished import into place"):
        swap_dir_into_place(new, target, ExportError, "import")
    assert target.is_dir() and list(target.iterdir()) == []
    monkeypatch.undo()
    swap_dir_into_place(new, target, ExportError, "import")
    assert [p.name for p in target.iterdir()] == ["new.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_swap_that_cannot_put_the_earlier_output_back_says_where_it_is(tmp_path, monkeypatch):
    from shardcal.errors import ExportError
    from shardcal.runtime.fsutil import swap_dir_into_place

    target, new = tmp_path / "out", tmp_path / ".out.tmp-1"
    for folder in (target, new):
        folder.mkdir()
        (folder / "f").write_text(folder.name)
    _failing_rename(monkeypatch, lambda src, dst: src == str(new) or dst == str(target))
    with pytest.raises(
        ExportError, match=r"nor the earlier one back \(No space left on device\): the earlier one is in"
    ) as caught:
        swap_dir_into_place(new, target, ExportError, "export")
    kept = Path(str(caught.value).rsplit("the earlier one is in ", 1)[1])
    assert kept.parent == tmp_path and (kept / "f").read_text() == "out"
