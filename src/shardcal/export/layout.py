"""The export layout (its :class:`ExportPlan`): what every tensor of the checkpoint is, who writes it, and in which shard file — computed on
every rank from the module structure alone (names, global shapes, specs), before anything is gathered.

Because the plan is known up front, every rank knows every shard's exact safetensors header (names, dtypes,
shapes, offsets) and the final ``model-0000i-of-0000N`` names before writing a byte: a rank streams its tensors
straight into its own files, one gathered unit at a time, and nothing is renamed afterwards.

Units, in the order every rank gathers them (gathering is collective):

1. each decoder layer ``i`` (one ``layer_unsharded`` gather; nested FSDP units inside it gathered with it), written
   by rank ``i % world_size``;
2. other FSDP2 units outside the decoder stack (an untied ``lm_head``, a vision tower), continuing the round robin;
3. the root: every remaining parameter (embeddings, final norm, a tied or unwrapped ``lm_head``), gathered with
   ``fsdp2_root_unsharded`` and written by rank 0.

A quantized Linear's ``weight`` becomes the tensors its export format says (``ExportFormat.module_tensors``,
:mod:`.format`; compressed-tensors by default); every other parameter is stored as it is, in its dtype, under its own
(Hugging Face) name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..calib.recipes import Recipe
from ..errors import ExportError
from ..quant.experts import (
    PROJECTIONS,
    ExpertsLayout,
    fused_experts_layout,
    fused_experts_shape,
    iter_projections,
    shared_input_quantizer,
    weight_slice,
)
from ..quant.fused import ROLES, fused_layer, mixed_schemes, unshared_ranges
from ..quant.kv_cache import KVCacheQuantizer, kv_cache_quantizers
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import QuantizerSpec
from ..sharding.fsdp2 import persistent_buffers
from ..sharding.registry import LayerActivationCollector, decoder_layer_prefix
from .format import ExportFormat, get_format, module_sizes

SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"


@dataclass(kw_only=True)
class QuantModule:
    """A Linear exported quantized: an ``nn.Linear``, or one projection of one expert of fused experts.

    ``weight()`` gives the full ``[out_features, in_features]`` weight while its unit is gathered.
    ``weight_quantizer`` is None when the weight is quantized at export time from ``spec_weight`` (a
    recipe-targeted plain Linear, weight-only / dynamic-input recipe). ``format``: how the export format stores
    it (``ExportFormat.module_format``: compressed-tensors' ``int-quantized``, ...).
    """

    name: str
    weight: Callable[[], torch.Tensor]
    out_features: int
    in_features: int
    spec_weight: QuantizerSpec
    spec_input: QuantizerSpec | None
    format: str
    weight_quantizer: TensorQuantizer | None
    input_quantizer: TensorQuantizer | None
    #: The Hadamard block rotating the module's inputs (its weight holds ``W H``), or None.
    input_rotation: int | None = None

    @property
    def scheme_key(self) -> tuple[Any, ...]:
        return (self.spec_weight, self.spec_input, self.format)


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
    ``fsdp2_root_unsharded``) and the entries written from it by ``owner``."""

    index: int
    name: str
    kind: str  # "layer" | "module" | "root"
    module: nn.Module | None
    owner: int
    entries: list[Entry] = field(default_factory=list)


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


# ----------------------------------------------------------------------------------------------- quantized modules


def _check_spec(name: str, spec: QuantizerSpec, role: str, fmt: ExportFormat) -> None:
    try:
        fmt.check_spec(spec, role)
    except ValueError as exc:
        raise ExportError(f"module {name!r}: its {role} quantizer cannot be stored as {fmt.name} ({exc})") from None


def find_quant_modules(
    model: nn.Module,
    recipe: Recipe | None,
    export_format: ExportFormat | None = None,
    *,
    prefix: str = "",
    structure_only: bool = False,
) -> dict[str, QuantModule]:
    """Every Linear to store quantized, checked for what ``export_format`` (default compressed-tensors) can express
    and for calibration.

    A ``QuantLinear`` with a weight quantizer is exported as calibrated; so is each projection of fused experts
    with attached quantizers (named ``<experts>.<e>.<gate_proj|up_proj|down_proj>``, as the original per-expert
    Linears). With ``recipe``, a plain Linear (or fused projection) the recipe targets is quantized at export (only
    for recipes that need no calibration data: weight-only or dynamic input), and every quantized module must
    match the recipe. ``prefix``: ``model``'s name in the whole model (one decoder layer's ``"model.layers.3"``);
    ``structure_only``: the quantizers need not be calibrated yet (planning a streamed export before the run).
    """
    fmt = get_format(export_format)
    found: dict[str, QuantModule] = {}
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, nn.Linear):
            candidates = [(name, lambda m=module: m.weight, module.out_features, module.in_features, module)]
        elif (shape := fused_experts_shape(module, name, strict=False)) is not None:
            candidates = _fused_candidates(name, module, shape)
        else:
            continue
        for full_name, weight, out_f, in_f, holder in candidates:
            qm = _quant_module(full_name, weight, out_f, in_f, holder, recipe, fmt, structure_only)
            if qm is not None:
                found[full_name] = qm
    return found


