"""Attaching a recipe's quantizers to a model's modules: QuantLinear for every targeted ``nn.Linear``, per-expert
quantizers for fused experts, the KV cache's, the ``[rotation]`` folded in, and which weights got a fallback group.

:mod:`.recipes` says what a recipe is (the TOML schema, parsed and checked); this module applies one to modules,
as the runner, the calibration checkpoint and the preflight check do. Whatever does not fit the recipe is a
:class:`RecipeError` naming the recipe file and the module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from ..errors import RecipeError
from ..quant.expert_layout import PROJECTIONS, fused_experts_shape
from ..quant.experts import attach_expert_quantizers, iter_projections
from ..quant.kv_cache import attach_kv_cache_quantizers
from ..quant.linear import QuantLinear, rotate_inputs
from ..quant.spec import QuantizerSpec
from .recipe import VLLM_GROUP_SIZES, Recipe

#: A per-expert projection's full name: ``(experts module).(expert index).(projection)`` — shardcal's own MoE
#: blocks (``mlp.experts.3.gate_proj``, Mixtral's ``block_sparse_moe.experts.3.w1``) and fused experts, whose
#: per-expert quantizers are named so too (:mod:`shardcal.quant.experts`).
_EXPERT_PROJECTION = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)$")


def quantize_modules(module: nn.Module, recipe: Recipe, prefix: str = "", rotate: bool = True) -> list[str]:
    """Insert ``recipe``'s quantizers into every ``nn.Linear`` under ``module`` whose full name it targets, and with
    ``rotate`` fold its ``[rotation]`` into them (else the caller does that later: :func:`rotate_modules`).

    ``prefix`` is ``module``'s own name in the model (``"model.layers.3"`` when called on one decoder layer), so
    that the recipe's patterns see full names. Modules that are already QuantLinear are left as they are.
    Returns the full names of the targeted modules. A grouped weight whose group size does not divide a Linear's
    ``in_features`` gets the size :meth:`Recipe.weight_spec` fits (or, with ``group_size_fallback = false``, a
    :class:`RecipeError`); any other shape that does not fit the recipe raises :class:`RecipeError` naming the recipe
    file and the module.
    """
    targets = [
        (name, sub)
        for name, sub in module.named_modules(prefix=prefix)
        if isinstance(sub, nn.Linear) and recipe.matches(name) and recipe.quantizes_linears
    ]
    _check_experts_share_one_weight_scheme(module, recipe, prefix, targets)
    for name, sub in targets:
        if isinstance(sub, QuantLinear):
            continue
        weight = recipe.weight_spec(name, sub.in_features)
        block = recipe.rotation_block(name, sub.in_features)
        try:
            QuantLinear.from_linear(sub, weight=weight, input=recipe.input, output=recipe.output, name=name or "<root>")
        except ValueError as exc:
            raise RecipeError(
                f"{recipe.source or recipe.name}: recipe {recipe.name!r} does not fit module {name!r}: {exc}"
            ) from None
        if block is not None and rotate:
            rotate_inputs(sub, block)  # W H folded into the weight; x H computed online
    if recipe.kv_cache is not None:
        attach_kv_cache_quantizers(module, recipe.kv_cache, prefix, recipe.matches)
    if not recipe.quantizes_linears:
        return []
    return [name for name, _ in targets] + _quantize_fused_experts(module, recipe, prefix)


def rotate_modules(module: nn.Module, recipe: Recipe, prefix: str = "") -> None:
    """Rotate the inputs of every QuantLinear under ``module`` that ``recipe``'s ``[rotation]`` selects and that
    does not rotate them yet (after ``quantize_modules(..., rotate=False)``): ``W H`` folded into its weight, ``x H``
    computed on every call."""
    for name, sub in module.named_modules(prefix=prefix):
        if isinstance(sub, QuantLinear) and sub.input_rotation is None and recipe.matches(name):
            block = recipe.rotation_block(name, sub.in_features)
            if block is not None:
                rotate_inputs(sub, block)


def _weight_group(spec: QuantizerSpec | None) -> int | str | None:
    """A weight spec's group size, or its granularity when it has no groups (``"channel"``); None: no spec."""
    if spec is None:
        return None
    return spec.group_size if spec.granularity == "group" else spec.granularity


