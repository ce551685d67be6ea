"""The collective traffic of a planned calibration, per rank: the all-gathers of the FSDP2 units (a ring: each rank
sends ``(N - 1) / N`` of a unit) and the all-reduces of the statistics (``2 (N - 1) / N`` of the buffer)."""

from __future__ import annotations

from .prepared import PlannedRun


def allreduce_bytes(m: PlannedRun, i: int) -> int:
    """Bytes all-reduced while layer ``i`` is calibrated: observer statistics and the algorithm's merged sums."""
    algo = m.algorithm_state(i, 0, m.rows[:1])
    return m.observers(i) + (algo.merge // 2 if m.s.world_size > 1 else algo.merge)


def traffic(m: PlannedRun) -> dict[str, int]:
    """Collective volume per rank: all-gathers (a ring: each rank sends ``(N - 1) / N`` of a unit) and the
    statistics' all-reduces (``2 (N - 1) / N`` of the buffer)."""
    world = m.s.world_size
    share = lambda n: n * (world - 1) // world
    layer = max((m.gathered[u] for u in m.layer_names), default=0)
    calibrate_units = m.layer_names + (["<root>"] if m.s.shard_root else [])
    sent = sum(share(m.gathered[u]) for u in calibrate_units) + sum(share(m.gathered[u]) for u in m.export_units)
    reduce = max((allreduce_bytes(m, i) for i in range(m.st.num_layers)), default=0)
    return {
        "allgather_bytes_per_layer": layer,
        "allgather_sent_per_layer_per_rank": share(layer),
        "allgather_sent_total_per_rank": sent,
        "allreduce_bytes_per_layer": reduce,
        "allreduce_sent_per_layer_per_rank": 2 * share(reduce),
    }
