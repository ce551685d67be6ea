"""When one rank fails, the others say which one and where — and never wait forever.

Every rank records what it is doing (``report_phase("calibrate model.layers.3")``) in the process group's
key-value store (and, under our own launcher, in a status file). :func:`rank_guard` wraps a distributed job:

* if this rank raises, it records ``failed: <error> (during <phase>)`` before the exception propagates, so its
  traceback is printed once, by this rank;
* if a collective fails under this rank — gloo notices a dead peer at once, NCCL and hung peers hit the
  process group's timeout (``SHARDCAL_TIMEOUT``) — it looks at the other ranks' records and raises a
  :class:`DistributedError` naming the rank that failed or vanished and the phase it was in.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from ..errors import DistributedError, ShardcalError
from .distributed import default_store, is_initialized, world

_KEY = "shardcal/status/{rank}"
_STATUS_DIR_ENV = "SHARDCAL_STATUS_DIR"
_COLLECTIVE_FAILED = "collective-failed"
_phase = "starting"


def _write(status: str) -> None:
    rank = world()[0] if is_initialized() else int(os.environ.get("RANK", "0"))
    status_dir = os.environ.get(_STATUS_DIR_ENV)
    if status_dir:
        path = Path(status_dir) / f"rank{rank}.status"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(status, encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass
    store = default_store()
    if store is not None:
        try:
            store.set(_KEY.format(rank=rank), status)
        except Exception:
            pass


def report_phase(phase: str) -> None:
    """Record what this rank is doing now (cheap: one store write)."""
    global _phase
    _phase = phase
    _write(f"running: {phase}")


def current_phase() -> str:
    return _phase


def read_status_file(status_dir: str | Path, rank: int) -> str | None:
    """A rank's last recorded status from our launcher's status directory (None if it never wrote one)."""
    path = Path(status_dir) / f"rank{rank}.status"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, DistributedError):
        return True
    backend_error = getattr(dist, "DistBackendError", ())
    if backend_error and isinstance(exc, backend_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in ("gloo", "Connection reset", "Connection closed", "NCCL", "timed out", "Timed out", "Broken pipe")
    )


def _diagnose(exc: BaseException) -> DistributedError:
    """Which rank failed or vanished, and in which phase, from the other ranks' records."""
    rank, size = world()
    store = default_store()
    statuses: dict[int, str | None] = {}
    if store is not None:
        try:
            store.set_timeout(datetime.timedelta(seconds=5))
            deadline = time.monotonic() + 3.0  # let the other survivors record that they are survivors
            while True:
                statuses = {}
                for other in range(size):
                    key = _KEY.format(rank=other)
                    statuses[other] = store.get(key).decode() if store.check([key]) else None
                pending = [r for r, s in statuses.items() if r != rank and s is not None and s.startswith("running")]
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        except Exception:
            return DistributedError(
                f"rank {rank}: lost contact with the other ranks during {_phase} (the rendezvous store is gone too: "
                f"rank 0 or the launcher probably died); cause: {str(exc).splitlines()[0][:200]}"
            )
    failed = [(r, s) for r, s in statuses.items() if r != rank and s is not None and s.startswith("failed")]
    if failed:
        r, s = failed[0]
        return DistributedError(f"rank {r} {s}; rank {rank} stopped during {_phase}")
    vanished = [(r, s) for r, s in statuses.items() if r != rank and s is not None and s.startswith("running")]
    if vanished:
        r, s = vanished[0]
        return DistributedError(
            f"rank {r} died or hung during {s.removeprefix('running: ')} (no error recorded: killed, out of memory, "
            f"or stuck past the collective timeout); rank {rank} stopped during {_phase}"
        )
    return DistributedError(f"rank {rank}: a collective failed during {_phase}: {str(exc).splitlines()[0][:300]}")


@contextlib.contextmanager
def rank_guard() -> Iterator[None]:
    """Turn a peer's failure into a clear :class:`DistributedError`; record this rank's own failure for the peers."""
    distributed = world()[1] > 1
    try:
        yield
    except BaseException as exc:
        if not distributed:
            raise
        if isinstance(exc, DistributedError):
            _write(_COLLECTIVE_FAILED)
            raise
        if _is_collective_failure(exc):
            _write(_COLLECTIVE_FAILED)
            raise _diagnose(exc) from exc
        kind = "" if isinstance(exc, ShardcalError) else f"{type(exc).__name__}: "
        first_line = (str(exc).splitlines() or [""])[0][:300]
        _write(f"failed: {kind}{first_line} (during {_phase})")
        raise
    else:
        if distributed:
            _write("done")
