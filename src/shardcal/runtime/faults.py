"""Named fault points: where a test can make a run fail at a chosen moment, with no hook in a public signature.

Code marks a moment with ``fault_point("calibrate.committed", completed_layers=3)``; nothing happens unless a test
has armed that name in this process::

    with armed("calibrate.committed", lambda completed_layers: ...raise or kill...):
        calibrate(...)

Points in the package: ``calibrate.committed`` (after a calibration checkpoint commit; ``completed_layers``),
``checkpoint.commit`` (inside a commit, at each of its steps; ``step``), ``collect.commit`` (inside an activation
collection's checkpoint commit: ``step`` "inputs written", "manifest written"; ``rank``), ``collect.committed`` (after
such a commit; ``completed_layers``), ``export.unit`` (before the owner writes
an export unit; ``unit``, ``unit_name``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_armed: dict[str, Callable[..., None]] = {}


def fault_point(point: str, **context: Any) -> None:
    """Run the action armed for ``point`` (if any) with ``context``; a no-op otherwise."""
    action = _armed.get(point)
    if action is not None:
        action(**context)


@contextlib.contextmanager
def armed(name: str, action: Callable[..., None]) -> Iterator[None]:
    """Arm fault point ``name`` with ``action`` for the duration of the block (this process only)."""
    previous = _armed.get(name)
    _armed[name] = action
    try:
        yield
    finally:
        if previous is None:
            _armed.pop(name, None)
        else:
            _armed[name] = previous
