"""The model as a plan counts it: its parameters, the recipe's quantized Linears and its algorithm's memory model,
grouped once (:class:`PreparedModel`), then sized for a world size and data shape (:class:`PlannedRun`).

Decoder layers of the same structure and targets need the same memory, and parameters of the same rows, row size,
dtype and sharding shard alike: both are computed once per kind, so that a plan of a model with hundreds of layers
and experts, re-made for every candidate of the cheapest-fix search, stays quick.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..algorithms import make_algorithm
from ..algorithms.memory import AlgorithmMemory, LayerPlanContext, MemoryModel, memory_model_of
from ..calib.layer_calibration import predicted_pass_plan
from ..calib.passes import PassPlan
from ..calib.recipe import Recipe
from ..errors import PlanError
from ..export.layout import Entry, unit_owner
from ..loading.build import resolve_dtype
from ..loading.streamed import reads_layers_whole
from .costs import (
    FORWARD_ATTN_HIDDEN,
    FORWARD_ATTN_QUERY,
    FORWARD_MLP_HIDDEN,
    FORWARD_MLP_INTERMEDIATE,
    MASK_BYTES,
    MASKED_SCORE_BYTES_PER_HEAD,
    ROTATION_COPIES,
    ROUTER_PER_EXPERT,
)
from .quantizers import (
    QuantTarget,
    amax_bytes,
    encode_bytes,
    fake_quant_bytes,
    observer_bytes,
    planned_linear,
    quant_targets,
    weight_observer_bytes,
)
from .settings import PlanSettings
from .source import ModelSource, Param
from .structure import ModelStructure

#: Parameters that shard alike: ``(rows, elements per row, bytes per element, sharded)`` -> how many.
Groups = dict[tuple[int, int, float, bool], int]


def algorithm_memory_model(recipe: Recipe) -> MemoryModel:
    """The memory model of ``recipe``'s algorithm (its class's ``planned_memory``); :class:`PlanError` naming the
    algorithm when its class does not define one itself (it would be planned at zero)."""
    cls = type(make_algorithm(recipe.algorithm))
    model = memory_model_of(cls)
    if model is None:
        raise PlanError(
            f"{recipe.source or recipe.name}: algorithm {cls.name!r} ({cls.__module__}.{cls.__qualname__}) has no memory "
            "model, so the planner cannot say what it holds; define the classmethod "
            "planned_memory(context: LayerPlanContext, params) -> AlgorithmMemory on the class "
            "(shardcal.algorithms.memory; return AlgorithmMemory(name) if it holds nothing), or pass --force to "
            "calibrate without a plan"
        )
    return model


def batch_rows(num_samples: int, batch_size: int) -> list[int]:
    """Rows of each global batch (the last may be smaller)."""
    return [min(batch_size, num_samples - s) for s in range(0, num_samples, batch_size)]


def export_view(params: list[Param], st: ModelStructure) -> list[Param]:
    """The tensors as the export stores them: a fused experts parameter (weights, GPT-OSS's biases) as its per-expert
    tensors, then the model's persistent buffers (whole, in their unit)."""
    out = []
    for p in params:
        if p.name not in st.fused:
            out.append(p)
            continue
        out += [
            Param(
                name=n,
                shape=shape,
                dtype=p.dtype,
                file_dtype=p.file_dtype,
                unit=p.unit,
                sharded=p.sharded,
                file_bytes=p.file_bytes,
            )
            for n, shape in st.fused[p.name]
        ]
    out += [
        Param(name=n, shape=shape, dtype=dtype, file_dtype=dtype, unit=st.unit_of(n), sharded=False)
        for n, shape, dtype in st.buffers
    ]
    return out


def _count(groups: Groups, key: tuple[int, int, float, bool]) -> None:
    groups[key] = groups.get(key, 0) + 1


class PreparedModel:
    """The part of a plan that depends on the model, the recipe and ``shard_root`` only (not on ranks or data):
    parameters, quantized Linears, layer structures, the export's tensors. Re-planned for other world sizes or
    data (the fix search), it is computed once."""

    def __init__(self, source: ModelSource, recipe: Recipe, shard_root: bool = True,
                 dtype: torch.dtype | str | None = None):  # fmt: skip
        residual = recipe.rotates_residual
        if residual:  # loaded untied (the head a unit of its own), every layer's weights rewritten
            source = source.untied()
        st = self.st = source.model_structure()
        self.recipe, self.shard_root, self.residual = recipe, shard_root, residual
        self.held = source.params(resolve_dtype(source.config, dtype), shard_root)
        self.params = export_view(self.held, st)
        self.numel, self.nbytes = sum(p.numel for p in self.held), sum(p.nbytes for p in self.held)
        self.targets = quant_targets(st.linears, recipe)
        self.dtype = next(p.dtype for p in self.held if p.unit == st.layer_names[0])
        self.e = self.dtype.itemsize
        algorithm = self.layer_algorithm = make_algorithm(recipe.algorithm)
        self.memory_model = algorithm_memory_model(recipe)
        self.algorithm = dict(recipe.algorithm)
        self.changes_weights = algorithm.changes_weights or residual
        self.default_propagate = algorithm.propagate
        self.layer_names = st.layer_names
        self.by_unit: dict[str, list[Param]] = {}
        for p in self.held:
            self.by_unit.setdefault(p.unit, []).append(p)
        self.targets_of: dict[int, list[QuantTarget]] = {i: [] for i in range(st.num_layers)}
        for t in self.targets:
            self.targets_of[t.linear.layer].append(t)
        self.activations = any(amax_bytes(t.input) or amax_bytes(t.output) for t in self.targets)
        side = [u for u in st.side_units if u in self.by_unit and (shard_root or u != "lm_head")]
        self.export_units = [*self.layer_names, *side, "<root>"]
        self._group_params()
        self._count_quantizers()
        self._kinds_of_layers()
        self._pass_plans: dict[tuple[int, str], PassPlan] = {}
        #: Per export dtype, per export unit, its stored tensors and their sizes: filled by :func:`.disk.unit_entries`.
        self.entries: dict[str, dict[str, list[tuple[Entry, int]]]] = {}

    def _group_params(self) -> None:
        """Parameters of the same rows, row size, dtypes and sharding shard alike: counted once per kind, as read
        (file dtype) and per unit as held (memory dtype)."""
        self.read_groups: dict[bool, Groups] = {True: {}, False: {}}  # by: in a decoder layer
        self.unit_groups: dict[str, Groups] = {}
        layers = set(self.layer_names)
        for p in self.held:
            _count(self.read_groups[p.unit in layers], (p.shape[0], p.row_numel, p.file_bytes, p.sharded))
            _count(self.unit_groups.setdefault(p.unit, {}), (p.shape[0], p.row_numel, p.dtype.itemsize, p.sharded))

    def _count_quantizers(self) -> None:
        """The calibrated quantizers' state up to each layer, and each export unit's largest encoding."""
        self.quantizer_upto: list[int] = []
        total = 0
        for i in range(self.st.num_layers):
            total += sum(amax_bytes(q) for t in self.targets_of[i] for q in (t.weight, t.input, t.output))
            self.quantizer_upto.append(total)
        self.encoded = {u: 0 for u in self.export_units}
        for t in self.targets:
            unit = self.st.unit_of(t.linear.name)
            self.encoded[unit] = max(self.encoded.get(unit, 0), encode_bytes(t, self.dtype))

    def _kinds_of_layers(self) -> None:
        """Decoder layers of the same structure (and the same targets) need the same memory: one kind each, an
        example of each, and the last layer of each kind (the same needs, with the most quantizers before it)."""
        kinds: dict[tuple[Any, ...], int] = {}
        self.kind_of: list[int] = []
        self.example: dict[int, int] = {}
        for i in range(self.st.num_layers):
            prefix = len(self.layer_names[i]) + 1
            key = (self.st.layers[i], tuple(t.linear.name[prefix:] for t in self.targets_of[i]))
            kind = kinds.setdefault(key, len(kinds))
            self.kind_of.append(kind)
            self.example.setdefault(kind, i)
        self.last_of_kind = sorted({k: i for i, k in enumerate(self.kind_of)}.values())

    def pass_plan(self, i: int, propagate: str) -> PassPlan:
        """The passes the runner will run on decoder layer ``i`` (the same for every layer of its kind), as the
        runner itself plans them (:func:`~shardcal.calib.layer_calibration.predicted_pass_plan`) on the layer's
        skeleton."""
        key = (self.kind_of[i], propagate)
        if key not in self._pass_plans:
            layer = self.st.model.get_submodule(self.st.layer_prefix)[i]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # what the algorithm has to say about the layer, the run says
                plan = predicted_pass_plan(layer, self.layer_names[i], self.recipe, self.layer_algorithm, propagate)
            self._pass_plans[key] = plan
        return self._pass_plans[key]

    def unit_kind(self, unit: str) -> str:
        """What the export plan calls export unit ``unit``: ``"layer"``, ``"module"`` (an FSDP2 unit beside the
        layers, an untied head) or ``"root"``."""
        return "root" if unit == "<root>" else "layer" if unit in self.layer_names else "module"


def _grouped(groups: Groups, world: int, gathered: bool) -> int:
    """Bytes of ``groups`` on one rank: each sharded parameter's padded shard (``ceil(rows / N)`` rows), or all N
    shards when ``gathered``; a replicated one whole (and nothing more when gathered: it is not all-gathered)."""
    total = 0
    for (rows, row_numel, itemsize, sharded), count in groups.items():
        held = (world if gathered else 1) * -(-rows // world) if sharded else (0 if gathered else rows)
        total += count * held * row_numel * itemsize
    return total


class PlannedRun:
    """A :class:`PreparedModel` for one world size and data shape; per-layer figures computed once per structure."""

    def __init__(self, prepared: PreparedModel, s: PlanSettings):
        self.prepared, self.s = prepared, s
        self.propagate = s.options.propagate or prepared.default_propagate
        self.rows = batch_rows(s.num_samples, s.options.batch_size)
        world, units = s.world_size, prepared.unit_groups
        self.gathered = {u: _grouped(units.get(u, {}), world, True) for u in prepared.export_units}
        # what stays on a rank between steps: every unit's shard, or (streamed) those outside the decoder layers
        streamed = set(prepared.layer_names) if s.streamed else set()
        self.own_rows = {u: _grouped(units.get(u, {}), world, False) for u in prepared.layer_names}
        #: A streamed run reads each decoder layer whole on every rank, or each rank its rows (the reader decides).
        self.whole_layer_reads = s.streamed and reads_layers_whole(s.device, world)
        # what a streamed rank reads of a layer: read ahead while the previous one computes, then held as read
        self.layer_reads = {
            u: _grouped(units.get(u, {}), 1, False) if self.whole_layer_reads else self.own_rows[u]
            for u in prepared.layer_names
        }
        self.shards = sum(_grouped(g, world, False) for u, g in units.items() if u not in streamed)
        self._cache: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:  # the world-independent parts
        return getattr(self.__dict__["prepared"], name)

    def _memo(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def read(self, rank: int) -> int:
        """The bytes ``rank`` reads from the checkpoint."""
        world, total = self.s.world_size, 0
        for in_layer, groups in self.read_groups.items():
            for (rows, row_numel, value_bytes, sharded), count in groups.items():
                if sharded and not (in_layer and self.whole_layer_reads):
                    chunk = -(-rows // world)
                    rows = max(0, min((rank + 1) * chunk, rows) - rank * chunk)
                total += count * round(rows * row_numel * value_bytes)
        return total

    def forward(self, i: int, rows: int, quantized: bool) -> int:
        """One batch of ``rows`` sequences through layer ``i``: its largest live intermediates (float32)."""
        return self._memo(("forward", self.kind_of[i], rows, quantized), lambda: self._forward(i, rows, quantized))

    def _forward(self, i: int, rows: int, quantized: bool) -> int:
        st, layer, t = self.st, self.st.layers[i], rows * self.s.seq_len
        if t == 0:
            return 0
        h, q = st.hidden_size, st.num_attention_heads * st.head_dim
        per_token = max(
            FORWARD_MLP_HIDDEN * h + FORWARD_MLP_INTERMEDIATE * layer.ffn_width,
            FORWARD_ATTN_HIDDEN * h + FORWARD_ATTN_QUERY * q,
        )
        if layer.sparse:
            per_token += ROUTER_PER_EXPERT * layer.num_experts
        out = 4 * t * per_token
        window = layer.sliding_window
        if window is not None and self.s.seq_len > window:  # an explicit mask: SDPA materialises the scores
            out += rows * self.s.seq_len**2 * (MASKED_SCORE_BYTES_PER_HEAD * st.num_attention_heads + MASK_BYTES)
        if quantized:
            out += max((fake_quant_bytes(x, self.dtype) for x in self.targets_of[i]), default=0)
        rotated = max((x.linear.in_features for x in self.targets_of[i] if x.rotation is not None), default=0)
        return out + 4 * t * ROTATION_COPIES * rotated

    def passes(self, i: int) -> PassPlan:
        """Layer ``i``'s passes in this run (see :meth:`PreparedModel.pass_plan`)."""
        return self.pass_plan(i, self.propagate)

    def observers(self, i: int) -> int:
        """Layer ``i``'s activation observers' state while it is calibrated."""
        return self._memo(("observers", self.kind_of[i]), lambda: sum(
            observer_bytes(t.input) + observer_bytes(t.output) for t in self.targets_of[i]))  # fmt: skip

    def weight_observer(self, i: int) -> int:
        """The temporaries of calibrating layer ``i``'s largest weight's scales."""
        return self._memo(("wobs", self.kind_of[i]), lambda: max(
            (weight_observer_bytes(t, self.dtype) for t in self.targets_of[i]), default=0))  # fmt: skip

    def algorithm_state(self, i: int, rank: int, local_rows: Sequence[int]) -> AlgorithmMemory:
        """The memory layer ``i``'s algorithm holds on ``rank``, whose batches have ``local_rows`` rows (computed
        once per layer structure), as the algorithm's memory model says."""

        def compute() -> AlgorithmMemory:
            j = self.example[self.kind_of[i]]
            context = LayerPlanContext(
                layer=j,
                linears=tuple(planned_linear(t) for t in self.targets_of[j]),
                smoothings=tuple(self.st.smoothings(j)),
                world_size=self.s.world_size,
                rank=rank,
                local_batches=len(local_rows),
                local_tokens=sum(local_rows) * self.s.seq_len,
                hidden_size=self.st.hidden_size,
                batch_forward=self.forward(j, max(local_rows, default=0), True),
            )
            return self.memory_model(context, self.algorithm)

        key = ("algo", self.kind_of[i], rank, tuple(local_rows))
        return self._memo(key, compute)

    def gather_peak(self, unit: str) -> int:
        """What gathering ``unit`` holds at its peak: the unit twice while the all-gather runs (N >= 2), and its
        shard's copy on the device with ``--cpu-offload`` on a GPU; a streamed layer read whole, the layer as read."""
        g, world = self.gathered[unit], self.s.world_size
        if self.whole_layer_reads and unit in self.layer_reads:
            return self.layer_reads[unit]  # held as read: no gather
        extra = g // world if self.s.cpu_offload and self.s.device != "cpu" else 0
        return (2 * g if world > 1 else g) + extra

    def owner(self, index: int, unit: str) -> int:
        """The rank that writes export unit ``unit``, the ``index``-th: as the export plan decides."""
        return unit_owner(index, self.unit_kind(unit), self.s.world_size)
