"""One rank's predicted memory (:class:`RankPlan`): the parts it holds, what is alive together in each phase of
``shardcal calibrate`` (load, rotate, embed, layers, export), and the peak — on the compute device and, beside a GPU,
in host memory.

The parts are those listed in :mod:`.planner`; their sizes come from :mod:`.prepared` (parameters, quantizers, one
batch through a layer), the algorithm's own memory model and the constants of :mod:`.costs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..algorithms.residual import PROBE_TOKENS
from ..calib.layer_calibration import layer_copies_held
from ..calib.passes import (
    ALGORITHM,
    OBSERVE,
    PROPAGATE,
    REFERENCE_STREAM,
    SQNR,
    SQNR_FULL_PRECISION,
    SQNR_REFERENCE,
)
from ..layerwise.batches import leading_rows_of, rank_batch_indices
from .costs import (
    EMBED_ROTARY_BYTES,
    PROBE_LOGIT_COPIES,
    RESIDUAL_WEIGHT_COPIES,
    RUNTIME_BASE_BYTES,
    RUNTIME_PER_LAYER_BYTES,
    SQNR_BYTES,
)
from .prepared import PlannedRun

#: Device and host bytes alive together.
Both = tuple[int, int]


@dataclass(kw_only=True)
class RankPlan:
    """One rank's predicted memory: the parts (bytes), what is alive together in each phase, and the peak."""

    rank: int
    parts: dict[str, int]
    largest_unit: str
    phases: dict[str, int]  # on the compute device (on CPU: everything, host memory)
    host_phases: dict[str, int]  # host memory beside a GPU (empty on CPU)
    peak: int
    peak_phase: str
    host_peak: int
    required: int  # what must be free on the compute device (on CPU: the peak less reclaimable checkpoint pages)
    host_required: int
    bytes_read: int

    def to_dict(self) -> dict[str, Any]:
        """The rank's entry in ``shardcal plan --json``."""
        return {
            "rank": self.rank,
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "required_bytes": self.required,
            "host_peak_bytes": self.host_peak,
            "host_required_bytes": self.host_required,
            "bytes_read": self.bytes_read,
            "largest_gathered_unit": self.largest_unit,
            "parts": dict(self.parts),
            "phases": dict(self.phases),
            "host_phases": dict(self.host_phases),
        }


@dataclass(frozen=True, kw_only=True)
class RankData:
    """A rank's share of the data and where it lives: its batches' rows, the activation cache (hidden states and
    rotary tables; the SQNR's reference; the full-precision stream), the SQNR's float64 work, and whether the cache is
    in host memory (then one batch at a time is copied to the device)."""

    rows: list[int]
    biggest: int
    hidden_cache: int
    rotary: int
    reference: int
    sqnr: int
    cache_on_host: bool
    batch_copies: int

    def split(self, dev: int, cache: int) -> Both:
        """``dev`` device bytes beside ``cache`` bytes of the activation cache, as ``(device, host)``."""
        return (dev + self.batch_copies, cache) if self.cache_on_host else (dev + cache, 0)


def rank_data(m: PlannedRun, rank: int) -> RankData:
    """What ``rank``'s batches hold (:class:`RankData`)."""
    s, st, e = m.s, m.st, m.e
    seq, hidden = s.seq_len, st.hidden_size
    mine = rank_batch_indices(len(m.rows), rank, s.world_size)
    my_rows = [m.rows[b] for b in mine]
    biggest = max(my_rows, default=0)
    # the batches the SQNR sequences touch (every sequence counted as seq real tokens), each counted whole
    sampled = leading_rows_of([[seq] * r for r in m.rows], s.options.sqnr_tokens)
    sqnr_rows = [m.rows[b] for b in mine if b in sampled]
    hidden_cache = sum(r * seq * hidden * e for r in my_rows)
    # the SQNR's full-precision side, held apart from the outputs: counted whenever the weights change (the layer
    # as it came), and for a quantized propagation with no activation observed (a pass of its own)
    has_reference = m.changes_weights or (not m.activations and m.propagate == "qdq")
    reference = sum(r * seq * hidden * e for r in sqnr_rows) if has_reference else 0
    # the full-precision stream beside the propagated one (its plan's first pass): its inputs and its outputs
    streams = any(m.passes(i).count(REFERENCE_STREAM) for i in m.last_of_kind)
    reference += 2 * hidden_cache if streams else 0
    cache_on_host = s.device != "cpu" and s.offload_activations
    return RankData(
        rows=my_rows,
        biggest=biggest,
        hidden_cache=hidden_cache,
        rotary=sum(2 * r * seq * st.head_dim * e for r in my_rows),
        reference=reference,
        sqnr=max(sqnr_rows, default=0) * seq * hidden * SQNR_BYTES,
        cache_on_host=cache_on_host,
        batch_copies=biggest * seq * (2 * hidden + 2 * st.head_dim) * e if cache_on_host else 0,
    )