def _fused_candidates(name: str, module: nn.Module, shape: tuple[int, int, int]) -> list[tuple]:
    """``(name, weight getter, out, in, quantizer holder or None)`` per expert and projection of fused experts."""
    experts, hidden, inter = shape
    shared = {p: shared_input_quantizer(module, p) for p in PROJECTIONS}  # experts share input scales, as in vLLM
    holders = {
        (e, p): _ExportQuantizers(q.weight_quantizer, shared[p] if q.input_quantizer is not None else None)
        for e, p, q in iter_projections(module)
    }
    sizes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return [
        (f"{name}.{e}.{p}", lambda e=e, p=p: weight_slice(module, e, p), *sizes[p], holders.get((e, p)))
        for e in range(experts)
        for p in PROJECTIONS
    ]


@dataclass
class _ExportQuantizers:
    """What one fused expert projection is exported with: its weight quantizer and the block's shared input one."""

    weight_quantizer: TensorQuantizer | None
    input_quantizer: TensorQuantizer | None


def _quant_module(
    name: str,
    weight: Callable[[], torch.Tensor],
    out_f: int,
    in_f: int,
    holder: Any,
    recipe: Recipe | None,
    fmt: ExportFormat,
    structure_only: bool = False,
) -> QuantModule | None:
    """The export record of one Linear-like module (``holder`` carries its quantizers), or None if unquantized."""
    wq = getattr(holder, "weight_quantizer", None)
    iq = getattr(holder, "input_quantizer", None)
    oq = getattr(holder, "output_quantizer", None)
    if wq is None and iq is None and oq is None:
        if recipe is None or not recipe.matches(name) or recipe.fallback is not None:
            return None  # with a [fallback], calibration decided: a plain Linear there stays in full precision
        if recipe.weight is None:
            raise ExportError(
                f"recipe {recipe.name!r} quantizes no weights; {fmt.name} export needs a [weight] quantizer"
            )
        if recipe.rotation_block(name, in_f) is not None:
            raise ExportError(
                f"module {name!r} is not calibrated and recipe {recipe.name!r} rotates its inputs ([rotation]): run "
                "shardcal.calibrate(model, data, recipe) before exporting"
            )
        weight_spec = recipe.weight_spec(name, in_f)
        if recipe.output is not None or (recipe.input is not None and not recipe.input.dynamic):
            raise ExportError(
                f"module {name!r} is not calibrated and recipe {recipe.name!r} has static activation quantizers: "
                "run shardcal.calibrate(model, data, recipe) before exporting"
            )
        _check_spec(name, weight_spec, "weight", fmt)
        if recipe.input is not None:
            _check_spec(name, recipe.input, "input", fmt)
        stored = fmt.module_format(weight_spec, recipe.input)
        return QuantModule(
            name=name,
            weight=weight,
            out_features=out_f,
            in_features=in_f,
            spec_weight=weight_spec,
            spec_input=recipe.input,
            format=stored,
            weight_quantizer=None,
            input_quantizer=None,
        )
    if oq is not None:
        raise ExportError(
            f"module {name!r} has an output quantizer; {fmt.name} export supports weights and inputs only"
        )
    if wq is None:
        raise ExportError(
            f"module {name!r} quantizes its input but not its weight; {fmt.name} export needs weight quantization"
        )
    if recipe is not None:
        if not recipe.matches(name):
            raise ExportError(f"module {name!r} is quantized, but recipe {recipe.name!r} does not target it")
        used = (wq.spec, iq.spec if iq is not None else None)
        allowed = [r for r in (recipe, recipe.fallback) if r is not None and r.quantizes_linears]
        if all((r.weight_spec(name, in_f), r.input) != used for r in allowed):
            raise ExportError(f"module {name!r} was quantized with other settings than recipe {recipe.name!r}")
    _check_spec(name, wq.spec, "weight", fmt)
    if iq is not None:
        _check_spec(name, iq.spec, "input", fmt)
    for q in (wq, iq):
        if q is not None and not q.calibrated and not structure_only:
            raise ExportError(f"{q.name}: not calibrated; run shardcal.calibrate(model, data, recipe) before exporting")
    stored = fmt.module_format(wq.spec, iq.spec if iq is not None else None)
    rotation = getattr(holder, "input_rotation", None)
    return QuantModule(
        name=name,
        weight=weight,
        out_features=out_f,
        in_features=in_f,
        spec_weight=wq.spec,
        spec_input=iq.spec if iq is not None else None,
        format=stored,
        weight_quantizer=wq,
        input_quantizer=iq,
        input_rotation=rotation,
    )


