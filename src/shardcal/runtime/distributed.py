"""Every process-group operation shardcal performs: joining a group, who this rank is, and every collective.

No other module of the package calls a ``torch.distributed`` collective (a test checks). Having one home means one
answer to "which device does this group communicate on":

* ``init_distributed`` creates the default group with a backend per device (``"cpu:gloo,cuda:nccl"`` when CUDA is
  present, else ``"gloo"``), so a small CPU tensor (a flag, a string, a peak-memory figure) can go through gloo
  while the statistics of layers on the GPU go through NCCL;
* :func:`comm_device` still moves a tensor when a group cannot carry it where it lives (a group a user created
  with NCCL only, or gloo only with CUDA tensors), and the collectives here move it back afterwards.

Every function works without a process group (one process): collectives are then no-ops and :func:`world` is
``(0, 1)``. Strings and small JSON values travel as UTF-8 bytes in uint8 tensors: nothing is ever pickled.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError

#: Collectives give up after this long (seconds) unless SHARDCAL_TIMEOUT says otherwise.
DEFAULT_TIMEOUT_S = 600
#: The default group's backends when CUDA is present: CPU tensors through gloo, CUDA tensors through NCCL.
CPU_AND_CUDA_BACKEND = "cpu:gloo,cuda:nccl"

#: The default ``group`` of every collective here: the data-parallel group (:func:`dp_group`). Passing None
#: explicitly means "no group": the collective is a no-op (a single process, or statistics already global).
DEFAULT_GROUP: Any = object()

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ----------------------------------------------------------------------------------------------- the group


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait: ``SHARDCAL_TIMEOUT`` seconds, default :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("SHARDCAL_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        raise DistributedError(f"SHARDCAL_TIMEOUT={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        raise DistributedError(f"SHARDCAL_TIMEOUT={raw!r} must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def host_rendezvous() -> tuple[Any, dict[str, str]]:
    """A rendezvous store this process hosts for ranks it starts, and the environment they need to join it.

    The store binds a free port itself (port 0), so no port is chosen and released first for another process to
    take; the ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent). Keep
    the returned store alive until the ranks are done.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout())
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def default_backend() -> str:
    """The backend :func:`init_distributed` asks for: gloo for CPU tensors, plus NCCL for CUDA tensors if present."""
    return CPU_AND_CUDA_BACKEND if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join (or form) the default process group; return ``(rank, world_size)``. Idempotent.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); with none set, forms a
    one-process group so that the same code path (FSDP2 included) runs in a plain ``python``. ``backend``
    defaults to :func:`default_backend`. With CUDA, each process uses device ``LOCAL_RANK``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend if backend is not None else default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=collective_timeout())
    else:  # one process: its own store on a port it binds itself; the environment stays as it was
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=collective_timeout())
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=collective_timeout())
    atexit.register(leave_at_exit, dist.group.WORLD)
    return dist.get_rank(), dist.get_world_size()


#: The works of the barriers ranks leave together with, freed by the interpreter's teardown on the main thread. The
#: barrier holds the collectives still in flight when it started (the last broadcast of a temporary tensor, say):
#: released last by the gloo thread that ran it once the teardown has begun, such a tensor needs the GIL, which ends
#: that thread in the middle of a C++ destructor, and the process aborts (SIGABRT) after it has finished its work.
_EXIT_BARRIERS: list[Any] = []


def leave_at_exit(formed: Any) -> None:
    """At the exit of a process whose default group shardcal formed (``formed``): leave it together — a barrier,
    then destroy it — before the interpreter's teardown, which destroys gloo's threads while they run, or while a
    peer still talks to them, and ends a finished rank with SIGABRT. After an uncaught exception (``sys.last_value``)
    nothing waits for the peers, which may never come; the group is destroyed all the same. A group left already
    (the CLI leaves together itself), or another than ``formed``, is left alone."""
    if not is_initialized() or dist.group.WORLD is not formed:
        return
    with contextlib.suppress(Exception):  # a peer gone: nothing to wait for
        leave_together(wait=getattr(sys, "last_value", None) is None)


def leave_together(wait: bool = True) -> None:
    """:func:`destroy_distributed`, with ``wait`` once every rank gets here (a rank tearing gloo down while another
    still talks to it aborts)."""
    try:
        if wait:
            _EXIT_BARRIERS.append(barrier())  # a no-op without a group of several ranks
    finally:
        destroy_distributed()


