"""A pool of real worker processes joined in a gloo process group, reused across tests.

Spawning a torch process costs seconds, so each world size gets one pool for the whole test session. A test
sends a module-level function (by reference) to every rank and gets back each rank's return value. If a rank
raises, the parent re-raises with that rank's traceback; if ranks stop answering (one failed while the others
wait in a collective), the pool is torn down and rebuilt for the next test.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp

_POOLS: dict[int, RankPool] = {}
#: What a one-rank process group formed in the test process sets (a later subprocess must not think it is a rank).
_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def restored_process_group() -> Iterator[None]:
    """Code run inside (an in-process ``calibrate`` or CLI command) may form a one-rank process group and set RANK
    etc.; afterwards the group is destroyed and those variables are as they were."""
    import torch.distributed as dist

    saved = {name: os.environ.get(name) for name in _GROUP_ENV}
    was_initialized = dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized() and not was_initialized:
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _worker(rank: int, world_size: int, env: dict, tasks: Any, results: Any) -> None:
    os.environ.update(
        **env,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` processes in one gloo group, each running the functions it is sent."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        from shardcal.runtime.distributed import host_rendezvous

        self.store, env = host_rendezvous()  # binds its own port: no race with other processes for a free one
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, env, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = timeout
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=deadline if not failures else 10)
            except queue.Empty:
                self.close(force=True)
                missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failures.items())
                raise AssertionError(f"ranks {missing} did not answer in time{detail}") from None
            (out if ok else failures)[rank] = value
        if failures:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{len(failures)} rank(s) failed:{detail}")
        return [out[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        _POOLS.pop(self.world_size, None)


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group; return each rank's result."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def fresh_ranks(world_size: int) -> None:
    """The next ``run_on_ranks(world_size, ...)`` starts new processes: for measurements (resident memory) that
    an earlier test's allocations, kept by the allocator in a pooled process, would hide."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