def _check_experts_share_one_weight_scheme(
    module: nn.Module, recipe: Recipe, prefix: str, targets: list[tuple[str, nn.Module]]
) -> None:
    """A :class:`RecipeError` when the group fallback gives one experts module's projections different weight
    group sizes: transformers (``get_experts_scheme``) and vLLM's fused MoE methods load one scheme for all of a
    model's experts (one group size for w13 and w2). Checked before anything is calibrated."""
    if recipe.weight is None or not recipe.quantizes_linears:
        return
    found: dict[str, dict[str, tuple[int | str | None, int]]] = {}
    for name, sub in targets:
        m = _EXPERT_PROJECTION.match(name)
        if m is not None:
            spec = recipe.weight_spec(name, sub.in_features)
            found.setdefault(m.group(1), {})[m.group(3)] = (_weight_group(spec), sub.in_features)
    for name, sub in module.named_modules(prefix=prefix):
        shape = fused_experts_shape(sub, name, strict=False)
        if shape is None or recipe.excludes(name):
            continue
        _, hidden, inter = shape
        widths = {"gate_proj": hidden, "up_proj": hidden, "down_proj": inter}
        for proj in PROJECTIONS:
            full = f"{name}.0.{proj}"
            if recipe.matches(full):
                spec = recipe.weight_spec(full, widths[proj])
                found.setdefault(name, {})[proj] = (_weight_group(spec), widths[proj])
    for experts, projections in found.items():
        if len({group for group, _ in projections.values()}) > 1:
            raise RecipeError(_mixed_expert_schemes_message(recipe, experts, projections))


def _mixed_expert_schemes_message(
    recipe: Recipe, experts: str, projections: Mapping[str, tuple[int | str | None, int]]
) -> str:
    """Why an experts module's projections cannot get different weight group sizes, and the group size that fits."""
    parts = ", ".join(
        f"{proj} {'group ' + str(group) if isinstance(group, int) else group} of in_features {width}"
        for proj, (group, width) in projections.items()
    )
    asked = recipe.weight.group_size or 0
    fits = [s for s in VLLM_GROUP_SIZES if s <= asked and all(width % s == 0 for _, width in projections.values())]
    fix = (
        f"fix: group_size = {fits[0]}, which divides every projection's width"
        if fits
        else "no group size vLLM accepts up to the recipe's divides every projection's width; fix: granularity = \"channel\""
    )
    return (
        f"{recipe.source or recipe.name}: recipe {recipe.name!r} gives the projections of {experts!r} different "
        f"weight group sizes ({parts}); transformers and vLLM load one quantization scheme for all of a model's "
        f"experts, so this export would not load; {fix}"
    )


def weight_fallbacks(module: nn.Module, recipe: Recipe, prefix: str = "") -> dict[str, int | str]:
    """Quantized Linears under ``module`` whose weight group size is not the recipe's: name -> the group size
    used, or ``"channel"`` (per-channel scales); see :meth:`Recipe.weight_spec`."""
    spec = recipe.weight
    if spec is None or spec.granularity != "group":
        return {}
    out: dict[str, int | str] = {}
    for name, sub in module.named_modules(prefix=prefix):
        found = [(name, getattr(sub, "weight_quantizer", None))] if isinstance(sub, QuantLinear) else []
        found += [(f"{name}.{e}.{p}", q.weight_quantizer) for e, p, q in iter_projections(sub)]  # fused experts
        for full, used in found:
            if used is not None and used.spec != spec:
                out[full] = _weight_group(used.spec)
    return out


def _quantize_fused_experts(module: nn.Module, recipe: Recipe, prefix: str) -> list[str]:
    """Per-expert quantizers for fused 3-D experts (no nn.Linear per expert), named like per-expert Linears."""
    names: list[str] = []
    for name, sub in module.named_modules(prefix=prefix):
        if not any(p.dim() == 3 for p in sub.parameters(recurse=False)):
            continue
        if recipe.excludes(name) or not any(recipe.matches(f"{name}.0.{proj}") for proj in PROJECTIONS):
            continue  # excluded as a whole (by its own name or every projection's): an unknown layout is no error
        if recipe.output is not None:
            raise RecipeError(f"{recipe.source or recipe.name}: fused experts {name!r} take no output quantizer")
        try:
            names += attach_expert_quantizers(sub, name, recipe.matches, recipe.weight_spec, recipe.input)
        except ValueError as exc:
            raise RecipeError(
                f"{recipe.source or recipe.name}: recipe {recipe.name!r} does not fit {name!r}: {exc}"
            ) from None
    return names
