"""Filesystem helpers shared by everything that writes: atomic file writes, creatability checks, JSON reading.

An atomic write goes to a temporary file in the same directory, is flushed to disk, gets the permissions a plain
``open()`` would give it (``0o666`` less the process umask; ``mkstemp`` would leave ``0o600``), and is renamed over
the target: a reader sees the old file or the new one, never half of one. A failed write removes its temporary
file.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Container, Iterator
from pathlib import Path

from ..errors import ShardcalError


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on success it replaces ``path`` atomically, on error it goes.

    ``suffix`` keeps a file type visible to writers that look at it (``.png`` for matplotlib).
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def remove_matching_files(
    folder: Path, own: re.Pattern[str], keep: Container[str] = (), after_each: Callable[[], None] | None = None
) -> int:
    """Delete the files of ``folder`` whose names ``own`` matches in full and ``keep`` does not hold (a
    directory's own files, not a user's), calling ``after_each()`` after each one. Returns the bytes freed."""
    freed = 0
    for path in sorted(folder.iterdir()):
        if own.fullmatch(path.name) and path.name not in keep:
            with contextlib.suppress(FileNotFoundError):  # another rank may have removed it first
                freed += path.stat().st_size
            path.unlink(missing_ok=True)
            if after_each is not None:
                after_each()
    return freed


def remove_manifested_dir(folder: str | Path, manifest: str, own: re.Pattern[str]) -> int:
    """Delete a directory whose ``manifest`` file says what it holds: the manifest first (so a half-removed
    directory is never read as complete), then the files ``own`` matches, then the directory when nothing else is
    in it. Returns the bytes freed; 0 without a manifest. Files that are not its own are left alone."""
    folder = Path(folder)
    if not (folder / manifest).is_file():
        return 0
    freed = (folder / manifest).stat().st_size
    (folder / manifest).unlink()
    freed += remove_matching_files(folder, own)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return freed


#: Files up to this size are recorded in a manifest with their SHA-256 as well as their size, so that an edit that
#: keeps the size (a changed number in config.json) is seen too; larger ones (weight shards) by their size only, so
#: that checking a large output does not read it all again.
HASHED_FILE_BYTES = 64 * 2**20


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, manifest: str, **fields: object) -> None:
    """Write ``folder/manifest`` (JSON, atomically): ``fields`` plus ``files``, every file now in ``folder`` with
    its size, and ``sha256``, the digest of each of them up to :data:`HASHED_FILE_BYTES` — what :func:`foreign_entry`
    later recognises as written by shardcal, and :func:`changed_entry` as changed since."""
    import json

    paths = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != manifest]
    files = {p.name: p.stat().st_size for p in paths}
    digests = {p.name: file_sha256(p) for p in paths if files[p.name] <= HASHED_FILE_BYTES}
    atomic_write_text(folder / manifest, json.dumps({**fields, "files": files, "sha256": digests}, indent=1) + "\n")


def _listed(folder: Path, manifest: str) -> dict | None:
    """The JSON object of ``folder/manifest`` when it is readable and lists its files; None otherwise."""
    import json

    try:
        record = json.loads((folder / manifest).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


def foreign_entry(folder: Path, manifest: str, extras: Container[str] = ()) -> str | None:
    """The first entry of directory ``folder`` that shardcal did not write, or None when every entry is its own.

    Its own: ``manifest`` and the files that manifest lists (see :func:`write_manifest`), plus ``extras`` (files
    shardcal adds beside them, e.g. a plot) — and nothing at all without a readable manifest. Subdirectories,
    links and unlisted files are foreign. This is the rule that keeps ``--overwrite`` from deleting a user's file.
    """
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    record = _listed(folder, manifest)
    own = {str(name) for name in record["files"]} | {manifest} if record is not None else set()
    for path in entries:
        mine = path.name in own or (bool(own) and path.name in extras)
        if not mine or path.is_symlink() or not path.is_file():
            return path.name
    return None


def changed_entry(folder: Path, manifest: str) -> tuple[str, str] | None:
    """``(file, what differs)`` for the first file ``folder/manifest`` lists whose size, or whose SHA-256 where the
    manifest records one, is no longer what shardcal wrote (a user edited it); None when none is (a listed file
    since removed is not a change). Without a readable manifest: None (:func:`foreign_entry` refuses such a
    directory)."""
    record = _listed(folder, manifest)
    if record is None:
        return None
    digests = record.get("sha256") if isinstance(record.get("sha256"), dict) else {}
    for name, size in sorted(record["files"].items()):
        path = folder / str(name)
        if not path.is_file() or path.is_symlink():
            continue
        if path.stat().st_size != size:
            return str(name), f"{path.stat().st_size} bytes, written as {size}"
        if name in digests and file_sha256(path) != digests[name]:
            return str(name), "its content differs from what was written"
    return None


def check_replaceable(
    folder: Path,
    manifest: str,
    *,
    overwrite: bool,
    flag: str,
    error: type[ShardcalError],
    extras: Container[str] = (),
    replace_changed: bool = False,
) -> None:
    """Refuse to write into ``folder`` unless it is absent or empty, or it holds only an earlier output of the same
    shardcal writer (:func:`foreign_entry`), unchanged since (:func:`changed_entry`; ``replace_changed``: a cache
    that repairs itself), and ``overwrite`` is set (``flag``: how the caller names that option). A file where the
    directory should be, and a directory that is or contains the working directory, are refused too. Checks only;
    changes nothing."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory itself is gone: nothing left to protect
        cwd = None
    if cwd is not None and (folder.resolve() == cwd or cwd.is_relative_to(folder.resolve())):
        relation = "is" if folder.resolve() == cwd else "contains"
        raise error(f"{folder}: {relation} the working directory {cwd}; write the output elsewhere")
    if not (folder.exists() or folder.is_symlink()):
        return
    if folder.is_symlink() or not folder.is_dir():
        raise error(f"{folder}: exists and is not a directory")
    if not any(folder.iterdir()):
        return
    foreign = foreign_entry(folder, manifest, extras)
    if foreign is not None:
        raise error(
            f"{folder}: holds {foreign!r}, which shardcal did not write; {flag} replaces only an earlier shardcal "
            "output or an empty directory, so choose another output directory"
        )
    changed = None if replace_changed else changed_entry(folder, manifest)
    if changed is not None:
        raise error(
            f"{folder}: {changed[0]!r} was changed after shardcal wrote it ({changed[1]}); {flag} replaces only an "
            "unchanged earlier shardcal output, so keep your edits elsewhere or choose another output directory"
        )
    if not overwrite:
        raise error(f"{folder}: holds an earlier shardcal output (pass {flag} to replace it)")


