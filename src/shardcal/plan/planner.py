"""Plan before you load: per-rank memory, disk reads, all-gather volume and disk space of a calibration, predicted
from ``config.json``, the safetensors headers and the model built on the meta device (no weight is read; shardcal's
classes and transformers' alike, :mod:`.structure`), so that ``shardcal calibrate`` can
refuse a run that would run out of memory before it loads anything.

What one rank holds during ``shardcal calibrate`` (load, calibrate, export), and how the plan counts it:

* **parameter shards**: every parameter sharded dim-0 over N ranks as FSDP2 does (``ceil(rows / N)`` rows on
  every rank, padding included); parameters off the model's dtype (a float32 router) and, with
  ``shard_root=False``, everything outside the decoder stack stay whole on every rank;
* **one gathered unit** (a decoder layer, the root's embeddings / norm / tied head, an untied ``lm_head`` at
  export): held whole while it is used, and twice for the moment of the all-gather (FSDP2's flat all-gather
  buffer beside the per-parameter copies) when N >= 2;
* **the activation cache**: this rank's whole batches (``rank_batch_indices``) × seq × hidden, twice (the current
  layer's inputs and outputs), plus the rotary tables (cos, sin) of every batch; in host memory on a GPU; twice
  more for an algorithm that reads the full-precision stream (GPTQ's ``stream_correction``: its inputs and outputs);
* **one batch's intermediates** while a layer runs on it (attention or MLP, computed as float32 where fake
  quantization and RMSNorm compute), and the fake-quantized copy of the largest weight;
* **quantizer state** (every calibrated amax, kept for all layers, on every rank) and one layer's observers, and the
  observer's work on the largest weight while weight scales are calibrated;
* **algorithm state** of one layer: GPTQ's Hessians (one ``[in, in]`` exact sum in two float64 limbs, 16 bytes per
  element, per quantized Linear, all at once) and the float64 solve of one of them; AWQ's Gram matrices and clip
  Hessians; SmoothQuant's maxima (and token samples with ``alpha_grid``);
* **export buffers**: the encoded tensors of the largest quantized Linear a rank writes;
* while loading, the checkpoint pages this rank maps (its own rows: resident, but reclaimable page cache);
* a fixed runtime allowance (module objects, FSDP2 state, thread pools).

The sizes of the parts are exact functions of the shapes; the factors for temporaries (how many float32 copies of a
batch or a weight an operation makes) were measured on the real code and are the ``*_BYTES`` / ``*_COPIES``
constants below (the algorithms' own with their memory models, :mod:`shardcal.algorithms.memory`); the planner is
held to measured peaks by ``benchmarks/plan_accuracy.py`` and ``tests/plan/``. Phases (load, embed, layers, export) add up what is alive at
the same time; the peak is the largest phase. See docs/scaling.md.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..algorithms import make_algorithm
from ..algorithms.gptq import SOLVE_HESSIAN_COPIES, SOLVE_WEIGHT_BYTES
from ..algorithms.memory import (
    EXACT_SUM_BYTES as EXACT_SUM_BYTES,  # named here as before
)
from ..algorithms.memory import (
    GRAM_ADD_BYTES as GRAM_ADD_BYTES,
)
from ..algorithms.memory import (
    AlgorithmMemory,
    LayerPlanContext,
    MemoryModel,
    PlannedLinear,
    memory_model_of,
)
from ..algorithms.residual import PROBE_TOKENS, root_modules, untie_word_embeddings
from ..calib.recipes import Recipe, compile_pattern, load_recipe
from ..errors import CheckpointError, ConfigError, PlanError, RecipeError, UsageError
from ..export.export import DEFAULT_MAX_SHARD_BYTES
from ..export.format import ExportFormat, get_format, module_sizes
from ..export.layout import SHARD_NAME, Entry, kv_cache_entries
from ..export.shards import header_bytes
from ..layerwise.batches import leading_rows_of, rank_batch_indices
from ..layerwise.options import CalibrationOptions
from ..loading.build import build_on_meta, check_checkpoint_keys, resolve_dtype
from ..loading.foreign import build_transformers_on_meta, choose_impl, raw_config
from ..loading.sources import resolve_sources
from ..models.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointReader
from ..models.config import ModelConfig, load_config
from ..quant.granularity import Layout
from ..quant.kv_cache import kv_cache_attentions
from ..quant.spec import QuantizerSpec
from ..runtime.hostmem import available_bytes
from .preflight import fix_hint
from .structure import Linear, ModelStructure, read_structure

MiB = 2**20
#: ``[rotation] residual``: float64 copies of a weight while it is rotated (the value, the signed copy, the work
#: buffers of the transforms), and float32 copies of the probe's logits (before, after, their difference).
RESIDUAL_WEIGHT_COPIES, PROBE_LOGIT_COPIES = 4, 3
DEVICES = ("cpu", "cuda")

# ------------------------------------------------------------------------------------ measured constants
#: Per-process allowance beyond the tensors: module objects, FSDP2 state, thread pools (measured: 37 MiB for
#: SmolLM2's 30 layers, 35 MiB for a 2-layer model).
RUNTIME_BASE_BYTES = 34 * MiB
RUNTIME_PER_LAYER_BYTES = MiB // 10
#: One batch through a decoder layer, in float32 elements per token: the MLP holds ~3 hidden- and 3
#: intermediate-sized tensors at its widest, attention ~2 hidden- and 6 query-sized ones.
FORWARD_MLP_HIDDEN, FORWARD_MLP_INTERMEDIATE = 3, 3
FORWARD_ATTN_HIDDEN, FORWARD_ATTN_QUERY = 2, 6
#: A Linear that rotates its inputs holds the rotated copy and one butterfly round's result beside its input
#: (float32 elements per token and input feature).
ROTATION_COPIES = 2
#: The layer-output SQNR of one batch: float64 copies of the output, the reference and their difference (bytes per
#: element of the batch's hidden states, beside the output itself).
SQNR_BYTES = 32
#: A checkpoint commit's metadata per tensor it holds for each finished layer (a changed weight, a quantizer's
#: state): its safetensors header entry and its lines in the manifest (the listing, the layer report), beside a
#: fixed 4096 bytes per rank (an allowance: what was measured stays well below it).
CHECKPOINT_ENTRY_BYTES = 512
#: Bytes per weight element of temporaries, by operation and number-format kind (measured on float32 and bfloat16
#: weights): the observer calibrating a weight; fake-quantizing a weight in a forward; encoding it for export.
OBSERVER_BYTES = {"mse": 22, "percentile": 44}  # "max": one copy in the weight's dtype
FAKE_QUANT_BYTES = {"int": 9, "fp8": 9, "nvfp4": 25}  # + 4 when the weight is not float32
ENCODE_BYTES = {"int": 20, "fp8": 9, "nvfp4": 25}  # + 4 when the weight is not float32
#: The algorithms' own constants live with their memory models (:mod:`shardcal.algorithms`); named here as before.
GPTQ_SOLVE_HESSIAN_COPIES, GPTQ_SOLVE_WEIGHT_BYTES = SOLVE_HESSIAN_COPIES, SOLVE_WEIGHT_BYTES
#: One layer's algorithm memory (the name it had here).
AlgorithmState = AlgorithmMemory


# ------------------------------------------------------------------------------------ the model's tensors


@dataclass(frozen=True)
class Param:
    """One parameter as ``load_pretrained`` holds it: its FSDP2 unit and whether it is sharded over the ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # in memory
    file_dtype: torch.dtype  # in the checkpoint (the memory dtype when planning from config.json alone)
    unit: str  # the FSDP2 unit that gathers it: a decoder layer's name, "lm_head" or "<root>"
    sharded: bool
    row_numel: int = field(init=False, repr=False)  # elements per dim-0 row

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_numel", math.prod(self.shape[1:]))

    @property
    def numel(self) -> int:
        return self.shape[0] * self.row_numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def build_params(structure: ModelStructure, dtype: torch.dtype, file_dtypes: Mapping[str, torch.dtype] | None,
                 shard_root: bool) -> list[Param]:  # fmt: skip
    """The parameters as ``load_pretrained`` holds them: memory dtype (``dtype``, or as built for a class the loader
    does not cast; float32 routers kept when the checkpoint stores them so), file dtype, FSDP2 unit, sharded or
    replicated (off the dominant dtype; outside the decoder stack and its side units with ``shard_root=False``)."""
    shapes, built, files = structure.params, structure.built_dtypes, dict(file_dtypes or {})
    dtypes = {n: built[n] if built is not None else dtype for n, _ in shapes}
    for n in structure.routers:
        if files.get(n) == torch.float32:
            dtypes[n] = torch.float32
    counts: dict[torch.dtype, int] = {}
    for n, s in shapes:
        counts[dtypes[n]] = counts.get(dtypes[n], 0) + math.prod(s)
    dominant = max(counts, key=lambda d: counts[d])
    wrapped = set(structure.layer_names) | {u for u in structure.side_units if u != "lm_head"}
    out = []
    for n, s in shapes:
        unit = structure.units[n]
        sharded = dtypes[n] == dominant and (unit in wrapped or shard_root)
        out.append(Param(n, s, dtypes[n], files.get(n, dtypes[n]), unit, sharded))
    return out


