"""The export layout (its :class:`ExportPlan`): what every tensor of the checkpoint is, who writes it, and in which shard file — computed on
every rank from the module structure alone (names, global shapes, specs), before anything is gathered.

Because the plan is known up front, every rank knows every shard's exact safetensors header (names, dtypes,
shapes, offsets) and the final ``model-0000i-of-0000N`` names before writing a byte: a rank streams its tensors
straight into its own files, one gathered unit at a time, and nothing is renamed afterwards.

Units, in the order every rank gathers them (gathering is collective):

1. each decoder layer ``i`` (one ``layer_unsharded`` gather; nested FSDP units inside it gathered with it), its
   modules spread over the ranks so that each encodes and writes about as many bytes (:func:`spread_layer`: the
   members of a layer vLLM fuses stay together);
2. other FSDP2 units outside the decoder stack (an untied ``lm_head``, a vision tower), continuing the round robin;
3. the root: every remaining parameter (embeddings, final norm, a tied or unwrapped ``lm_head``), gathered with
   ``fsdp2_root_unsharded`` and written by rank 0.

A quantized Linear's ``weight`` (which Linears are quantized, and the quantization config: :mod:`.quant_modules`)
becomes the tensors its export format says (``ExportFormat.module_tensors``, :mod:`.format`; compressed-tensors by
default); every other parameter is stored as it is, in its dtype, under its own (Hugging Face) name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..calib.recipe import Recipe
from ..errors import ExportError
from ..quant.expert_layout import PROJECTIONS, ExpertsLayout, fused_experts_layout
from ..quant.fused import fused_layer
from ..quant.kv_cache import KVCacheQuantizer
from ..sharding.fsdp2 import persistent_buffers
from ..sharding.registry import LayerActivationCollector, decoder_layer_prefix
from .format import ExportFormat, get_format, module_sizes
from .quant_modules import QuantModule, build_quantization_config, check_fused_layers, find_kv_cache, find_quant_modules

SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"


@dataclass
class Entry:
    """One stored tensor: ``source`` is ``("param", name)``, ``("buffer", name)`` (a persistent buffer),
    ``("quant", module_name, suffix)``, ``("expert", experts_module_name, expert, projection)`` for an unquantized
    slice of fused experts, ``("expert_bias", experts_module_name, expert, projection)`` for an expert's bias, or
    ``("kv", attention_name, "k_scale" | "v_scale")``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Unit:
    """What one gather makes available: ``modules`` to unshard (empty for the root, which uses
    ``fsdp2_root_unsharded``) and the entries written from it: ``entries[j]`` by ``owners[j]`` (a decoder layer's,
    spread over the ranks by :func:`spread_layer`), else by ``owner``."""

    index: int
    name: str
    kind: str  # "layer" | "module" | "root"
    module: nn.Module | None
    owner: int
    entries: list[Entry] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)

    def owner_of(self, j: int) -> int:
        """The rank that writes ``entries[j]``."""
        return self.owners[j] if self.owners else self.owner

    def writes(self, rank: int) -> list[Entry]:
        """The entries ``rank`` writes, in order."""
        return [e for j, e in enumerate(self.entries) if self.owner_of(j) == rank]


@dataclass
class Shard:
    file: str
    rank: int
    entries: list[Entry]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass(kw_only=True)
class ExportPlan:
    units: list[Unit]
    shards: list[Shard]
    quant_modules: dict[str, QuantModule]
    quantization_config: dict[str, Any]
    kv_cache: dict[str, KVCacheQuantizer] = field(default_factory=dict)
    #: The format the plan was made for: it encodes the quantized modules and names the config key.
    export_format: ExportFormat = field(default_factory=get_format)

    @property
    def weight_map(self) -> dict[str, str]:
        return {e.key: s.file for s in self.shards for e in s.entries}

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)


def _fsdp_units(model: nn.Module, layers: nn.ModuleList | None) -> list[tuple[str, nn.Module]]:
    """FSDP2 units outside the decoder stack and other than the root, outermost only, in module order."""
    from torch.distributed.fsdp import FSDPModule

    inside_layers = {id(m) for m in layers.modules()} if layers is not None else set()
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or id(module) in inside_layers or not isinstance(module, FSDPModule):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in units):
            continue
        units.append((name, module))
    return units