def residual_rotation_bytes(m: PlannedRun) -> int:
    """``[rotation] residual`` before calibration (:func:`shardcal.algorithms.residual.rotate_residual`): the larger
    of one layer gathered with the float64 copies of its largest weight that the rotation makes
    (:data:`~.costs.RESIDUAL_WEIGHT_COPIES`), and the probe forward of ``PROBE_TOKENS`` tokens — the root and the
    head gathered, the layers one at a time, the logits (float32) kept twice."""
    biggest = max((m.gathered[u] for u in m.layer_names), default=0)
    widest = max((math.prod(sh) for n, sh in m.st.params if m.st.unit_of(n) in m.layer_names), default=0)
    first = m.layer_names[0]
    layer = m.gather_peak(first) - m.gathered[first] + biggest + RESIDUAL_WEIGHT_COPIES * widest * 8
    vocab = max((sh[0] for n, sh in m.st.params if len(sh) == 2 and m.st.unit_of(n) not in m.layer_names), default=0)
    head = m.gather_peak("lm_head") if "lm_head" in m.gathered else 0
    probe = m.gather_peak("<root>") + head + 2 * biggest + PROBE_LOGIT_COPIES * 4 * PROBE_TOKENS * vocab
    return max(layer, probe)


@dataclass(frozen=True, kw_only=True)
class LayersPeak:
    """The layers phase: its device and host peak, and the largest algorithm state, quantized forward and weight
    observer of any layer (parts of the plan)."""

    both: Both
    algorithm: int
    forward: int
    weight_observer: int


def layer_steps(m: PlannedRun, i: int, rank: int, data: RankData, shards_dev: int) -> dict[str, Both]:
    """What is alive (device, host) at each step of calibrating layer ``i`` on ``rank``: the layer gathered, each
    kind of pass the runner's plan for the layer runs (:meth:`~.prepared.PlannedRun.passes`; its kinds name the
    steps), the algorithm's solve, the weights' scales, and the SQNR's sums; beside ``shards_dev``."""
    plan, unit = m.passes(i), m.layer_names[i]
    base = shards_dev + m.quantizer_upto[i] + m.gathered[unit]
    if m.s.streamed:  # the next layer's read, made while this one computes; this layer's tensors, encoded at its end
        base += m.layer_reads[unit] + m.encoded[unit]  # every rank encodes its share of the layer's modules
        if m.changes_weights and m.s.options.checkpoint_dir is not None:  # the finished layers' rows, until committed
            base += m.s.options.checkpoint_every * m.own_rows[unit]
    algo = m.algorithm_state(i, rank, data.rows)
    fwd, fwd_q = m.forward(i, data.biggest, False), m.forward(i, data.biggest, True)
    inputs = data.hidden_cache + data.rotary
    one = inputs + data.reference  # the inputs, the SQNR's reference and the full-precision stream
    two = one + data.hidden_cache  # and the layer's outputs
    # what a pass holds beside the cache: one batch through the layer, quantized or not, and the pass's own state
    passes = {
        REFERENCE_STREAM: (fwd, one),
        SQNR_REFERENCE: (fwd, one),
        ALGORITHM: (algo.collect + fwd, one),
        OBSERVE: (m.observers(i) + fwd, two),
        SQNR_FULL_PRECISION: (fwd, two),
        SQNR: (fwd_q, two),
        PROPAGATE: (fwd_q, two),
    }
    steps = {"gather": data.split(base + m.gather_peak(unit) - m.gathered[unit], inputs)}
    base += layer_copies_held(m.recipe) * m.gathered[unit]  # a [fallback]'s copy of the layer, taken once gathered
    for kind, (held, cache) in passes.items():
        if plan.count(kind):
            steps[kind] = data.split(base + held, cache)
        if kind == ALGORITHM:  # after the algorithm's passes, before the observing ones
            steps["solve"] = data.split(base + max(algo.merge, algo.solve), one)
            steps["weight scales"] = data.split(base + algo.held + m.weight_observer(i), one)
    steps["sqnr sums"] = data.split(base, two + data.sqnr)  # where the cache is
    return steps


def layers_peak(m: PlannedRun, rank: int, data: RankData, shards: Both) -> LayersPeak:
    """The layers phase on ``rank``: for the last layer of each structure, the most alive at any of its steps
    (:func:`layer_steps`), beside ``shards`` (device, host)."""
    peaks: list[Both] = []
    algo_peak, layer_fwd, wobs = 0, 0, 0
    for i in m.last_of_kind:
        steps = layer_steps(m, i, rank, data, shards[0]).values()
        peaks.append((max(d for d, _ in steps), max(h for _, h in steps)))
        algo_peak = max(algo_peak, m.algorithm_state(i, rank, data.rows).peak)
        layer_fwd = max(layer_fwd, m.forward(i, data.biggest, True))
        wobs = max(wobs, m.weight_observer(i))
    both = (max(d for d, _ in peaks), shards[1] + max(h for _, h in peaks))
    return LayersPeak(both=both, algorithm=algo_peak, forward=layer_fwd, weight_observer=wobs)