def swap_dir_into_place(new: Path, target: Path, error: type[ShardcalError], what: str) -> None:
    """Rename directory ``new`` to ``target`` (same filesystem). An existing non-empty ``target`` (which the caller
    checked just before) is renamed aside first, put back when the rename of ``new`` fails (a full disk), and
    deleted only once ``new`` is in place; an empty one is removed. A failure raises ``error`` naming ``target``
    (``what``: what was being moved, e.g. ``"export"``); ``new`` is the caller's to remove then."""
    import shutil
    import uuid

    old, emptied = None, False
    try:
        if target.exists():
            if any(target.iterdir()):
                old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
                os.rename(target, old)
            else:
                target.rmdir()
                emptied = True
        os.rename(new, target)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if emptied:
            with contextlib.suppress(OSError):
                target.mkdir()
        if old is not None:
            try:
                os.rename(old, target)
            except OSError as again:
                raise error(
                    f"{target}: cannot move the finished {what} into place ({reason}), nor the earlier one back "
                    f"({again.strerror or again}): the earlier one is in {old}"
                ) from None
        raise error(f"{target}: cannot move the finished {what} into place ({reason}); nothing was changed") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_creatable(path: str | Path, error: type[ShardcalError], purpose: str) -> None:
    """Raise ``error`` now if directory ``path`` could not be created and written (before hours of work).

    The nearest existing ancestor must be a writable directory. ``purpose`` completes the message, e.g.
    ``"cannot export to /out"``. Checks only; creates nothing.
    """
    ancestor = Path(path).absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise error(f"{ancestor}: is not a directory; {purpose}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise error(f"{ancestor}: not writable; {purpose}")


def missing_ancestors(path: str | Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, deepest first: what writing ``path`` would create (and
    what :func:`remove_empty_dirs` removes again when they are left empty)."""
    out = []
    ancestor = Path(path).absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        out.append(ancestor)
        ancestor = ancestor.parent
    return out


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (deepest first) that is an empty directory; one that holds anything stays, and so do
    the ones above it."""
    for folder in dirs:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): its ancestors hold it
            if folder.exists():
                return


def check_apart(
    path: str | Path, what: str, protected: dict[str, str | Path | None], error: type[ShardcalError]
) -> None:
    """Refuse ``path`` (a directory about to be written, ``what`` as the user named it, e.g. ``--out``) when it is,
    contains or lies inside one of ``protected`` (label -> path; None entries are skipped) — so that no output or
    checkpoint can overwrite or delete a run's input. Symlinks are resolved; nothing is created."""
    target = Path(path).resolve()
    for label, other in protected.items():
        if other is None:
            continue
        source = Path(other).resolve()
        if target == source:
            relation = "is"
        elif source.is_relative_to(target):
            relation = "contains"
        elif target.is_relative_to(source):
            relation = "lies inside"
        else:
            continue
        raise error(
            f"{what} {path} {relation} {label} {other}; write it elsewhere (refused even when overwriting is allowed)"
        )


#: JSON files shardcal reads (config.json, indexes, tokenizer.json, manifests) larger than this are refused before
#: anything is read: the largest real ones are tens of megabytes, and a forged size must not exhaust memory.
MAX_JSON_BYTES = 256 * 2**20


def read_bounded_text(path: Path, error: type[ShardcalError], max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 (JSON) text of ``path``, refused (``error`` naming the file) beyond ``max_bytes`` or when unreadable."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if size > max_bytes:
        raise error(f"{path}: implausibly large ({size} bytes; at most {max_bytes} are read)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid JSON text (not UTF-8: {exc})") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None


def read_json_object(path: Path, error: type[ShardcalError]) -> dict:
    """The JSON object in ``path``; ``error`` naming the file when it is unreadable, too large, not JSON, or not an
    object."""
    import json

    text = read_bounded_text(path, error)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