def _per_expert(mod: str, layout: ExpertsLayout, quant: dict[str, QuantModule]) -> bool:
    """Whether fused experts are written per expert: always in the layout of per-expert original checkpoints
    (transformers folds them back), else (GPT-OSS, whose checkpoints are fused) when any projection is quantized."""
    return layout.standard or any(f"{mod}.{e}.{p}" in quant for e in range(layout.experts) for p in PROJECTIONS)


def _expert_bias_entries(pname: str, dtype: torch.dtype, layout: ExpertsLayout) -> list[Entry]:
    """``<experts>.<e>.<proj>.bias`` per expert for a fused bias parameter (``gate_up_proj_bias``, ``down_proj_bias``)."""
    mod, _, leaf = pname.rpartition(".")
    projections = ("gate_proj", "up_proj") if leaf == "gate_up_proj_bias" else ("down_proj",)
    size = {"gate_proj": layout.inter, "up_proj": layout.inter, "down_proj": layout.hidden}
    return [
        Entry(f"{mod}.{e}.{p}.bias", dtype, (size[p],), ("expert_bias", mod, str(e), p))
        for e in range(layout.experts)
        for p in projections
    ]


def _stored_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an unquantized tensor is stored in: ``dtype`` for a floating one (when given), else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _entries_for(
    names: list[str],
    params: dict[str, torch.Tensor],
    quant: dict[str, QuantModule],
    fused: dict[str, ExpertsLayout],
    fmt: ExportFormat,
    dtype: torch.dtype | None = None,
) -> list[Entry]:
    """The stored tensors of the named parameters and persistent buffers (``params`` holds both); a fused-experts
    parameter becomes per-expert tensors (see :func:`_per_expert`). Unquantized floating tensors are stored in
    ``dtype`` (None: their own)."""
    entries: list[Entry] = []
    for pname in names:
        mod, _, leaf = pname.rpartition(".")
        qm = quant.get(mod)
        if qm is not None and leaf == "weight":
            entries += _quant_entries(qm, fmt)
            continue
        per_expert = mod in fused and _per_expert(mod, fused[mod], quant)
        if per_expert and leaf in ("gate_up_proj_bias", "down_proj_bias"):
            entries += _expert_bias_entries(pname, _stored_dtype(params[pname], dtype), fused[mod])
            continue
        if per_expert and leaf in ("gate_up_proj", "down_proj"):
            projections = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            experts, hidden, inter = fused[mod].shape
            stored = _stored_dtype(params[pname], dtype)
            for e in range(experts):
                for p in projections:
                    name = f"{mod}.{e}.{p}"
                    if name in quant:
                        entries += _quant_entries(quant[name], fmt)
                    else:
                        shape = (hidden, inter) if p == "down_proj" else (inter, hidden)
                        entries.append(Entry(f"{name}.weight", stored, shape, ("expert", mod, str(e), p)))
            continue
        p = params[pname]
        kind = "param" if isinstance(p, nn.Parameter) else "buffer"
        entries.append(Entry(pname, _stored_dtype(p, dtype), tuple(int(d) for d in p.shape), (kind, pname)))
    return entries