# ------------------------------------------------------------------------------------ reading the model dir


@dataclass
class ModelSource:
    """What the plan knows about a model directory: its config (shardcal's :class:`ModelConfig`; None for a class
    only transformers has), its structure (the model on the meta device, read as tables) and, when there are
    weights, their header dtypes."""

    config: ModelConfig | None
    file_dtypes: dict[str, torch.dtype] | None  # None: config.json only
    checkpoint_bytes: int  # the checkpoint's tensor data (from the headers), or the config's size in its dtype
    structure: ModelStructure | None = None  # None: built from ``config`` (shardcal's class) when first needed
    _tensors: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def model_structure(self) -> ModelStructure:
        """The structure, built once (from shardcal's class for ``config`` when none was given)."""
        if self.structure is None:
            if self.config is None:
                raise PlanError("ModelSource needs a config or a structure")
            self.structure = shardcal_structure(self.config)
        return self.structure

    def tensors(self) -> tuple[list[tuple[str, tuple[int, ...]]], list[Linear]]:
        """Every parameter ``(name, shape)`` in ``named_parameters`` order and every Linear (fused experts' per-expert
        projections included)."""
        structure = self.model_structure()
        return structure.params, structure.linears

    def untied(self) -> ModelSource:
        """This source as ``load_pretrained(..., untie_word_embeddings=True)`` loads it: a head tied to the
        embeddings becomes a parameter of its own (an FSDP2 unit, stored by the export), read from the same tensor."""
        st = self.model_structure()
        model = copy.deepcopy(st.model)  # on the meta device: shapes only
        names = {id(p): n for n, p in model.named_parameters()}
        embed = root_modules(model)[0]
        if not untie_word_embeddings(model):
            return self
        structure = read_structure(model, st.model_type, hidden_size=st.hidden_size,
                                   num_attention_heads=st.num_attention_heads, head_dim=st.head_dim,
                                   built_dtypes=st.built_dtypes is not None)  # fmt: skip
        files = None
        if self.file_dtypes is not None:
            head = next(n for n, _ in structure.params if n not in self.file_dtypes)
            files = {**self.file_dtypes, head: self.file_dtypes[names[id(embed.weight)]]}
        return ModelSource(self.config, files, self.checkpoint_bytes, structure)

    def params(self, dtype: torch.dtype, shard_root: bool) -> list[Param]:
        """:func:`build_params` for this source, computed once per dtype and ``shard_root``."""
        key = ("params", dtype, shard_root)
        if key not in self._tensors:
            self._tensors[key] = build_params(self.model_structure(), dtype, self.file_dtypes, shard_root)
        return self._tensors[key]


def shardcal_structure(cfg: ModelConfig) -> ModelStructure:
    """The structure of shardcal's class for ``cfg`` (built on the meta device; shapes only, dtypes as asked)."""
    model = build_on_meta(cfg, torch.float32)
    return read_structure(model, cfg.model_type, hidden_size=cfg.hidden_size,
                          num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                          built_dtypes=False)  # fmt: skip


def model_tensors(cfg: ModelConfig) -> tuple[list[tuple[str, tuple[int, ...]]], list[Linear]]:
    """Every parameter ``(name, shape)`` of shardcal's model for ``cfg``, in ``named_parameters`` order, and every
    Linear module — read from the model built on the meta device."""
    structure = shardcal_structure(cfg)
    return structure.params, structure.linears


def read_source(model_dir: str | Path, dtype: torch.dtype | str | None = None, impl: str = "auto") -> ModelSource:
    """Read ``config.json`` and, if present, the safetensors headers of ``model_dir`` (never the weights), and build
    the model on the meta device: shardcal's class, or transformers' (``impl``: ``auto`` takes shardcal's when it
    has one, as ``--model-impl`` does).

    The headers are checked as the loader checks them (every tensor present, the shapes the model has, float
    dtypes, nothing unexpected), with the same errors. A directory with only ``config.json`` is planned from the
    shapes the model has, in its dtype.
    """
    if choose_impl(model_dir, impl) == "transformers":
        return _read_foreign_source(Path(model_dir), dtype)
    cfg = load_config(model_dir)
    _refuse_quantized(cfg.raw, model_dir)
    target = resolve_dtype(cfg, dtype)
    structure = shardcal_structure(cfg)
    folder = Path(model_dir)
    if not _has_weights(folder):
        return ModelSource(cfg, None, sum(math.prod(s) for _, s in structure.params) * target.itemsize, structure)
    with CheckpointReader(folder) as reader:
        check_checkpoint_keys(structure.model, reader, cfg)
        expected = dict(structure.params)
        if cfg.tie_word_embeddings and "lm_head.weight" in reader:
            expected["lm_head.weight"] = reader.shape("lm_head.weight")
        dtypes = {name: reader.dtype(name) for name in expected}
    stored = sum(math.prod(expected[n]) * dtypes[n].itemsize for n in expected)
    return ModelSource(cfg, dtypes, stored, structure)


def _refuse_quantized(raw: Mapping[str, Any], model_dir: str | Path) -> None:
    if raw.get("quantization_config") is not None:
        raise CheckpointError(
            f"{model_dir}: load_pretrained reads unquantized checkpoints; load an exported (quantized) directory "
            "with shardcal.models.from_pretrained"
        )


def _has_weights(folder: Path) -> bool:
    """Whether ``folder`` has safetensors weights (raising the loader's error for pickled or unindexed ones)."""
    if (folder / INDEX_NAME).is_file() or (folder / SINGLE_NAME).is_file():
        return True
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.safetensors")):
        CheckpointReader(folder)  # raises the loader's error
    return False


