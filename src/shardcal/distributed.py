"""Process groups for shardcal: join one started by torchrun, or start N local processes ourselves.

``init_distributed()`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or, with
none set, forms a one-process group so that the same code path (FSDP2 included) runs in a plain ``python``.
``launch(fn, nproc)`` is what ``--nproc-per-node`` uses: it starts the processes, and if one of them fails it
terminates the others and reports which rank failed, instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import DistributedError

#: Collectives give up after this long (seconds) unless SHARDCAL_TIMEOUT says otherwise.
DEFAULT_TIMEOUT_S = 600


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get("SHARDCAL_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        raise DistributedError(f"SHARDCAL_TIMEOUT={raw!r} is not a number of seconds") from None
    return datetime.timedelta(seconds=seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join (or form) the default process group; return ``(rank, world_size)``. Idempotent.

    Backend: NCCL when CUDA is available, else gloo. On CUDA each process uses device ``LOCAL_RANK``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=collective_timeout())
    return dist.get_rank(), dist.get_world_size()


def _child(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any, status_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SHARDCAL_STATUS_DIR=status_dir,
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        init_distributed()
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which ends the siblings
        errors.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))
        errors.close()
        errors.join_thread()  # flush the report before the hard exit
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``nproc`` local processes forming one process group.

    ``fn`` must be importable (module level). If any process fails, the others are terminated and a
    :class:`DistributedError` names the first failed rank and its error.
    """
    if nproc < 1:
        raise DistributedError(f"--nproc-per-node must be >= 1, got {nproc}")
    import tempfile

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
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
    from .health import read_status_file

    own = [r for r in reports if r[1] != "DistributedError"]
    if own:  # a rank raised: its own error, its traceback once (unless it is a plain user error)
        rank, kind, message, tb = own[0]
        if kind not in _USER_ERRORS:
            sys.stderr.write(f"--- rank {rank} traceback ---\n{tb}")
        return DistributedError(f"rank {rank} failed: {message}" if kind in _USER_ERRORS else f"rank {rank} failed with {kind}: {message}")
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
    "ShardcalError", "ConfigError", "CheckpointError", "TokenizerError", "RecipeError", "DataError",
    "ModelLayoutError", "CalibrationCheckpointError", "ExportError", "DistributedError",
}
