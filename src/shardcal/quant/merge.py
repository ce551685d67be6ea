"""Merging observer statistics across data-parallel ranks in as few collectives as possible.

A layer can hold hundreds of quantizers (an MoE layer: four per expert). Their statistics are flattened into one
tensor per reduce op (MAX for amax ranges, SUM for counts, histograms and error sums), all-reduced once, and
written back in place. Every rank must pass the same statistics in the same order (same quantizers, same pass),
which holds because every rank runs the same layer with the same recipe; a rank that saw no data passes its
zero-initialised statistics.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

#: A statistic to merge: ("max" | "sum", tensor), merged in place.
Stat = tuple[str, torch.Tensor]

_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """NCCL reduces only CUDA tensors; gloo takes the tensors where they are."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def merge_stats(stats: Sequence[Stat], group: Any) -> int:
    """All-reduce ``stats`` over ``group`` in place, one collective per reduce op; return how many were issued.

    ``group=None`` means no merge (one process, or statistics that are already global such as a full weight's).
    """
    if group is None or not stats:
        return 0
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("merging observer statistics across ranks needs an initialised torch.distributed process group")
    if dist.get_world_size(group) == 1:
        return 0
    issued = 0
    for op in ("max", "sum"):
        tensors = [t for o, t in stats if o == op]
        if not tensors:
            continue
        dtype = torch.float32 if op == "max" and all(t.dtype == torch.float32 for t in tensors) else torch.float64
        device = _comm_device(group, tensors[0].device)
        flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
        dist.all_reduce(flat, op=_OPS[op], group=group)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n
        issued += 1
    return issued
