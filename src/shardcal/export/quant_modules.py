"""What an export stores quantized: every Linear (or fused-expert projection) and KV cache whose quantizers it
writes, checked against the recipe and against what the export format can store, and the quantization config made of
them.

A quantized Linear is one :class:`QuantModule` record (its weight getter, shapes, specs, stored format and
quantizers); the layers vLLM fuses (q/k/v, gate/up) must hold one scheme and, where vLLM computes with one range,
equal ranges (:func:`check_fused_layers`). Every other Linear-like module goes into the config's ``ignore``, so that
no loader quantizes it. Where each record's tensors go (units, owners, shard files) is :mod:`.layout`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..calib.recipe import Recipe
from ..errors import ExportError
from ..quant.expert_layout import PROJECTIONS, fused_experts_shape, weight_slice
from ..quant.experts import iter_projections, shared_input_quantizer
from ..quant.fused import ROLES, fused_layer, mixed_schemes, unshared_ranges
from ..quant.kv_cache import KVCacheQuantizer, kv_cache_quantizers
from ..quant.quantizer import TensorQuantizer
from ..quant.spec import QuantizerSpec
from .format import ExportFormat, get_format


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