def check_fused_layers(model: nn.Module, quant: dict[str, QuantModule]) -> None:
    """An :class:`ExportError` where a layer vLLM fuses (:mod:`shardcal.quant.fused`: q/k/v, gate/up, an expert's
    gate/up) would not compute what these modules compute: members quantized with different schemes or rotations, or
    some quantized and some not (vLLM loads one scheme per fused layer, and refuses a partly ignored one); or members
    whose calibrated ranges vLLM takes as one (nvfp4 global scales, fp8 per-tensor weight scales, static input
    scales) but which differ. ``shardcal.calibrate`` shares those ranges itself (docs/reference/vllm-conventions.md)."""
    schemes: dict[str, Any] = {n: None for n, m in model.named_modules() if _linear_like(m)}
    for name, module in model.named_modules():
        if (shape := fused_experts_shape(module, name, strict=False)) is not None:
            schemes.update({f"{name}.{e}.{p}": None for e in range(shape[0]) for p in PROJECTIONS})
    schemes.update({n: (*qm.scheme_key, qm.input_rotation) for n, qm in quant.items()})
    for group in mixed_schemes(schemes):
        described = ", ".join(f"{n} ({scheme_words(quant.get(n))})" for n in group)
        raise ExportError(
            f"{described}: vLLM loads these Linears as one fused layer ({fused_layer(group[0])}) with one scheme; "
            "quantize them alike (the recipe's [targets] should select all of them or none)"
        )
    for role in ROLES:
        quantizers = {n: getattr(qm, f"{role}_quantizer") for n, qm in quant.items()}
        for group in unshared_ranges(quantizers, role):
            values = ", ".join(f"{n} {float(quantizers[n].amax.max()):.6g}" for n in group)
            raise ExportError(
                f"{fused_layer(group[0])}: vLLM computes this fused layer with one {role} range, but its members' "
                f"calibrated amax differ ({values}); calibrate with shardcal.calibrate, or call "
                f"shardcal.quant.fused.share_fused_ranges(model, role={role!r}) before exporting"
            )


def scheme_words(qm: QuantModule | None) -> str:
    if qm is None:
        return "not quantized"
    words = qm.spec_weight.describe() + (f", input {qm.spec_input.describe()}" if qm.spec_input is not None else "")
    return words + (f", rotated in blocks of {qm.input_rotation}" if qm.input_rotation is not None else "")


