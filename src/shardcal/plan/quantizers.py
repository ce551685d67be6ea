"""The recipe's quantizers on the model, as the planner counts them: which Linears of the decoder layers it targets,
the layouts (amax shapes) of their quantizers, and what each holds — its calibrated amax, its observer's state, the
temporaries of calibrating, fake-quantizing and encoding its weight (:mod:`.costs`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..algorithms.memory import PlannedLinear
from ..calib.recipe import Recipe, compile_pattern
from ..errors import RecipeError
from ..quant.formats import FORMATS as NUMBER_FORMATS
from ..quant.granularity import Layout
from ..quant.spec import QuantizerSpec
from .costs import ENCODE_BYTES, FAKE_QUANT_BYTES, NOT_FLOAT32_BYTES, OBSERVER_BYTES
from .preflight import fix_hint
from .structure import Linear


@dataclass(frozen=True, kw_only=True)
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
        out.append(
            QuantTarget(
                linear=lin,
                weight=layout("weight", (lin.out_features, lin.in_features), lin.name),
                input=layout("input", (lin.in_features,), lin.name),
                output=layout("output", (lin.out_features,), lin.name),
                rotation=_rotation(recipe, lin),
            )
        )
    return out


def _rotation(recipe: Recipe, lin: Linear) -> int | None:
    """The rotation block of a targeted Linear (checked when the recipe is applied to the skeleton, not here)."""
    try:
        return recipe.rotation_block(lin.name, lin.in_features)
    except RecipeError:
        return None


def planned_linear(target: QuantTarget) -> PlannedLinear:
    """A quantized Linear as an algorithm's memory model sees it (:mod:`shardcal.algorithms.memory`)."""
    lin = target.linear
    spec = lambda layout: None if layout is None else layout.spec
    return PlannedLinear(
        name=lin.name,
        in_features=lin.in_features,
        out_features=lin.out_features,
        weight=spec(target.weight),
        input=spec(target.input),
        rotation=target.rotation,
    )


def amax_bytes(layout: Layout | None) -> int:
    """A quantizer's amax buffer: float32 per slot (none for a dynamic quantizer)."""
    return 0 if layout is None or layout.spec.dynamic else 4 * layout.num_slots


def observer_bytes(layout: Layout | None) -> int:
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
    return NUMBER_FORMATS[spec.format].kind


def _weight_numel(target: QuantTarget) -> int:
    return target.linear.in_features * target.linear.out_features


def weight_observer_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of calibrating one weight's scales (``calibrate_from`` on the gathered weight)."""
    if target.weight is None:
        return 0
    return _weight_numel(target) * OBSERVER_BYTES.get(target.weight.spec.observer, dtype.itemsize)


def fake_quant_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of the fake-quantized weight a forward in quantize mode computes."""
    if target.weight is None:
        return 0
    extra = 0 if dtype == torch.float32 else NOT_FLOAT32_BYTES
    return _weight_numel(target) * (FAKE_QUANT_BYTES[_kind(target.weight.spec)] + extra)


def encode_bytes(target: QuantTarget, dtype: torch.dtype) -> int:
    """Temporaries of encoding one weight for export (the encoded tensors included)."""
    if target.weight is None:
        return 0
    extra = 0 if dtype == torch.float32 else NOT_FLOAT32_BYTES
    return _weight_numel(target) * (ENCODE_BYTES[_kind(target.weight.spec)] + extra)
