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


def _child(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        init_distributed()
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which ends the siblings
        errors.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))
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
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, fn, args, errors)) for r in range(nproc)]
    for p in procs:
        p.start()
    failed = None
    while any(p.is_alive() for p in procs):
        dead = [(r, p) for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
        if dead:
            failed = dead[0]
            break
        time.sleep(0.2)
    if failed is not None:
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
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if reports:
        rank, kind, message, tb = sorted(reports)[0]
        if kind not in _USER_ERRORS:
            sys.stderr.write(f"--- rank {rank} traceback ---\n{tb}")
        raise DistributedError(f"rank {rank} failed: {message}" if kind in _USER_ERRORS else f"rank {rank} failed with {kind}: {message}")
    if bad and failed is not None:
        rank, code = failed[0], failed[1].exitcode
        raise DistributedError(f"rank {rank} died (exit code {code}); the other ranks were stopped")


#: Error classes whose message is enough (no traceback): shardcal's user-facing errors.
_USER_ERRORS = {
    "ShardcalError", "ConfigError", "CheckpointError", "TokenizerError", "RecipeError", "DataError",
    "ModelLayoutError", "CalibrationCheckpointError", "ExportError", "DistributedError",
}