def _linear_like(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a module another implementation may load as one (a router holding a 2-D ``weight``):
    such modules go into ``ignore`` when they are not quantized, so that no loader quantizes them."""
    if isinstance(module, nn.Linear):
        return True
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)


def find_kv_cache(
    model: nn.Module,
    recipe: Recipe | None,
    export_format: ExportFormat | None = None,
    *,
    prefix: str = "",
    structure_only: bool = False,
) -> dict[str, KVCacheQuantizer]:
    """Attention name -> its calibrated KV-cache quantizer; checked against ``recipe`` (its ``[kv_cache]``) and
    against what ``export_format`` (default compressed-tensors) can store. ``prefix`` / ``structure_only``: as
    :func:`find_quant_modules`."""
    fmt = get_format(export_format)
    found = dict(kv_cache_quantizers(model, prefix))
    if recipe is not None and recipe.kv_cache is not None and not found:
        raise ExportError(
            f"recipe {recipe.name!r} has [kv_cache], but no attention holds calibrated KV-cache quantizers: "
            "run shardcal.calibrate(model, data, recipe) before exporting"
        )
    for name, kv in found.items():
        if recipe is not None and recipe.kv_cache != kv.spec:
            raise ExportError(
                f"{name}: its KV-cache quantizer was calibrated with other settings than recipe {recipe.name!r}"
            )
        _check_spec(name, kv.spec, "kv_cache", fmt)
        for q in (kv.k_quantizer, kv.v_quantizer):
            if not q.calibrated and not structure_only:
                raise ExportError(
                    f"{q.name}: not calibrated; run shardcal.calibrate(model, data, recipe) before exporting"
                )
    specs = {kv.spec for kv in found.values()}
    if len(specs) > 1:
        raise ExportError(f"the attention layers' KV-cache quantizers differ; {fmt.name} has one kv_cache_scheme")
    return found


def build_quantization_config(
    model: nn.Module,
    quant: dict[str, QuantModule],
    kv_cache: dict[str, KVCacheQuantizer] | None = None,
    export_format: ExportFormat | None = None,
) -> dict[str, Any]:
    """The config ``export_format`` (default compressed-tensors) writes into config.json (``quantization_config``),
    from the quantized modules grouped by scheme and ``ignore`` = every other Linear (the LM head, MoE routers,
    excluded modules)."""
    fmt = get_format(export_format)
    schemes: dict[tuple[Any, ...], list[str]] = {}
    for name, qm in quant.items():
        schemes.setdefault(qm.scheme_key, []).append(name)
    ignore = [name for name, m in model.named_modules() if _linear_like(m) and name not in quant]
    for name, module in model.named_modules():  # unquantized projections of fused experts, by their export names
        if (shape := fused_experts_shape(module, name, strict=False)) is not None:
            ignore += [
                f"{name}.{e}.{p}" for e in range(shape[0]) for p in PROJECTIONS if f"{name}.{e}.{p}" not in quant
            ]
    kv_spec = next(iter(kv_cache.values())).spec if kv_cache else None
    rotations = {name: qm.input_rotation for name, qm in quant.items() if qm.input_rotation is not None}
    return fmt.config(schemes, ignore, kv_spec, rotations)


# ----------------------------------------------------------------------------------------------- units and shards


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


def unit_owner(index: int, kind: str, world_size: int) -> int:
    """The rank that writes unit ``index`` of the export (``kind``: ``"layer"``, ``"module"`` or ``"root"``): rank 0
    the root, the others round robin (``index % world_size``)."""
    return 0 if kind == "root" else index % world_size


def split_into_shards(units: list[Unit], world_size: int, max_shard_bytes: int) -> list[Shard]:
    """The shard files of ``units`` (in the order every rank gathers them): each rank's own units' entries, in
    order, cut into files of at most ``max_shard_bytes`` (a larger tensor alone in its file), numbered rank by rank."""
    per_rank: list[list[list[Entry]]] = [[] for _ in range(world_size)]
    for r in range(world_size):
        current: list[Entry] = []
        size = 0
        for unit in units:
            if unit.owner != r:
                continue
            for e in unit.entries:
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
