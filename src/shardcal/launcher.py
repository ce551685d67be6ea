"""``launch(fn, nproc)``: start N local processes forming one process group (what ``--nproc-per-node`` uses).

If one of them fails, the launcher terminates the others and reports which rank failed and where, instead of
leaving them waiting in a collective.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from . import errors
from .distributed import destroy_distributed, free_port, init_distributed, is_initialized
from .errors import DistributedError
from .health import read_status_file
from .hostmem import pin_mmap_threshold


def _child(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any, status_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SHARDCAL_STATUS_DIR=status_dir,
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    pin_mmap_threshold()  # freed activations go back to the OS (see shardcal.hostmem)
    try:
        init_distributed()
        fn(*args)
    except BaseException as exc:
        errors.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))
        errors.close()
        errors.join_thread()  # flush the report before the hard exit
        sys.stderr.flush()
        os._exit(1)
    finally:
        if is_initialized():
            destroy_distributed()


def launch(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``nproc`` local processes forming one process group.

    ``fn`` must be importable (module level). If any process fails, the others are terminated and a
    :class:`DistributedError` names the first failed rank and its error.
    """
    if nproc < 1:
        raise DistributedError(f"--nproc-per-node must be >= 1, got {nproc}")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shardcal-status-") as status_dir:
        procs = [ctx.Process(target=_child, args=(r, nproc, port, fn, args, errors, status_dir)) for r in range(nproc)]
        for p in procs:
            p.start()
        first_failed = _wait_for_first_failure(procs)
        if first_failed is not None:
            # Survivors notice a dead peer in their next collective and report on their own; give them a moment,
            # then stop whoever is left (a rank stuck outside collectives would otherwise keep us waiting).
            deadline = time.monotonic() + GRACE_S
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join()
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        if first_failed is None:
            return
        raise _origin_of_failure(procs, sorted(reports), first_failed, status_dir)


def _origin_of_failure(procs: list[Any], reports: list[tuple], first_failed: int, status_dir: str) -> DistributedError:
    """The error that names the rank where the failure started (not a survivor that merely noticed it)."""
    own = [r for r in reports if r[1] != "DistributedError"]
    if own:  # a rank raised: its own error, its traceback once (unless it is a plain user error)
        rank, kind, message, tb = own[0]
        if kind not in _USER_ERRORS:
            sys.stderr.write(f"--- rank {rank} traceback ---\n{tb}")
        return DistributedError(
            f"rank {rank} failed: {message}" if kind in _USER_ERRORS else f"rank {rank} failed with {kind}: {message}"
        )
    reported = {r[0] for r in reports}
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in reported]
    silent.sort(key=lambda r: r != first_failed)  # the first to go is the likeliest origin
    rank = silent[0] if silent else first_failed
    if rank in reported:  # only survivors' reports: they name the failed rank themselves
        return DistributedError(next(r[2] for r in reports if r[0] == rank))
    status = read_status_file(status_dir, rank) or "no status recorded"
    code = procs[rank].exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return DistributedError(f"rank {rank} {how} (last status: {status}); the other ranks were stopped")


#: Seconds the launcher lets surviving ranks report a failed peer before it terminates them.
GRACE_S = 15.0


def _wait_for_first_failure(procs: list[Any]) -> int | None:
    """Block until all processes exit (None) or one exits non-zero (its rank)."""
    while any(p.is_alive() for p in procs):
        for r, p in enumerate(procs):
            if not p.is_alive() and p.exitcode != 0:
                return r
        time.sleep(0.1)
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            return r
    return None


#: Error classes whose message is enough (no traceback): shardcal's user-facing errors.
_USER_ERRORS = {
    cls.__name__ for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.ShardcalError)
}
