"""``launch(fn, nproc)``: start N local processes forming one process group (what ``--nproc-per-node`` uses).

If one of them fails, the launcher terminates the others and reports which rank failed and where, instead of
leaving them waiting in a collective.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from .. import errors
from ..errors import CalibrationInterrupted, DistributedError, RunInterrupted
from .distributed import destroy_distributed, host_rendezvous, init_distributed, is_initialized
from .health import read_status_file
from .hostmem import pin_mmap_threshold


def _child(
    rank: int, nproc: int, env: dict[str, str], fn: Callable[..., Any], args: tuple, errors: Any, status_dir: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        SHARDCAL_STATUS_DIR=status_dir, **env,
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    pin_mmap_threshold()  # freed activations go back to the OS (see shardcal.runtime.hostmem)
    try:
        init_distributed()
        fn(*args)
    except KeyboardInterrupt as exc:  # Ctrl-C reaches every rank: the launcher says "interrupted" once
        if rank == 0 and isinstance(exc, _RELAYED):
            errors.put((rank, _INTERRUPTED_AT, type(exc).__name__, exc.args))  # for the launcher to re-raise
        _hard_exit(errors, INTERRUPTED)
    except BaseException as exc:  # a failed rank does not wait for its peers in a teardown: report and go
        errors.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))
        _hard_exit(errors, 1)
    if is_initialized():
        destroy_distributed()
    _hard_exit(errors, 0)


def _hard_exit(errors: Any, status: int) -> None:
    """Flush the error queue and stdio, then leave without the interpreter's teardown: that runs C++ destructors
    while process-group threads may still be alive, and ends a finished rank with "terminate called without an
    active exception" (SIGABRT)."""
    errors.close()
    errors.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: The error-queue kind of rank 0's report of what an interrupted run wrote and lost (never a failure).
_INTERRUPTED_AT = "interrupted"
#: The interruptions rank 0 reports to the launcher, which raises them again as they were.
_RELAYED: tuple[type[KeyboardInterrupt], ...] = (CalibrationInterrupted, RunInterrupted)
#: A rank's exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: Seconds the launcher gives interrupted ranks to leave on their own before it terminates them.
INTERRUPT_GRACE_S = 5.0


def launch(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``nproc`` local processes forming one process group.

    ``fn`` must be importable (module level). If any process fails, the others are terminated and a
    :class:`DistributedError` names the first failed rank and its error; a user error (a
    :class:`~shardcal.errors.ShardcalError`) that every rank raised with the same message is raised as itself. On Ctrl-C (SIGINT to the process group)
    every rank is stopped, nothing is left behind (status folder, queues), and ``KeyboardInterrupt`` is raised once.
    """
    if nproc < 1:
        raise DistributedError(f"--nproc-per-node must be >= 1, got {nproc}")
    warn_if_oversubscribed(nproc)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    store, env = host_rendezvous()  # kept alive (referenced) until the ranks are done
    status_dir = tempfile.mkdtemp(prefix="shardcal-status-")
    procs = [ctx.Process(target=_child, args=(r, nproc, env, fn, args, errors, status_dir)) for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        first_failed = _wait_for_first_failure(procs)
        if first_failed is not None:
            _stop_survivors(procs)
        for p in procs:
            p.join()
        if any(p.exitcode == INTERRUPTED for p in procs):
            raise KeyboardInterrupt
        reports = _drain(errors)  # in the order the ranks failed: a peer fails only after it lost the first
        if first_failed is not None:
            raise _origin_of_failure(procs, reports, first_failed, status_dir)
    except KeyboardInterrupt:  # Ctrl-C reached the ranks too: let them close their progress bar and go
        _stop_now(procs, grace=INTERRUPT_GRACE_S)
        relayed = [r for r in _drain(errors) if r[1] == _INTERRUPTED_AT]
        if relayed:  # rank 0's own account of what was written and lost, as itself
            kind = {c.__name__: c for c in _RELAYED}[relayed[0][2]]
            raise kind(*relayed[0][3]) from None
        status = read_status_file(status_dir, 0)
        raise RunInterrupted(
            "interrupted while the ranks were starting: nothing was written"
            if status is None
            else f"interrupted (rank 0 was at: {status.removeprefix('running: ')})"
        ) from None
    finally:
        _drain(errors)
        errors.close()
        errors.join_thread()
        shutil.rmtree(status_dir, ignore_errors=True)
        del store


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_if_oversubscribed(nproc: int) -> None:
    """One warning when ``nproc`` CPU ranks (no CUDA device) share fewer cores: each rank then waits for a core
    in every collective, and the run is slower than with one rank per core."""
    import warnings

    cores = usable_cores()
    if nproc > cores and not torch.cuda.is_available():
        warnings.warn(
            f"--nproc-per-node {nproc} starts {nproc} ranks on {cores} CPU core(s): each rank gets less than a core "
            f"and the run is slower than with {cores}; use at most {cores}",
            stacklevel=3,
        )


def _drain(errors: Any) -> list[tuple]:
    reports = []
    while True:
        try:
            reports.append(errors.get_nowait())
        except (queue.Empty, OSError, ValueError):
            return reports


def _stop_survivors(procs: list[Any]) -> None:
    """Survivors notice a dead peer in their next collective and report on their own; give them a moment, then
    stop whoever is left (a rank stuck outside collectives would otherwise keep us waiting)."""
    deadline = time.monotonic() + GRACE_S
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    _stop_now(procs)


def _stop_now(procs: list[Any], grace: float = 0.0) -> None:
    """Stop the ranks still running: after ``grace`` seconds, SIGTERM, and SIGKILL for one that ignores it."""
    deadline = time.monotonic() + grace
    while grace and any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _origin_of_failure(
    procs: list[Any], reports: list[tuple], first_failed: int, status_dir: str
) -> errors.ShardcalError:
    """The error that names the rank where the failure started (not a survivor that merely noticed it); a user
    error that every rank raised alike, as itself."""
    own = [r for r in reports if r[1] != "DistributedError"]
    # The first report is the first rank to go: a rank puts its report before it exits, and a peer that saw its
    # connection close raises only after that (the first rank seen dead is no guide: two ranks that died within
    # one poll are seen in rank order). A peer's lost connection never counts as the origin.
    own.sort(key=lambda r: _is_peer_loss(r[2]))  # stable: arrival order otherwise
    if own:  # a rank raised: its own error, its traceback once (unless it is a plain user error)
        rank, kind, message, tb = own[0]
        if kind in _USER_ERRORS and {r[0] for r in own if r[1:3] == (kind, message)} == set(range(len(procs))):
            return getattr(errors, kind)(message)  # every rank refused the same input: no rank to name
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


#: What gloo and NCCL say on the ranks that lose a peer: a consequence of a failure elsewhere, not its origin.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "communicator was aborted")  # fmt: skip


def _is_peer_loss(message: str) -> bool:
    return any(text in message for text in _PEER_LOSS)


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