def destroy_distributed() -> None:
    """Leave the default process group (no-op without one)."""
    if is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group, or ``(0, 1)`` without a process group."""
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def dp_group() -> Any:
    """The data-parallel group statistics are merged over: the whole world, or None for a single process."""
    return dist.group.WORLD if is_initialized() and dist.get_world_size() > 1 else None


def group_rank_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` for None."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _resolve(group: Any) -> Any:
    return dp_group() if group is DEFAULT_GROUP else group


def _active(group: Any) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def default_store() -> Any:
    """The default group's key-value store (None without a process group or when torch exposes none)."""
    if not is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


# ----------------------------------------------------------------------------------------------- devices


def backend_name(group: Any = None) -> str:
    """The group's backend (None: the default group) as torch spells it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    return str(dist.get_backend(group)).lower()


def comm_device(group: Any, device: torch.device) -> torch.device:
    """Where a tensor on ``device`` must be for a collective over ``group``.

    NCCL carries CUDA tensors only and gloo CPU tensors only; a group with both (``cpu:gloo,cuda:nccl``) takes each
    where it is. A CPU tensor in an NCCL-only group goes to the current CUDA device, a CUDA tensor in a gloo-only
    group to the CPU.
    """
    backend = backend_name(group)
    has_cpu = "gloo" in backend or "mpi" in backend
    has_cuda = "nccl" in backend
    if device.type == "cpu" and not has_cpu and has_cuda:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and not has_cuda and has_cpu:
        return torch.device("cpu")
    return device


def _to_comm(t: torch.Tensor, group: Any) -> torch.Tensor:
    target = comm_device(group, t.device)
    return t.contiguous() if target == t.device else t.to(target).contiguous()


# ----------------------------------------------------------------------------------------------- tensor collectives


def all_reduce_(t: torch.Tensor, op: str = "sum", group: Any = DEFAULT_GROUP) -> torch.Tensor:
    """All-reduce ``t`` in place over ``group`` (``op``: sum, max or min); a no-op for None or a one-rank group."""
    group = _resolve(group)
    if not _active(group):
        return t
    moved = _to_comm(t, group)
    dist.all_reduce(moved, op=_OPS[op], group=group)
    if moved is not t:
        t.copy_(moved.to(t.device))
    return t


def all_reduce_many_(
    tensors: Sequence[torch.Tensor], op: str, group: Any = DEFAULT_GROUP, dtype: torch.dtype | None = None
) -> int:
    """All-reduce many tensors in place with one collective (flattened into one buffer); return how many were issued.

    ``dtype``: the buffer's dtype (default: the tensors' common dtype, else float64). Every rank passes tensors of
    the same shapes in the same order.
    """
    group = _resolve(group)
    if not _active(group) or not tensors:
        return 0
    if dtype is None:
        dtypes = {t.dtype for t in tensors}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    device = comm_device(group, tensors[0].device)
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    dist.all_reduce(flat, op=_OPS[op], group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n
    return 1


def broadcast_(t: torch.Tensor, src: int, group: Any = DEFAULT_GROUP) -> torch.Tensor:
    """Broadcast ``t`` in place from group rank ``src``; a no-op for None or a one-rank group."""
    group = _resolve(group)
    if not _active(group):
        return t
    moved = _to_comm(t, group)
    dist.broadcast(moved, src=dist.get_global_rank(group, src), group=group)
    if moved is not t:
        t.copy_(moved.to(t.device))
    return t


def all_gather_tensors(t: torch.Tensor, group: Any = DEFAULT_GROUP) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on every rank), on ``t``'s device; ``[t]`` for a single process."""
    group = _resolve(group)
    if not _active(group):
        return [t]
    moved = _to_comm(t, group)
    out = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, moved, group=group)
    return [o.to(t.device) for o in out]


