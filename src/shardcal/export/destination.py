"""Where an export goes: its destination checked (an earlier export is replaced only with ``overwrite``, never a
directory holding anything else), a staging directory beside it, and the finished export moved into place.

An export is written into a staging directory next to ``out_dir`` (same filesystem) and renamed to ``out_dir`` when
complete; an existing ``out_dir`` that its manifest (:data:`MANIFEST_NAME`) describes is renamed away first and
deleted after. What is written into the staging directory is :mod:`.export`'s and :mod:`.metadata`'s.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path

from ..calib.report import SQNR_PLOT_NAME
from ..errors import ExportError
from ..runtime.fsutil import check_creatable, check_replaceable, swap_dir_into_place, umask

#: Written last into every export: the files it holds. ``overwrite`` replaces only a directory it describes.
MANIFEST_NAME = "shardcal_export.json"
#: Files shardcal may add to a finished export (not in its manifest) that ``overwrite`` may replace as well.
EXPORT_EXTRAS: tuple[str, ...] = (SQNR_PLOT_NAME,)
#: In a staging directory until its export is complete: the host and process writing it. A later export to the same
#: destination removes a staging directory whose process is gone from this host (a killed run's: a streamed run's
#: holds most of the model), and nothing else.
STAGING_OWNER = ".shardcal-staging.json"


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _check_destination(out_dir: Path, overwrite: bool, flag: str = "overwrite=True") -> None:
    """``out_dir`` may be written: absent, empty, or (with ``overwrite``) an earlier export and nothing else."""
    check_replaceable(out_dir, MANIFEST_NAME, overwrite=overwrite, flag=flag, error=ExportError, extras=EXPORT_EXTRAS)


def check_destination(out_dir: str | Path, overwrite: bool = False, *, flag: str = "overwrite=True") -> None:
    """Raise :class:`ExportError` now if :func:`~shardcal.export.export.export_checkpoint` would refuse ``out_dir`` (call it before a long
    calibration): a directory holding anything but an earlier shardcal export (never replaced, whatever
    ``overwrite`` says), an earlier export without ``overwrite``, the working directory, a file, or a parent that
    cannot be created or written. Checks only; creates nothing. Not collective. ``flag``: how the message tells the caller to allow
    replacing (a command line says ``--overwrite``)."""
    out_dir = Path(out_dir).absolute()
    _check_destination(out_dir, overwrite, flag)
    check_creatable(out_dir.parent, ExportError, f"cannot export to {out_dir}")


def prepare_staging(out_dir: Path, overwrite: bool, tokenizer_dir: Path | None) -> Path:
    """Check the destination and create the staging directory beside it (rank 0)."""
    _check_destination(out_dir, overwrite)
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise ExportError(f"{tokenizer_dir}: tokenizer directory does not exist")
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"{parent}: cannot create the parent directory of {out_dir} ({_describe(exc)})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{parent}: not writable; cannot export to {out_dir}")
    _remove_dead_stagings(out_dir)
    try:
        staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(out_dir), dir=parent))
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it private; the export gets the usual permissions
        (staging / STAGING_OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        return staging
    except OSError as exc:
        raise ExportError(f"{parent}: cannot create a staging directory for {out_dir} ({_describe(exc)})") from None


def _staging_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.tmp-"


def unmark_staging(staging: Path) -> None:
    """The export in ``staging`` is complete: drop the owner record before the manifest lists the files."""
    (staging / STAGING_OWNER).unlink(missing_ok=True)


def _remove_dead_stagings(out_dir: Path) -> None:
    """Remove the staging directories of ``out_dir`` that an export on this host left when its process died without
    cleaning up (SIGKILL, a preemption), each with a warning; a directory without shardcal's owner record, another
    host's, or a live process's is left alone."""
    for candidate in sorted(out_dir.parent.glob(glob.escape(_staging_prefix(out_dir)) + "*")):
        if candidate.is_symlink() or not candidate.is_dir():
            continue
        try:
            owner = json.loads((candidate / STAGING_OWNER).read_text(encoding="utf-8")[:4096])
        except (OSError, ValueError):
            continue
        pid = owner.get("pid") if isinstance(owner, dict) else None
        if not isinstance(pid, int) or pid <= 0 or owner.get("host") != socket.gethostname() or _alive(pid):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        warnings.warn(
            f"{candidate}: removed the staging directory an export to {out_dir} left when its process ({pid}) "
            "was killed",
            stacklevel=2,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists under another user
        return True
    return True


def swap_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Check ``out_dir`` once more (a file a user put there meanwhile stops it), then move ``staging`` there
    (:func:`~shardcal.runtime.fsutil.swap_dir_into_place`: an earlier export is put back if that fails)."""
    _check_destination(out_dir, overwrite)
    swap_dir_into_place(staging, out_dir, ExportError, "export")
