"""Will a plan fit: the free memory a rank can count on (:class:`Budget`), the first way a plan does not fit it
(:class:`Shortfall`), the cheapest change that makes it fit, and the one line ``calibrate`` stops with."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..calib.recipe import Recipe
from ..errors import UsageError
from ..runtime.hostmem import available_bytes
from .calibration_plan import CalibrationPlan, plan_prepared
from .prepared import PreparedModel
from .render import fmt_bytes
from .settings import PlanSettings
from .source import ModelSource

#: The most ranks the cheapest-fix search tries.
MAX_RANKS = 4096


@dataclass(frozen=True)
class Budget:
    """Free memory a rank can count on: its device's (None on CPU or unknown) and its node's host memory (shared
    by the node's ranks; None: unknown)."""

    device: int | None
    host: int | None
    device_what: str = "free on the device"
    host_what: str = "MemAvailable"


def local_budget(device: str, device_index: int | None = None) -> Budget:
    """What this machine has free now: ``MemAvailable``, and ``torch.cuda.mem_get_info`` for ``cuda``."""
    free, index = None, device_index
    if device == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if device_index is None else device_index
        free = int(torch.cuda.mem_get_info(index)[0])
    return Budget(free, available_bytes(), f"free on cuda:{index}")


@dataclass(frozen=True)
class Shortfall:
    """A plan that does not fit: what is needed, what is there, and where."""

    need: int
    available: int
    where: str
    detail: str


def shortfall(plan: CalibrationPlan, budget: Budget, rank: int | None = None, node_first: int = 0) -> Shortfall | None:
    """The first way ``plan`` does not fit ``budget`` (None: it fits, or nothing is known).

    On CPU the node's ranks share host memory: their required bytes are summed. On a GPU each rank needs its own
    device's free memory (``rank``: this rank; None: every rank) and the node's ranks share host memory for the
    activation cache and offloaded shards. Reclaimable checkpoint pages do not count.
    """
    s = plan.settings
    node = plan.node_ranks(node_first)
    if s.device != "cpu" and budget.device is not None:
        ranks = plan.ranks if rank is None else [plan.ranks[rank]]
        worst = max(ranks, key=lambda r: r.required)
        if worst.required > budget.device:
            return Shortfall(
                worst.required, budget.device, budget.device_what, f"rank {worst.rank}, {worst.peak_phase}"
            )
    if budget.host is not None:
        need = sum(r.host_required for r in node)
        if need > budget.host:
            per = max(r.host_required for r in node)
            where = f"host memory ({budget.host_what})"
            detail = f"{fmt_bytes(per)} per rank x {len(node)} rank(s) on this node" if len(node) > 1 else "1 rank"
            return Shortfall(need, budget.host, where, detail)
    return None


def cheapest_fix(source: ModelSource, recipe: Recipe, settings: PlanSettings, budget: Budget,
                 dtype: torch.dtype | str | None = None) -> str | None:  # fmt: skip
    """The first change that makes the plan fit, preferring those that leave the result unchanged: activation
    offload (GPU), ``--cpu-offload`` (GPU), more ranks (the result does not depend on N), then fewer samples.
    None when none does."""

    prepared: dict[bool, PreparedModel] = {}

    def fits(s: PlanSettings) -> bool:
        if s.shard_root not in prepared:
            prepared[s.shard_root] = PreparedModel(source, recipe, s.shard_root, dtype)
        return shortfall(plan_prepared(prepared[s.shard_root], s, full=False), budget) is None

    if settings.device != "cpu" and not settings.offload_activations:
        if fits(settings.replace(options=settings.options.replace(offload_activations=True))):
            return "keep the activation cache in host memory (offload_activations=True)"
    if settings.device != "cpu" and not settings.cpu_offload:
        if fits(settings.replace(cpu_offload=True)):
            return "--cpu-offload"
    world = settings.world_size
    for more in (2 * world, 4 * world, 8 * world, 16 * world):
        if more > MAX_RANKS:
            break
        if fits(settings.replace(world_size=more, local_world_size=settings.local)):
            nodes = "" if settings.device != "cpu" else f" ({more // settings.local} nodes of {settings.local})"
            return f"{more} ranks{nodes}"
    low, high = 0, settings.num_samples - 1  # the most samples that fit, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if fits(settings.replace(num_samples=mid)):
            low = mid
        else:
            high = mid - 1
    if low >= 1:
        per_rank = -(-low // world)
        return f"--num-samples {low} (about {per_rank} per rank)"
    return None


def refusal_message(plan: CalibrationPlan, short: Shortfall, fix: str | None) -> str:
    """The one line ``calibrate`` stops with."""
    part = max(plan.peak_rank.parts.items(), key=lambda kv: kv[1] if kv[0] != "checkpoint_pages" else -1)
    remedy = f"cheapest fix: {fix}" if fix else f"no option fits (largest part: {part[0]} {fmt_bytes(part[1])})"
    return (
        f"not enough memory: predicted {fmt_bytes(short.need)} ({short.detail}) but {fmt_bytes(short.available)} "
        f"{short.where}; {remedy}; --force runs anyway"
    )


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, what: str = "size") -> int:
    """``"80GB"``, ``"80 GiB"``, ``"81920MiB"``, ``"8e10"`` -> bytes; :class:`UsageError` naming ``what`` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in _UNITS:
        raise UsageError(f"{what} {text!r} is not a size (e.g. 80GB, 80GiB, 81920MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