def stored_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own persistent buffers (DeepSeek-V3's ``e_score_correction_bias``), stored like parameters;
    shardcal's quantizers keep their state in buffers too, which are exported as scales instead."""
    out = {}
    for name, buf in persistent_buffers(model).items():
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if not type(owner).__module__.startswith("shardcal.quant"):
            out[name] = buf
    return out


def kv_cache_entries(attention: str) -> list[Entry]:
    """The tensors an attention's calibrated KV-cache quantizer stores: ``<attention>.k_scale`` and ``.v_scale``."""
    return [Entry(f"{attention}.{s}", torch.float32, (1,), ("kv", attention, s)) for s in ("k_scale", "v_scale")]


def _quant_entries(qm: QuantModule, fmt: ExportFormat) -> list[Entry]:
    sizes = module_sizes(
        fmt, qm.format, qm.spec_weight, qm.spec_input, qm.out_features, qm.in_features, qm.input_rotation
    )
    return [
        Entry(f"{qm.name}.{suffix}", dt, shape, ("quant", qm.name, suffix)) for suffix, (dt, shape, _) in sizes.items()
    ]


def build_plan(
    model: nn.Module,
    recipe: Recipe | None,
    world_size: int,
    max_shard_bytes: int,
    export_format: ExportFormat | None = None,
    dtype: torch.dtype | None = None,
    *,
    structure_only: bool = False,
) -> ExportPlan:
    """The whole export in ``export_format`` (default compressed-tensors), decided from module structure only;
    identical on every rank. Unquantized floating tensors are stored in ``dtype`` (None: their own).
    ``structure_only``: the quantizers need not be calibrated yet (a streamed export is planned before its run)."""
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    fmt = get_format(export_format)
    quant = find_quant_modules(model, recipe, fmt, structure_only=structure_only)
    kv_cache = find_kv_cache(model, recipe, fmt, structure_only=structure_only)
    if not quant:
        raise ExportError(
            f"{type(model).__name__}: no quantized Linear modules to export; run shardcal.calibrate(model, data, recipe) "
            "first, or pass a weight-only recipe to quantize at export"
        )
    check_fused_layers(model, quant)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())  # tied: once, under their first name
    params.update(stored_buffers(model))
    fused = {
        n: layout for n, m in model.named_modules() if (layout := fused_experts_layout(m, n, strict=False)) is not None
    }
    for name in quant:
        if f"{name}.weight" not in params and name.rsplit(".", 2)[0] not in fused:
            raise ExportError(
                f"module {name!r} is quantized but its weight is shared with another parameter (tied embeddings?); "
                "exclude it from the recipe"
            )

    layers = LayerActivationCollector.get_decoder_layers(model)
    prefixes: list[tuple[str, str, nn.Module | None]] = []  # (kind, prefix, module)
    if layers is not None:
        lp = decoder_layer_prefix(model, layers)
        prefixes += [("layer", f"{lp}.{i}", layer) for i, layer in enumerate(layers)]
    prefixes += [("module", name, m) for name, m in _fsdp_units(model, layers)]

    assigned: dict[str, list[str]] = {p: [] for _, p, _ in prefixes}
    root_names: list[str] = []
    for pname in params:
        owner = max((p for _, p, _ in prefixes if pname.startswith(p + ".")), key=len, default=None)
        (assigned[owner] if owner is not None else root_names).append(pname)

    units: list[Unit] = []
    for i, (kind, prefix, module) in enumerate(prefixes):
        units.append(
            Unit(
                i, prefix, kind, module, unit_owner(i, kind, world_size),
                _entries_for(assigned[prefix], params, quant, fused, fmt, dtype),
            )
        )  # fmt: skip
    root_entries = _entries_for(root_names, params, quant, fused, fmt, dtype)
    root = len(prefixes)
    units.append(Unit(root, "<root>", "root", None, unit_owner(root, "root", world_size), root_entries))
    for name in kv_cache:  # k_scale / v_scale go with the unit that holds the attention
        owner = max((p for _, p, _ in prefixes if name.startswith(p + ".")), key=len, default=None)
        unit = next((u for u in units if u.name == owner), units[-1])
        unit.entries += kv_cache_entries(name)

    shards = split_into_shards(units, world_size, max_shard_bytes)
    config = build_quantization_config(model, quant, kv_cache, fmt)
    return ExportPlan(
        units=units, shards=shards, quant_modules=quant, quantization_config=config, kv_cache=kv_cache,
        export_format=fmt,
    )  # fmt: skip


