"""Merging observer statistics across data-parallel ranks in as few collectives as possible.

A layer can hold hundreds of quantizers (an MoE layer: four per expert). Their statistics are flattened into one
tensor per reduce op (MAX for amax ranges, SUM for counts, histograms and error sums), all-reduced once, and
written back in place. Every rank must pass the same statistics in the same order (same quantizers, same pass),
which holds because every rank runs the same layer with the same recipe; a rank that saw no data passes its
zero-initialised statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.distributed import all_reduce_many_

#: A statistic to merge: ("max" | "sum", tensor), merged in place.
Stat = tuple[str, torch.Tensor]


def merge_stats(stats: Sequence[Stat], group: Any) -> int:
    """All-reduce ``stats`` over ``group`` in place, one collective per reduce op; return how many were issued.

    ``group=None`` means no merge (one process, or statistics that are already global such as a full weight's).
    Maxima of float32 tensors stay float32 (exact); everything else is reduced in float64.
    """
    if group is None or not stats:
        return 0
    issued = 0
    for op in ("max", "sum"):
        tensors = [t for o, t in stats if o == op]
        if not tensors:
            continue
        dtype = torch.float32 if op == "max" and all(t.dtype == torch.float32 for t in tensors) else torch.float64
        issued += all_reduce_many_(tensors, op, group, dtype=dtype)
    return issued