def _read_foreign_source(folder: Path, dtype: torch.dtype | str | None) -> ModelSource:
    """A model only transformers has a class for: built on the meta device, its parameters found in the checkpoint
    as the loader finds them (:func:`~shardcal.loading.sources.resolve_sources`)."""
    raw = raw_config(folder)
    _refuse_quantized(raw, folder)
    model = build_transformers_on_meta(folder)
    if dtype is not None:  # load_pretrained(dtype=) casts every floating parameter
        target = resolve_dtype(None, dtype)
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(target)
    structure = read_structure(model, str(raw.get("model_type")))
    held = dict(model.named_parameters())
    if not _has_weights(folder):
        size = sum(p.numel() * p.element_size() for p in held.values())
        return ModelSource(None, None, size, structure)
    with CheckpointReader(folder) as reader:
        sources = resolve_sources(model, reader)
        dtypes = {name: reader.dtype(src.parts[0][0]) for name, src in sources.items()}
        keys = {k for src in sources.values() for k in src.keys()}
        stored = sum(math.prod(reader.shape(k)) * reader.dtype(k).itemsize for k in keys)
    return ModelSource(None, dtypes, stored, structure)


# ------------------------------------------------------------------------------------ the recipe's quantizers


@dataclass(frozen=True)
class QuantTarget:
    """A Linear the recipe quantizes, with the layouts (amax shapes) of its quantizers."""

    linear: Linear
    weight: Layout | None
    input: Layout | None
    output: Layout | None
    #: The Hadamard block rotating its inputs (a recipe's ``[rotation]``), or None.
    rotation: int | None = None


def _layout(spec: QuantizerSpec | None, shape: tuple[int, ...], name: str, recipe: Recipe) -> Layout | None:
    if spec is None:
        return None
    try:
        return Layout(spec, shape, name)
    except ValueError as exc:
        module = name.rsplit(".", 1)[0]
        message = f"{recipe.source or recipe.name}: recipe {recipe.name!r} does not fit module {module!r}: {exc}"
        raise RecipeError(message + fix_hint(message)) from None


def quant_targets(linears: list[Linear], recipe: Recipe) -> list[QuantTarget]:
    """The decoder-layer Linears ``recipe`` targets (what ``calibrate`` turns into QuantLinears), their layouts
    checked as ``quantize_modules`` checks them (a group size that does not divide ``in_features`` is the same
    :class:`RecipeError`, before anything is loaded)."""
    include = re.compile("|".join(f"(?:{compile_pattern(p).pattern})" for p in recipe.include))
    exclude = re.compile("|".join(f"(?:{compile_pattern(p).pattern})" for p in recipe.all_excludes) or "(?!)")
    layouts: dict[tuple[Any, ...], Layout | None] = {}  # experts share shapes: one layout per shape and spec

    def layout(role: str, shape: tuple[int, ...], name: str) -> Layout | None:
        try:
            spec = recipe.weight_spec(name, shape[-1]) if role == "weight" else getattr(recipe, role)  # group fallback
        except RecipeError as exc:
            raise RecipeError(f"{exc}{fix_hint(str(exc))}") from None
        key = (role, shape, spec)
        if key not in layouts:
            layouts[key] = _layout(spec, shape, f"{name}.{role}_quantizer", recipe)
        return layouts[key]

    out = []
    for lin in linears:
        if lin.layer is None or not include.fullmatch(lin.name) or exclude.fullmatch(lin.name):
            continue
        w, i, o = (lin.out_features, lin.in_features), (lin.in_features,), (lin.out_features,)
        out.append(QuantTarget(lin, layout("weight", w, lin.name), layout("input", i, lin.name),
                               layout("output", o, lin.name), _rotation(recipe, lin)))  # fmt: skip
    return out


def _rotation(recipe: Recipe, lin: Linear) -> int | None:
    """The rotation block of a targeted Linear (checked when the recipe is applied to the skeleton, not here)."""
    try:
        return recipe.rotation_block(lin.name, lin.in_features)
    except RecipeError:
        return None


def _amax_bytes(layout: Layout | None) -> int:
    """A quantizer's amax buffer: float32 per slot (none for a dynamic quantizer)."""
    return 0 if layout is None or layout.spec.dynamic else 4 * layout.num_slots


def _observer_bytes(layout: Layout | None) -> int:
    """An activation quantizer's observer state while its layer is calibrated (amax, count, histogram or scores)."""
    if layout is None or layout.spec.dynamic:
        return 0
    slots, spec = layout.num_slots, layout.spec
    extra = 0
    if spec.observer == "percentile":
        extra = 8 * slots * int(spec.observer_params.get("bins", 2048))
    elif spec.observer == "mse":
        grid, shrink = spec.observer_params.get("grid", 100), spec.observer_params.get("max_shrink", 0.2)
        extra = 8 * slots * (int(math.floor(shrink * grid + 1e-9)) + 1)
    return 4 * slots + 8 + extra


def _kind(spec: QuantizerSpec) -> str:
    return {"int8": "int", "int4": "int", "fp8_e4m3": "fp8", "nvfp4": "nvfp4"}[spec.format]


def weight_observer_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of calibrating one weight's scales (``calibrate_from`` on the gathered weight)."""
    if target.weight is None:
        return 0
    numel = target.linear.in_features * target.linear.out_features
    per = OBSERVER_BYTES.get(target.weight.spec.observer, dtype.itemsize)
    return numel * per


def fake_quant_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of the fake-quantized weight a forward in quantize mode computes."""
    if target.weight is None:
        return 0
    extra = 0 if dtype == torch.float32 else 4
    return (
        target.linear.in_features * target.linear.out_features * (FAKE_QUANT_BYTES[_kind(target.weight.spec)] + extra)
    )


def encode_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of encoding one weight for export (the encoded tensors included)."""
    if target.weight is None:
        return 0
    extra = 0 if dtype == torch.float32 else 4
    return target.linear.in_features * target.linear.out_features * (ENCODE_BYTES[_kind(target.weight.spec)] + extra)


# ------------------------------------------------------------------------------------ algorithm state


def planned_linear(target: QuantTarget) -> PlannedLinear:
    """A quantized Linear as an algorithm's memory model sees it (:mod:`shardcal.algorithms.memory`)."""
    lin = target.linear
    spec = lambda layout: None if layout is None else layout.spec
    return PlannedLinear(
        lin.name, lin.in_features, lin.out_features, spec(target.weight), spec(target.input), target.rotation
    )


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


# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlanSettings:
    """How the calibration will run: ranks, data, device, offloading (what ``shardcal calibrate`` is given)."""

    world_size: int = 1
    local_world_size: int | None = None  # ranks per node (host memory is shared by them); None: all of them
    num_samples: int = 32
    seq_len: int = 256
    device: str = "cpu"
    cpu_offload: bool = False
    shard_root: bool = True
    options: CalibrationOptions = field(default_factory=CalibrationOptions)

    def __post_init__(self) -> None:
        for name in ("world_size", "num_samples", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "seq_len" else 1):
                raise UsageError(
                    f"{name.replace('_', '-')} must be an integer >= {2 if name == 'seq_len' else 1}, got {value!r}"
                )
        if self.local_world_size is not None and not 1 <= self.local_world_size <= self.world_size:
            raise UsageError(
                f"ranks per node must be between 1 and the world size {self.world_size}, got {self.local_world_size}"
            )
        if self.device not in DEVICES:
            raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    @property
    def local(self) -> int:
        return self.local_world_size or self.world_size

    @property
    def offload_activations(self) -> bool:
        """Whether the activation cache is in host memory (the runner's default: exactly when on an accelerator)."""
        off = self.options.offload_activations
        return (self.device != "cpu") if off is None else bool(off)

    def replace(self, **changes: Any) -> PlanSettings:
        import dataclasses

        return dataclasses.replace(self, **changes)