def laid_out_layer(
    unit: Unit,
    layer: nn.Module,
    quant: dict[str, QuantModule],
    kv_cache: dict[str, KVCacheQuantizer],
    world_size: int,
    export_format: ExportFormat,
    dtype: torch.dtype | None = None,
) -> Unit:
    """Decoder layer ``unit`` laid out from ``layer`` as calibrated, with its quantized modules ``quant`` and KV-cache
    quantizers ``kv_cache`` (full names): the entries, and the ranks that write them, that :func:`build_plan` gives
    that layer of the calibrated model. A streamed run whose layers may fall back lays out each layer so, when it is
    written (:class:`~.shards.RunningShardWriter`)."""
    params: dict[str, torch.Tensor] = dict(layer.named_parameters(prefix=unit.name))
    params.update({f"{unit.name}.{n}": b for n, b in stored_buffers(layer).items()})
    fused = {
        n: layout
        for n, m in layer.named_modules(prefix=unit.name)
        if (layout := fused_experts_layout(m, n, strict=False)) is not None
    }
    entries = _entries_for(list(params), params, quant, fused, export_format, dtype)
    entries += [e for name in kv_cache for e in kv_cache_entries(name)]
    laid_out = Unit(unit.index, unit.name, unit.kind, unit.module, unit.owner, entries)
    spread_layer(laid_out, world_size)
    return laid_out


def unit_owner(index: int, kind: str, world_size: int) -> int:
    """The rank that writes unit ``index`` of the export (``kind``: ``"layer"``, ``"module"`` or ``"root"``): rank 0
    the root, the others round robin (``index % world_size``)."""
    return 0 if kind == "root" else index % world_size


def _group_of(entry: Entry) -> str:
    """What an entry is written with: a quantized module's tensors, or the members of a layer vLLM fuses (their
    ranges are shared when they are quantized at export), go together; any other tensor goes with its module."""
    kind, name = entry.source[0], entry.source[1]
    module = name if kind in ("quant", "expert", "expert_bias", "kv") else name.rpartition(".")[0]
    if kind in ("expert", "expert_bias"):
        return f"{module}#{entry.source[2]}"
    return fused_layer(module) or module


def spread_layer(unit: Unit, world_size: int) -> None:
    """Set ``unit.owners`` for a decoder layer: its groups of entries (:func:`_group_of`) given, largest first, each
    to the rank with the fewest bytes so far (ties to the first in an order that starts at rank ``index %
    world_size``, so that small layers alternate). The same on every rank: it depends on the plan alone."""
    if unit.kind != "layer" or world_size == 1:
        return
    groups = [_group_of(e) for e in unit.entries]
    sizes: dict[str, int] = {}
    for group, e in zip(groups, unit.entries):
        sizes[group] = sizes.get(group, 0) + e.nbytes
    load = [0] * world_size
    order = [(unit.index + k) % world_size for k in range(world_size)]
    rank_of: dict[str, int] = {}
    for group in sorted(sizes, key=lambda g: -sizes[g]):  # stable: equal sizes keep their order
        rank = min(order, key=lambda r: load[r])
        rank_of[group] = rank
        load[rank] += sizes[group]
    unit.owners = [rank_of[group] for group in groups]


def split_into_shards(units: list[Unit], world_size: int, max_shard_bytes: int) -> list[Shard]:
    """The shard files of ``units`` (in the order every rank gathers them): each rank's own entries, in order, cut
    into files of at most ``max_shard_bytes`` (a larger tensor alone in its file), numbered rank by rank. Sets who
    writes each decoder layer's entries first (:func:`spread_layer`), so that the export and the planner, which both
    call this, agree."""
    for unit in units:
        spread_layer(unit, world_size)
    per_rank: list[list[list[Entry]]] = [[] for _ in range(world_size)]
    for r in range(world_size):
        current: list[Entry] = []
        size = 0
        for unit in units:
            for e in unit.writes(r):
                if current and size + e.nbytes > max_shard_bytes:
                    per_rank[r].append(current)
                    current, size = [], 0
                current.append(e)
                size += e.nbytes
        if current:
            per_rank[r].append(current)
    total = sum(len(files) for files in per_rank)
    shards: list[Shard] = []
    for r, files in enumerate(per_rank):
        for entries in files:
            shards.append(Shard(SHARD_NAME.format(index=len(shards) + 1, total=total), r, entries))
    return shards