def export_peak(m: PlannedRun, rank: int, shards: Both) -> tuple[Both, int]:
    """The export phase on ``rank`` beside ``shards`` (device, host): every unit gathered in turn, the units it
    writes encoded (and, from a GPU, each tensor copied to the host to be written); and its largest encoding."""
    on_gpu = m.s.device != "cpu"
    gathered, encode, host_copy = 0, 0, 0
    for index, unit in enumerate(m.export_units):
        if m.s.streamed and unit in m.own_rows:  # written at the end of its step (layer_steps)
            continue
        owned = m.owner(index, unit) == rank or unit in m.own_rows  # a decoder layer's modules: spread over the ranks
        enc = m.encoded[unit] if owned else 0
        gather = m.gather_peak(unit) if unit != "<root>" or m.s.shard_root else 0
        gathered = max(gathered, gather, m.gathered[unit] + enc)
        encode = max(encode, enc)
        if owned and on_gpu:
            host_copy = max(host_copy, max((p.nbytes for p in m.by_unit.get(unit, [])), default=0))
    return (shards[0] + m.quantizer_upto[-1] + gathered, shards[1] + host_copy), encode


def phases_of(m: PlannedRun, rank: int, data: RankData, shards: Both, layers: LayersPeak,
              export: Both) -> dict[str, Both]:  # fmt: skip
    """Each phase's device and host bytes on ``rank`` (``shards``: the parameter shards on the device and the host),
    in the order they run."""
    s, st = m.s, m.st
    shards_dev, shards_host = shards
    phases: dict[str, Both] = {"load": (shards_dev, shards_host + checkpoint_pages(m, rank))}
    root_dev = m.gathered["<root>"] if s.shard_root else 0
    embed_batch = data.biggest * s.seq_len * (st.hidden_size * m.e + EMBED_ROTARY_BYTES * st.head_dim)
    embed = max(m.gather_peak("<root>") if s.shard_root else 0, root_dev + embed_batch)
    cache = data.hidden_cache + data.rotary
    phases["embed"] = (
        shards_dev + embed + (0 if data.cache_on_host else cache),
        shards_host + (cache if data.cache_on_host else 0),
    )
    if m.residual:
        phases["rotate"] = (shards_dev + residual_rotation_bytes(m), shards_host)
    phases["layers"] = layers.both
    phases["export"] = export
    return phases


def rank_plan(m: PlannedRun, rank: int) -> RankPlan:
    """Rank ``rank``'s :class:`RankPlan`."""
    s, st = m.s, m.st
    on_gpu = s.device != "cpu"
    shards: Both = (0, m.shards) if (on_gpu and s.cpu_offload) else (m.shards, 0)
    read, pages = m.read(rank), checkpoint_pages(m, rank)
    data = rank_data(m, rank)
    layers = layers_peak(m, rank, data, shards)
    export, encode = export_peak(m, rank, shards)
    phases = phases_of(m, rank, data, shards, layers, export)
    runtime = RUNTIME_BASE_BYTES + RUNTIME_PER_LAYER_BYTES * st.num_layers
    largest = max(m.export_units, key=lambda u: m.gathered[u])
    parts = {
        "param_shards": m.shards,
        "largest_gathered_unit": m.gathered[largest],
        "activation_cache": 2 * data.hidden_cache + data.rotary + data.reference,
        "layer_intermediates": layers.forward + data.sqnr,
        "quantizer_state": m.quantizer_upto[-1] + max(m.observers(i) for i in range(st.num_layers)),
        "weight_observer": layers.weight_observer,
        "algorithm_state": layers.algorithm,
        "export_buffers": encode,
        "checkpoint_pages": pages,
        "runtime": runtime,
    }
    common = dict(rank=rank, parts=parts, largest_unit=largest, bytes_read=read)
    if on_gpu:
        device = {k: d for k, (d, _) in phases.items()}
        host = {k: h + runtime for k, (_, h) in phases.items()}
        phase, peak = _phase_max(device)
        return RankPlan(
            **common, phases=device, host_phases=host, peak=peak, peak_phase=phase, host_peak=max(host.values()),
            required=peak, host_required=_required(host, pages),
        )  # fmt: skip
    total = {k: d + h + runtime for k, (d, h) in phases.items()}
    phase, peak = _phase_max(total)
    required = _required(total, pages)
    return RankPlan(
        **common, phases=total, host_phases={}, peak=peak, peak_phase=phase, host_peak=peak, required=required,
        host_required=required,
    )  # fmt: skip


def checkpoint_pages(m: PlannedRun, rank: int) -> int:
    """The checkpoint's file pages in ``rank``'s memory while loading: what it reads through a memory map, or none
    when streamed (the reads go into buffers that are freed)."""
    return 0 if m.s.streamed else m.read(rank)


def _phase_max(phases: dict[str, int]) -> tuple[str, int]:
    name = max(phases, key=lambda k: phases[k])
    return name, phases[name]


def _required(phases: dict[str, int], read: int) -> int:
    """What must be free: the largest phase, less the checkpoint pages (reclaimable) while loading."""
    return max(v - (read if k == "load" else 0) for k, v in phases.items())