def row_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim-0 split over ``world_size`` ranks that ``rank`` holds: chunks of
    ``ceil(rows / world_size)``, the last ones shorter or empty (FSDP2's ``Shard(0)``)."""
    chunk = -(-rows // world_size) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def all_gather_rows_(full: torch.Tensor, local: torch.Tensor, group: Any = DEFAULT_GROUP) -> torch.Tensor:
    """Fill ``full`` (``[N, ...]``) from every rank's rows, this rank's being ``local`` (its :func:`row_range`);
    exact for any dtype (the rows travel as bytes). Collective; the copy alone in a single process."""
    group = _resolve(group)
    if not _active(group):
        return full.copy_(local)
    size = dist.get_world_size(group)
    rows = full.shape[0]
    chunk = -(-rows // size) if rows else 0
    row_bytes = (full[0].numel() if rows else 0) * full.element_size()
    device = comm_device(group, full.device)
    if rows and rows % size == 0 and full.is_contiguous() and device == full.device:
        # every rank holds ``chunk`` rows: they land in place, one after the other, with no copy in between
        mine = local.detach().contiguous().reshape(-1).view(torch.uint8)
        dist.all_gather_into_tensor(full.view(-1).view(torch.uint8), mine, group=group)
        return full
    send = torch.zeros(max(chunk * row_bytes, 1), dtype=torch.uint8, device=device)
    mine = (
        local.detach().contiguous().reshape(-1).view(torch.uint8)
        if local.numel()
        else local.new_empty(0, dtype=torch.uint8)
    )
    send[: mine.numel()].copy_(mine.to(device))
    received = [torch.empty_like(send) for _ in range(size)]
    dist.all_gather(received, send, group=group)
    target = full.view(-1).view(torch.uint8) if full.numel() else None
    for r, part in enumerate(received):
        start, stop = row_range(rows, r, size)
        if stop > start:
            target[start * row_bytes : stop * row_bytes].copy_(part[: (stop - start) * row_bytes].to(full.device))
    return full


def barrier(group: Any = DEFAULT_GROUP) -> Any:
    """Wait until every rank of ``group`` (default: the world) gets here; a no-op for a single process. Returns the
    barrier's work object (None without a group): gloo's holds the collectives that were still in flight when the
    barrier started."""
    group = _resolve(group)
    if not _active(group):
        return None
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    return work


# ----------------------------------------------------------------------------------------------- small values


def all_gather_floats(value: float, group: Any = DEFAULT_GROUP) -> list[float]:
    """Every rank's ``value`` (float64), e.g. a peak-memory figure; ``[value]`` for a single process."""
    group = _resolve(group)
    gathered = all_gather_tensors(torch.tensor([float(value)], dtype=torch.float64), group)
    return [float(g) for g in gathered]


def _encode(text: str) -> torch.Tensor:
    raw = text.encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _decode(data: torch.Tensor, length: int) -> str:
    return bytes(data[:length].cpu().tolist()).decode("utf-8")


def all_gather_strings(text: str, group: Any = DEFAULT_GROUP) -> list[str]:
    """Every rank's string (UTF-8 bytes in uint8 tensors, never pickled); ``[text]`` for a single process."""
    group = _resolve(group)
    if not _active(group):
        return [text]
    data = _encode(text)
    lengths = [int(n) for n in all_gather_tensors(torch.tensor([data.numel()], dtype=torch.int64), group)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    return [_decode(t, n) for t, n in zip(all_gather_tensors(padded, group), lengths)]


def broadcast_string(text: str, src: int = 0, group: Any = DEFAULT_GROUP) -> str:
    """Group rank ``src``'s string on every rank (what other ranks pass is ignored)."""
    group = _resolve(group)
    if not _active(group):
        return text
    mine = group_rank_size(group)[0] == src
    data = _encode(text) if mine else torch.zeros(0, dtype=torch.uint8)
    size = int(broadcast_(torch.tensor([data.numel()], dtype=torch.int64), src, group))
    buffer = data if mine else torch.zeros(size, dtype=torch.uint8)
    if size:
        broadcast_(buffer, src, group)
    return _decode(buffer, size)


def broadcast_json(value: Any, src: int = 0, group: Any = DEFAULT_GROUP) -> Any:
    """Group rank ``src``'s JSON-able ``value`` on every rank (what other ranks pass is ignored)."""
    return json.loads(broadcast_string(json.dumps(value), src, group))


def ranks_with_flag(flag: bool, group: Any = DEFAULT_GROUP) -> list[int]:
    """The ranks of ``group`` (default: the world) whose ``flag`` is true, known on every rank; collective."""
    group = _resolve(group)
    rank, size = group_rank_size(group)
    flags = torch.zeros(size, dtype=torch.int32)
    flags[rank] = int(bool(flag))
    all_reduce_(flags, "sum", group)
    return [r for r in range(size) if int(flags[r])]
