"""Small filesystem checks shared by everything that writes a directory (export, calibration checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ShardcalError


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


def read_json_object(path: Path, error: type[ShardcalError]) -> dict:
    """The JSON object in ``path``; ``error`` naming the file when it is unreadable, not JSON, or not an object."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