@dataclass
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


@dataclass
class CalibrationPlan:
    """The whole prediction; :meth:`to_dict` is what ``shardcal plan --json`` prints."""

    model: dict[str, Any]
    recipe: str
    algorithm: str
    settings: PlanSettings
    ranks: list[RankPlan]
    io: dict[str, int]
    disk: dict[str, int]
    time: dict[str, Any] | None = None

    @property
    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.peak, -r.rank))

    @property
    def peak_bytes_per_rank(self) -> int:
        return self.peak_rank.peak

    def node_ranks(self, first: int = 0) -> list[RankPlan]:
        """The ranks of the node whose first rank is ``first`` (``local_world_size`` consecutive ranks)."""
        return self.ranks[first : first + self.settings.local]

    def to_dict(self) -> dict[str, Any]:
        s, peak = self.settings, self.peak_rank
        out = {
            "model": dict(self.model),
            "recipe": self.recipe,
            "algorithm": self.algorithm,
            "world_size": s.world_size,
            "ranks_per_node": s.local,
            "device": s.device,
            "cpu_offload": s.cpu_offload,
            "offload_activations": s.offload_activations,
            "shard_root": s.shard_root,
            "data": {
                "num_samples": s.num_samples,
                "seq_len": s.seq_len,
                "batch_size": s.options.batch_size,
                "num_batches": -(-s.num_samples // s.options.batch_size),
            },
            "peak_bytes_per_rank": peak.peak,
            "peak_rank": peak.rank,
            "peak_phase": peak.peak_phase,
            "required_bytes_per_rank": max(r.required for r in self.ranks),
            "host_peak_bytes_per_rank": max(r.host_peak for r in self.ranks),
            "parts": dict(peak.parts),
            "largest_gathered_unit": peak.largest_unit,
            "io": dict(self.io),
            "disk": dict(self.disk),
            "ranks": [r.to_dict() for r in self.ranks],
        }
        if self.time is not None:
            out["time"] = dict(self.time)
        return out


def _rows(p: Param, world: int) -> int:
    return -(-p.shape[0] // world)


def shard_bytes(p: Param, world: int) -> int:
    """What ``p`` occupies on every rank: its padded dim-0 shard (``ceil(rows / N)`` rows), or all of it."""
    return _rows(p, world) * p.row_numel * p.dtype.itemsize if p.sharded else p.nbytes


def read_bytes(p: Param, world: int, rank: int) -> int:
    """The bytes rank ``rank`` reads of ``p`` from the checkpoint (its own rows, in the file's dtype)."""
    if not p.sharded:
        return p.numel * p.file_dtype.itemsize
    chunk = _rows(p, world)
    rows = max(0, min((rank + 1) * chunk, p.shape[0]) - rank * chunk)
    return rows * p.row_numel * p.file_dtype.itemsize


def gathered_bytes(params: list[Param], world: int) -> int:
    """A gathered unit: every sharded parameter whole (as FSDP2 gathers it: N padded shards)."""
    return sum(world * _rows(p, world) * p.row_numel * p.dtype.itemsize for p in params if p.sharded)


def batch_rows(num_samples: int, batch_size: int) -> list[int]:
    """Rows of each global batch (the last may be smaller)."""
    return [min(batch_size, num_samples - s) for s in range(0, num_samples, batch_size)]


def _export_view(params: list[Param], st: ModelStructure) -> list[Param]:
    """The tensors as the export stores them: a fused experts parameter (weights, GPT-OSS's biases) as its per-expert
    tensors, then the model's persistent buffers (whole, in their unit)."""
    out = []
    for p in params:
        if p.name not in st.fused:
            out.append(p)
            continue
        out += [Param(n, shape, p.dtype, p.file_dtype, p.unit, p.sharded) for n, shape in st.fused[p.name]]
    out += [Param(n, shape, dtype, dtype, st.unit_of(n), False) for n, shape, dtype in st.buffers]
    return out


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
        self.recipe, self.shard_root = recipe, shard_root
        linears = st.linears
        self.held = source.params(resolve_dtype(source.config, dtype), shard_root)
        params = self.params = _export_view(self.held, st)
        params = self.held
        self.numel, self.nbytes = sum(p.numel for p in params), sum(p.nbytes for p in params)
        self.targets = quant_targets(linears, recipe)
        self.dtype = next(p.dtype for p in params if p.unit == st.layer_names[0])
        self.e = self.dtype.itemsize
        algorithm = make_algorithm(recipe.algorithm)
        self.memory_model = algorithm_memory_model(recipe)
        self.algorithm = dict(recipe.algorithm)
        self.changes_weights = algorithm.changes_weights or residual
        self.residual = residual
        self.default_propagate = algorithm.propagate
        self.reference_stream = algorithm.reference_stream
        self.layer_names = st.layer_names
        self.by_unit: dict[str, list[Param]] = {}
        for p in params:
            self.by_unit.setdefault(p.unit, []).append(p)
        self.targets_of: dict[int, list[QuantTarget]] = {i: [] for i in range(st.num_layers)}
        for t in self.targets:
            self.targets_of[t.linear.layer].append(t)
        self.activations = any(_amax_bytes(t.input) or _amax_bytes(t.output) for t in self.targets)
        side = [u for u in st.side_units if u in self.by_unit and (shard_root or u != "lm_head")]
        self.export_units = [*self.layer_names, *side, "<root>"]
        # parameters of the same rows, row size, dtypes and sharding shard alike: count them once per kind
        self.read_groups: dict[tuple[int, int, int, bool], int] = {}
        self.unit_groups: dict[str, dict[tuple[int, int, int, bool], int]] = {}
        for p in params:
            key = (p.shape[0], p.row_numel, p.file_dtype.itemsize, p.sharded)
            self.read_groups[key] = self.read_groups.get(key, 0) + 1
            groups = self.unit_groups.setdefault(p.unit, {})
            key = (p.shape[0], p.row_numel, p.dtype.itemsize, p.sharded)
            groups[key] = groups.get(key, 0) + 1
        self.quantizer_upto: list[int] = []
        total = 0
        for i in range(st.num_layers):
            total += sum(_amax_bytes(q) for t in self.targets_of[i] for q in (t.weight, t.input, t.output))
            self.quantizer_upto.append(total)
        self.encoded = {u: 0 for u in self.export_units}
        for t in self.targets:
            unit = st.unit_of(t.linear.name)
            self.encoded[unit] = max(self.encoded.get(unit, 0), encode_bytes(t, self.dtype))
        # decoder layers of the same structure (and the same targets) need the same memory: computed once per kind
        kinds: dict[tuple[Any, ...], int] = {}
        self.kind_of: list[int] = []
        self.example: dict[int, int] = {}
        for i in range(st.num_layers):
            prefix = len(self.layer_names[i]) + 1
            key = (st.layers[i],
                   tuple(t.linear.name[prefix:] for t in self.targets_of[i]))  # fmt: skip
            kind = kinds.setdefault(key, len(kinds))
            self.kind_of.append(kind)
            self.example.setdefault(kind, i)
        # the last layer of each structure: the same needs as the others of its kind, with the most quantizers
        self.last_of_kind = sorted({k: i for i, k in enumerate(self.kind_of)}.values())
        self._entries: dict[str, list[tuple[Entry, int]]] | None = None

    def unit_entries(self) -> dict[str, list[tuple[Entry, int]]]:
        """Per export unit, its stored tensors with their sizes (see :func:`export_entries`)."""
        if self._entries is None:
            self._entries = export_entries(self)
        return self._entries


class _Model:
    """A :class:`PreparedModel` for one world size and data shape; per-layer figures computed once per structure."""

    def __init__(self, prepared: PreparedModel, s: PlanSettings):
        self.prepared, self.s = prepared, s
        self.propagate = s.options.propagate or prepared.default_propagate
        self.rows = batch_rows(s.num_samples, s.options.batch_size)
        world = s.world_size

        def grouped(groups: dict[tuple[int, int, int, bool], int], gathered: bool) -> int:
            total = 0
            for (rows, row_numel, itemsize, sharded), count in groups.items():
                held = (world if gathered else 1) * -(-rows // world) if sharded else (0 if gathered else rows)
                total += count * held * row_numel * itemsize
            return total

        units = prepared.unit_groups
        self.gathered = {u: grouped(units.get(u, {}), True) for u in prepared.export_units}
        self.shards = sum(grouped(g, False) for g in units.values())
        self._cache: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:  # the world-independent parts
        return getattr(self.__dict__["prepared"], name)

    def _memo(self, key: tuple[Any, ...], compute: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def read(self, rank: int) -> int:
        """The bytes ``rank`` reads from the checkpoint."""
        world, total = self.s.world_size, 0
        for (rows, row_numel, itemsize, sharded), count in self.read_groups.items():
            if sharded:
                chunk = -(-rows // world)
                rows = max(0, min((rank + 1) * chunk, rows) - rank * chunk)
            total += count * rows * row_numel * itemsize
        return total

    # -- per layer (kind), per batch
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
            per_token += 2 * layer.num_experts
        out = 4 * t * per_token
        window = layer.sliding_window
        if window is not None and self.s.seq_len > window:  # an explicit mask: SDPA materialises the scores
            out += rows * self.s.seq_len**2 * (4 * st.num_attention_heads + 1)
        if quantized:
            out += max((fake_quant_bytes(x, self.dtype) for x in self.targets_of[i]), default=0)
        rotated = max((x.linear.in_features for x in self.targets_of[i] if x.rotation is not None), default=0)
        return out + 4 * t * ROTATION_COPIES * rotated

    def observers(self, i: int) -> int:
        return self._memo(("observers", self.kind_of[i]), lambda: sum(
            _observer_bytes(t.input) + _observer_bytes(t.output) for t in self.targets_of[i]))  # fmt: skip

    def weight_observer(self, i: int) -> int:
        return self._memo(("wobs", self.kind_of[i]), lambda: max(
            (weight_observer_bytes(t, self.dtype) for t in self.targets_of[i]), default=0))  # fmt: skip

    def algorithm_state(self, i: int, rank: int, local_rows: Sequence[int]) -> AlgorithmMemory:
        """The memory layer ``i``'s algorithm holds on ``rank``, whose batches have ``local_rows`` rows (computed
        once per layer structure)."""

        def compute() -> AlgorithmMemory:
            j = self.example[self.kind_of[i]]
            context = LayerPlanContext(
                j, tuple(planned_linear(t) for t in self.targets_of[j]), tuple(self.st.smoothings(j)),
                self.s.world_size, rank, len(local_rows), sum(local_rows) * self.s.seq_len, self.st.hidden_size,
                self.forward(j, max(local_rows, default=0), True),
            )  # fmt: skip
            return self.memory_model(context, self.algorithm)

        key = ("algo", self.kind_of[i], rank % self.s.world_size, tuple(local_rows))
        return self._memo(key, compute)

    def gather_peak(self, unit: str) -> int:
        g, world = self.gathered[unit], self.s.world_size
        extra = g // world if self.s.cpu_offload and self.s.device != "cpu" else 0
        return (2 * g if world > 1 else g) + extra

    def owner(self, index: int, unit: str) -> int:
        return 0 if unit == "<root>" else index % self.s.world_size


def _residual_rotation_bytes(m: _Model) -> int:
    """``[rotation] residual`` before calibration (:func:`shardcal.algorithms.residual.rotate_residual`): the larger
    of one layer gathered with the float64 copies of its largest weight that the rotation makes
    (:data:`RESIDUAL_WEIGHT_COPIES`), and the probe forward of :data:`PROBE_TOKENS` tokens — the root and the head
    gathered, the layers one at a time, the logits (float32) kept twice."""
    biggest = max((m.gathered[u] for u in m.layer_names), default=0)
    widest = max((math.prod(sh) for n, sh in m.st.params if m.st.unit_of(n) in m.layer_names), default=0)
    layer = (
        m.gather_peak(m.layer_names[0]) - m.gathered[m.layer_names[0]] + biggest + RESIDUAL_WEIGHT_COPIES * widest * 8
    )
    vocab = max((sh[0] for n, sh in m.st.params if len(sh) == 2 and m.st.unit_of(n) not in m.layer_names), default=0)
    head = m.gather_peak("lm_head") if "lm_head" in m.gathered else 0
    probe = m.gather_peak("<root>") + head + 2 * biggest + PROBE_LOGIT_COPIES * 4 * PROBE_TOKENS * vocab
    return max(layer, probe)


def _phase_max(phases: dict[str, int]) -> tuple[str, int]:
    name = max(phases, key=lambda k: phases[k])
    return name, phases[name]


def _rank_plan(m: _Model, rank: int) -> RankPlan:
    s, st = m.s, m.st
    world, e, seq, hidden = s.world_size, m.e, s.seq_len, st.hidden_size
    on_gpu = s.device != "cpu"
    shards, read = m.shards, m.read(rank)
    mine = rank_batch_indices(len(m.rows), rank, world)
    my_rows = [m.rows[b] for b in mine]
    biggest = max(my_rows, default=0)
    # the batches the SQNR sequences touch (every sequence counted as seq real tokens), each counted whole
    sampled = leading_rows_of([[seq] * r for r in m.rows], s.options.sqnr_tokens)
    sqnr_rows = [m.rows[b] for b in mine if b in sampled]
    hidden_cache = sum(r * seq * hidden * e for r in my_rows)
    rotary = sum(2 * r * seq * st.head_dim * e for r in my_rows)
    has_reference = m.changes_weights or (not m.activations and m.propagate == "qdq")
    reference = sum(r * seq * hidden * e for r in sqnr_rows) if has_reference else 0
    # the full-precision stream beside the propagated one: its inputs and (computed first) its outputs
    reference += 2 * hidden_cache if m.reference_stream else 0
    sqnr = max(sqnr_rows, default=0) * seq * hidden * SQNR_BYTES
    # where things live: on a GPU, shards stay on the host with --cpu-offload, the cache with offload_activations
    shards_dev, shards_host = (0, shards) if (on_gpu and s.cpu_offload) else (shards, 0)
    cache_on_host = on_gpu and s.offload_activations
    batch_copies = biggest * seq * (2 * hidden + 2 * st.head_dim) * e if cache_on_host else 0

    def split(dev: int, cache: int) -> tuple[int, int]:
        return (dev + batch_copies, cache) if cache_on_host else (dev + cache, 0)

    phases: dict[str, tuple[int, int]] = {"load": (shards_dev, shards_host + read)}
    root_dev = m.gathered["<root>"] if s.shard_root else 0
    embed_batch = biggest * seq * (hidden * e + 12 * st.head_dim)
    embed = max(m.gather_peak("<root>") if s.shard_root else 0, root_dev + embed_batch)
    phases["embed"] = (
        shards_dev + embed + (0 if cache_on_host else hidden_cache + rotary),
        shards_host + (hidden_cache + rotary if cache_on_host else 0),
    )
    if m.residual:
        phases["rotate"] = (shards_dev + _residual_rotation_bytes(m), shards_host)
    layer_peaks: list[tuple[int, int]] = []
    algo_peak, layer_fwd, wobs = 0, 0, 0
    for i in m.last_of_kind:
        unit = m.layer_names[i]
        base = shards_dev + m.quantizer_upto[i] + m.gathered[unit]
        algo = m.algorithm_state(i, rank, my_rows)
        fwd, fwd_q = m.forward(i, biggest, False), m.forward(i, biggest, True)
        one = hidden_cache + rotary + reference
        two = one + hidden_cache
        steps = [
            split(base + m.gather_peak(unit) - m.gathered[unit], hidden_cache + rotary),
            split(base + algo.collect + fwd, one),
            split(base + max(algo.merge, algo.solve), one),
            split(base + algo.held + m.weight_observer(i), one),
            split(base + m.observers(i) + fwd, two),
            split(base + fwd_q, two),  # the SQNR forward (quantizers on) and the qdq propagation
            split(base, two + sqnr),  # the SQNR sums, where the cache is
        ]
        layer_peaks.append((max(d for d, _ in steps), max(h for _, h in steps)))
        algo_peak, layer_fwd, wobs = max(algo_peak, algo.peak), max(layer_fwd, fwd_q), max(wobs, m.weight_observer(i))
    phases["layers"] = (max(d for d, _ in layer_peaks), shards_host + max(h for _, h in layer_peaks))
    export_peak, encode_peak, host_copy = 0, 0, 0
    for index, unit in enumerate(m.export_units):
        owned = m.owner(index, unit) == rank
        enc = m.encoded[unit] if owned else 0
        export_peak = max(export_peak, m.gather_peak(unit) if unit != "<root>" or s.shard_root else 0,
                          m.gathered[unit] + enc)  # fmt: skip
        encode_peak = max(encode_peak, enc)
        if owned and on_gpu:  # each tensor is copied to the host to be written
            host_copy = max(host_copy, max((p.nbytes for p in m.by_unit.get(unit, [])), default=0))
    phases["export"] = (shards_dev + m.quantizer_upto[-1] + export_peak, shards_host + host_copy)
    runtime = RUNTIME_BASE_BYTES + RUNTIME_PER_LAYER_BYTES * st.num_layers
    largest = max(m.export_units, key=lambda u: m.gathered[u])
    parts = {
        "param_shards": shards,
        "largest_gathered_unit": m.gathered[largest],
        "activation_cache": 2 * hidden_cache + rotary + reference,
        "layer_intermediates": layer_fwd + sqnr,
        "quantizer_state": m.quantizer_upto[-1] + max(m.observers(i) for i in range(st.num_layers)),
        "weight_observer": wobs,
        "algorithm_state": algo_peak,
        "export_buffers": encode_peak,
        "checkpoint_pages": read,
        "runtime": runtime,
    }
    if on_gpu:
        device = {k: d for k, (d, _) in phases.items()}
        host = {k: h + runtime for k, (_, h) in phases.items()}
        host_required = max(v - (read if k == "load" else 0) for k, v in host.items())
        phase, peak = _phase_max(device)
        return RankPlan(rank, parts, largest, device, host, peak, phase, max(host.values()), peak, host_required, read)
    total = {k: d + h + runtime for k, (d, h) in phases.items()}
    phase, peak = _phase_max(total)
    required = max(v - (read if k == "load" else 0) for k, v in total.items())
    return RankPlan(rank, parts, largest, total, {}, peak, phase, peak, required, required, read)


# ------------------------------------------------------------------------------------ traffic and disk


def _allreduce_bytes(m: _Model, i: int) -> int:
    """Bytes all-reduced while layer ``i`` is calibrated: observer statistics and the algorithm's merged sums."""
    algo = m.algorithm_state(i, 0, m.rows[:1])
    return m.observers(i) + (algo.merge // 2 if m.s.world_size > 1 else algo.merge)


def traffic(m: _Model) -> dict[str, int]:
    """Collective volume per rank: all-gathers (a ring: each rank sends ``(N - 1) / N`` of a unit) and the
    statistics' all-reduces (``2 (N - 1) / N`` of the buffer)."""
    world = m.s.world_size
    share = lambda n: n * (world - 1) // world
    layer = max((m.gathered[u] for u in m.layer_names), default=0)
    calibrate_units = m.layer_names + (["<root>"] if m.s.shard_root else [])
    sent = sum(share(m.gathered[u]) for u in calibrate_units) + sum(share(m.gathered[u]) for u in m.export_units)
    reduce = max((_allreduce_bytes(m, i) for i in range(m.st.num_layers)), default=0)
    return {
        "allgather_bytes_per_layer": layer,
        "allgather_sent_per_layer_per_rank": share(layer),
        "allgather_sent_total_per_rank": sent,
        "allreduce_bytes_per_layer": reduce,
        "allreduce_sent_per_layer_per_rank": 2 * share(reduce),
    }


def export_entries(
    m: PreparedModel, export_format: ExportFormat | str | None = None
) -> dict[str, list[tuple[Entry, int]]]:
    """Per export unit (in the order every rank writes them), the tensors it stores in ``export_format`` (default
    compressed-tensors) and their sizes: a quantized Linear's weight becomes the tensors the format says, its input
    rotation's included (:func:`~shardcal.export.format.module_sizes`, which the export plan asks too), every other
    parameter is stored as it is."""
    fmt = get_format(export_format)
    quantized = {t.linear.name: t for t in m.targets if t.weight is not None}
    out: dict[str, list[tuple[Entry, int]]] = {u: [] for u in m.export_units}
    own_units = set(m.export_units[:-1])
    # one recipe: by shape and input rotation
    layouts: dict[tuple[int, int, int | None], list[tuple[str, torch.dtype, tuple[int, ...], int]]] = {}
    for p in m.params:
        unit = p.unit if p.unit in own_units else "<root>"
        module, _, leaf = p.name.rpartition(".")
        t = quantized.get(module)
        if t is not None and leaf == "weight":
            key = (t.linear.out_features, t.linear.in_features, t.rotation)
            if key not in layouts:
                spec_in = t.input.spec if t.input is not None else None
                stored = fmt.module_format(t.weight.spec, spec_in)
                sizes = module_sizes(fmt, stored, t.weight.spec, spec_in, *key)
                layouts[key] = [(k, dt, shape, n) for k, (dt, shape, n) in sizes.items()]
            out[unit] += [
                (Entry(f"{module}.{k}", dt, shape, ("quant", module, k)), n) for k, dt, shape, n in layouts[key]
            ]
        else:
            out[unit].append((Entry(p.name, p.dtype, p.shape, ("param", p.name)), p.nbytes))
    if m.recipe.kv_cache is not None:  # each decoder layer's quantized attention: its KV-cache scales
        layers = m.st.model.get_submodule(m.st.layer_prefix)
        for layer, prefix in zip(layers, m.layer_names):
            for name, _ in kv_cache_attentions(layer, prefix, m.recipe.matches):
                out[prefix] += [(e, e.nbytes) for e in kv_cache_entries(name)]
    return out


def export_files(
    m: _Model, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, export_format: ExportFormat | str | None = None
) -> list[tuple[str, int]]:
    """``(file name, size in bytes)`` of every shard the export writes in ``export_format`` (default
    compressed-tensors), split as ``export.plan.build_plan`` splits."""
    per_rank: list[list[list[tuple[Entry, int]]]] = [[] for _ in range(m.s.world_size)]
    units = m.unit_entries() if export_format is None else export_entries(m.prepared, export_format)
    for r in range(m.s.world_size):
        current: list[tuple[Entry, int]] = []
        size = 0
        for index, unit in enumerate(m.export_units):
            if m.owner(index, unit) != r:
                continue
            for e, n in units[unit]:
                if current and size + n > max_shard_bytes:
                    per_rank[r].append(current)
                    current, size = [], 0
                current.append((e, n))
                size += n
        if current:
            per_rank[r].append(current)
    shards = [entries for files in per_rank for entries in files]
    return [
        (SHARD_NAME.format(index=i + 1, total=len(shards)), len(header_bytes([e for e, _ in f])) + sum(n for _, n in f))
        for i, f in enumerate(shards)
    ]


def checkpoint_dir_bytes(m: _Model) -> int:
    """The most a ``--checkpoint-dir`` holds: a commit's files beside the previous commit's (deleted after), their
    metadata included (:data:`CHECKPOINT_ENTRY_BYTES`)."""
    world, layers = m.s.world_size, m.st.num_layers
    seq, hidden, e = m.s.seq_len, m.st.hidden_size, m.e
    acts = sum(m.rows[b] * seq * hidden * e for b in range(len(m.rows)))
    weights_upto, entries_upto = [0], [0]
    for i, unit in enumerate(m.layer_names):  # the ranks' own rows of each layer together: the whole layer
        groups = m.unit_groups.get(unit, {})
        weights_upto.append(weights_upto[-1] + sum(n * rows * row * size for (rows, row, size, _), n in groups.items()))
        quantizers = sum(q is not None for t in m.targets_of[i] for q in (t.weight, t.input, t.output))
        entries_upto.append(entries_upto[-1] + quantizers + (sum(groups.values()) if m.changes_weights else 0))
    every = m.s.options.checkpoint_every
    commits = [k for k in range(1, layers) if k % every == 0] + [layers]

    def files(k: int) -> int:
        return (
            (acts if k < layers else 0)
            + (weights_upto[k] if m.changes_weights else 0)
            + m.quantizer_upto[k - 1]
            + CHECKPOINT_ENTRY_BYTES * entries_upto[k]
            + 4096 * world
        )

    sizes = [files(k) for k in commits]
    return max([sizes[0]] + [a + b for a, b in itertools.pairwise(sizes)])


# ------------------------------------------------------------------------------------ planning


def plan_prepared(prepared: PreparedModel, settings: PlanSettings, model_dir: str | Path | None = None,
                  full: bool = True) -> CalibrationPlan:  # fmt: skip
    """The plan of a :class:`PreparedModel` for ``settings`` (``full=False``: no disk figures, which need every
    stored tensor's header)."""
    if settings.shard_root != prepared.shard_root:
        raise UsageError("settings.shard_root differs from the prepared model's")
    m = _Model(prepared, settings)
    ranks = [_rank_plan(m, r) for r in range(settings.world_size)]
    st = prepared.st
    model = {
        "dir": str(model_dir) if model_dir is not None else None,
        "model_type": st.model_type,
        "layers": st.num_layers,
        "parameters": prepared.numel,
        "parameter_bytes": prepared.nbytes,
        "dtype": str(prepared.dtype).removeprefix("torch."),
    }
    io = traffic(m)
    disk: dict[str, int] = {}
    if full:
        files = export_files(m)
        disk = {
            "export_bytes": sum(size for _, size in files),
            "export_files": len(files),
            "checkpoint_dir_bytes": checkpoint_dir_bytes(m),
        }
    return CalibrationPlan(
        model, prepared.recipe.name, prepared.algorithm.get("name", "rtn"), settings, ranks, io, disk
    )


def plan_source(source: ModelSource, recipe: str | Path | Recipe, settings: PlanSettings | None = None,
                model_dir: str | Path | None = None, dtype: torch.dtype | str | None = None) -> CalibrationPlan:  # fmt: skip
    """The plan for an already read :class:`ModelSource` (see :func:`plan_calibration`)."""
    settings = settings or PlanSettings()
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    plan = plan_prepared(PreparedModel(source, recipe, settings.shard_root, dtype), settings, model_dir)
    plan.model["checkpoint_bytes"] = source.checkpoint_bytes
    plan.model["source"] = "config.json" if source.file_dtypes is None else "config.json + safetensors headers"
    return plan


def plan_calibration(model_dir: str | Path, recipe: str | Path | Recipe, settings: PlanSettings | None = None,
                     dtype: torch.dtype | str | None = None, impl: str = "auto") -> CalibrationPlan:  # fmt: skip
    """Predict what ``shardcal calibrate MODEL_DIR --recipe RECIPE`` holds on each rank, reading only
    ``config.json`` and the safetensors headers (or only ``config.json`` when there are no weights).

    Bad input raises what ``calibrate`` raises (:class:`~shardcal.errors.ConfigError`, ``CheckpointError``,
    ``RecipeError``), before anything is loaded. ``settings`` (:class:`PlanSettings`): ranks, data, device;
    ``impl``: the model class, as ``--model-impl`` chooses it (``auto``: shardcal's when it has one, else
    transformers').
    """
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    return plan_source(read_source(model_dir, dtype, impl), recipe, settings, model_dir, dtype)


# ------------------------------------------------------------------------------------ will it fit?


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
        if more > 4096:
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


def fmt_bytes(n: float) -> str:
    """``n`` bytes as a short human figure (binary units: KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def refusal_message(plan: CalibrationPlan, short: Shortfall, fix: str | None) -> str:
    """The one line ``calibrate`` stops with."""
    part = max(plan.peak_rank.parts.items(), key=lambda kv: kv[1] if kv[0] != "checkpoint_pages" else -1)
    remedy = f"cheapest fix: {fix}" if fix else f"no option fits (largest part: {part[0]} {fmt_bytes(part[1])})"
    return (
        f"not enough memory: predicted {fmt_bytes(short.need)} ({short.detail}) but {fmt_bytes(short.available)} "
        f"{short.where}; {remedy}; --force runs anyway"
    )


# ------------------------------------------------------------------------------------ the table


_PART_LABELS = {
    "param_shards": "parameter shards",
    "largest_gathered_unit": "largest gathered unit",
    "activation_cache": "activation cache (inputs + outputs)",
    "layer_intermediates": "one batch's intermediates",
    "quantizer_state": "quantizer / observer state",
    "weight_observer": "weight-scale calibration",
    "algorithm_state": "algorithm state",
    "export_buffers": "export buffers",
    "checkpoint_pages": "checkpoint pages while loading",
    "runtime": "runtime allowance",
}


def growth_line(plan: CalibrationPlan, baseline: int | None) -> str:
    """What the PEAK row means, in MiB: the predicted growth over a rank's size after imports, and the process peak
    that makes with ``baseline`` (bytes; the resident size after imports, measured by the caller; None: unknown) —
    the two figures ``shardcal calibrate`` reports as measured."""
    growth = plan.peak_bytes_per_rank / 2**20
    where = "device" if plan.settings.device != "cpu" else "host"
    line = f"predicted growth per rank {growth:.1f} MiB ({where} memory over the process's size after imports)"
    if baseline is None or plan.settings.device != "cpu":
        return line
    base = baseline / 2**20
    return line + f"; process peak ≈ {growth:.1f} + baseline {base:.1f} = {growth + base:.1f} MiB"


def format_plan(plan: CalibrationPlan, max_ranks: int = 4, baseline: int | None = None) -> str:
    """The human-readable plan ``shardcal plan`` prints: parts and phases per rank, traffic, disk, time.
    ``baseline``: the resident size after imports (bytes) that :func:`growth_line` adds to the PEAK."""
    s = plan.settings
    shown = plan.ranks if len(plan.ranks) <= max_ranks else [plan.ranks[0], plan.peak_rank]
    shown = list({r.rank: r for r in shown}.values())
    m = plan.model
    lines = [
        f"{m['model_type']}, {m['layers']} layers, {m['parameters'] / 1e9:.3g}B parameters "
        f"({fmt_bytes(m['parameter_bytes'])} in {m['dtype']}; from {m['source']})",
        f"recipe {plan.recipe} (algorithm {plan.algorithm}); {s.world_size} rank(s) on {s.device}"
        f"{' with --cpu-offload' if s.cpu_offload else ''}; {s.num_samples} x {s.seq_len} tokens, batch "
        f"{s.options.batch_size}; activation cache in {'host' if s.offload_activations or s.device == 'cpu' else 'device'} memory",
        "",
    ]
    head = f"{'per rank':38}" + "".join(f"{'rank ' + str(r.rank):>13}" for r in shown)
    lines.append(head)
    for key, label in _PART_LABELS.items():
        lines.append(f"  {label:36}" + "".join(f"{fmt_bytes(r.parts[key]):>13}" for r in shown))
    where = "device" if s.device != "cpu" else "host"
    for phase in [p for p in ("load", "rotate", "embed", "layers", "export") if p in shown[0].phases]:
        lines.append(
            f"  {where + ' peak while ' + phase:36}" + "".join(f"{fmt_bytes(r.phases[phase]):>13}" for r in shown)
        )
    lines.append(f"{'PEAK':38}" + "".join(f"{fmt_bytes(r.peak):>13}" for r in shown))
    if s.device != "cpu":
        lines.append(f"{'host peak (activations, pages)':38}" + "".join(f"{fmt_bytes(r.host_peak):>13}" for r in shown))
    lines.append(f"{'bytes read from disk':38}" + "".join(f"{fmt_bytes(r.bytes_read):>13}" for r in shown))
    io, disk = plan.io, plan.disk
    lines += [
        growth_line(plan, baseline),
        "",
        f"all-gather per layer: {fmt_bytes(io['allgather_bytes_per_layer'])} gathered, "
        f"{fmt_bytes(io['allgather_sent_per_layer_per_rank'])} sent by each rank "
        f"({fmt_bytes(io['allgather_sent_total_per_rank'])} over the run)",
        f"all-reduce per layer: {fmt_bytes(io['allreduce_bytes_per_layer'])} of statistics",
        f"disk: export {fmt_bytes(disk['export_bytes'])} in {disk['export_files']} file(s); "
        f"--checkpoint-dir needs up to {fmt_bytes(disk['checkpoint_dir_bytes'])}",
    ]
    if len(plan.ranks) > len(shown):
        lines.append(f"(ranks shown: the first and the peak of {len(plan.ranks)})")
    if plan.time is not None:
        t = plan.time
        lines.append(
            f"time: about {t['calibrate_seconds']:.0f} s to calibrate ({t['layer_seconds']:.2f} s per layer: "
            f"{t['fixed_seconds']:.2f} s + {t['batch_seconds']:.3f} s x {t['batches_per_rank']} batch(es) per rank; "
            f"{t['cpu_seconds_per_rank']:.0f} CPU-seconds per rank; probed on {t['probe_device']}, "
            f"{t['probe_threads']} thread(s))"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ before calibrate loads


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, what: str = "size") -> int:
    """``"80GB"``, ``"80 GiB"``, ``"81920MiB"``, ``"8e10"`` -> bytes; :class:`UsageError` naming ``what`` otherwise."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in _UNITS:
        raise UsageError(f"{what} {text!r} is not a size (e.g. 80GB, 80GiB, 81920MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def plannable(model_dir: str | Path, impl: str = "auto") -> bool:
    """Whether the planner can plan ``model_dir``'s model with ``impl`` (``--model-impl``): shardcal's classes
    always; a model type only transformers has, when transformers can build it (on the meta device)."""
    try:
        check_plannable(model_dir, impl)
    except (ConfigError, PlanError):
        return False
    return True


def check_plannable(model_dir: str | Path, impl: str = "auto") -> None:
    """Raise :class:`~shardcal.errors.ConfigError` (one line) when the model cannot be built for planning: its
    config unreadable, or a type shardcal has no class for without transformers to build it."""
    if choose_impl(model_dir, impl) == "transformers":
        build_transformers_on_meta(model_dir)
    else:
        load_config(model_dir)


def check_before_loading(
    model_dir: str | Path,
    recipe: Recipe,
    data_shape: tuple[int, int],
    options: CalibrationOptions,
    *,
    cpu_offload: bool = False,
    shard_root: bool = True,
    impl: str = "auto",
) -> CalibrationPlan:
    """Plan this rank's calibration and stop every rank before anything is loaded when it does not fit.

    Collective (every rank calls it; one small all-gather decides). Each rank checks its own device's free memory
    and its node's host memory for the node's ranks together (``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun
    and ``--nproc-per-node`` place them). Raises :class:`~shardcal.errors.InsufficientMemoryError` with one line:
    the predicted and available bytes and the cheapest fix. Returns the plan when it fits.
    """
    import os

    from ..errors import InsufficientMemoryError
    from ..runtime.distributed import broadcast_string, ranks_with_flag, world

    rank, size = world()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local = min(max(1, int(os.environ.get("LOCAL_WORLD_SIZE", size))), size)
    node_first = rank - min(int(os.environ.get("LOCAL_RANK", rank % local)), rank)
    settings = PlanSettings(
        world_size=size, local_world_size=local, num_samples=int(data_shape[0]), seq_len=int(data_shape[1]),
        device=device, cpu_offload=cpu_offload, shard_root=shard_root, options=options,
    )  # fmt: skip
    source = read_source(model_dir, impl=impl)
    plan = plan_source(source, recipe, settings, model_dir)
    budget = local_budget(device)
    short = shortfall(plan, budget, rank=rank, node_first=min(node_first, max(0, size - local)))
    refused = ranks_with_flag(short is not None)
    if refused:
        message = ""
        if short is not None and rank == refused[0]:
            message = refusal_message(plan, short, cheapest_fix(source, recipe, settings, budget))
        raise InsufficientMemoryError(broadcast_string(message, src=refused[0]))
    return plan
