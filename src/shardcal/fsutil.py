"""Filesystem helpers shared by everything that writes: atomic file writes, creatability checks, JSON reading.

An atomic write goes to a temporary file in the same directory, is flushed to disk, gets the permissions a plain
``open()`` would give it (``0o666`` less the process umask; ``mkstemp`` would leave ``0o600``), and is renamed over
the target: a reader sees the old file or the new one, never half of one. A failed write removes its temporary
file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import ShardcalError


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
