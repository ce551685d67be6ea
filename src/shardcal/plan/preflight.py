"""What a calibration can refuse before any weight or data is loaded: the model's skeleton against the recipe.

The model is built on the meta device from ``config.json`` (shardcal's class, or transformers' for ``--model-impl
transformers``), its parameters are matched against the safetensors headers (names and shapes, no tensor read), and
the recipe is applied to every decoder layer exactly as the runner will apply it (:func:`quantize_modules`): a group
size that does not divide a Linear's width, a format a module cannot take, fused experts with an output quantizer
fail here with the runner's own error, plus the fix. Target patterns of the recipe's own that match no Linear of
the model, and a recipe that quantizes nothing, are refused too (a typo there silently changes what is quantized).
Activation collection's target patterns are resolved against the skeleton the same way (:func:`check_targets_fit`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from ..algorithms.residual import check_residual_layout
from ..calib.attach import quantize_modules
from ..calib.recipe import Recipe, compile_pattern
from ..collect.targets import Target, TargetPattern, resolve_targets
from ..errors import RecipeError
from ..loading.build import build_on_meta, check_checkpoint_keys, resolve_dtype
from ..loading.foreign import build_transformers_on_meta
from ..loading.sources import resolve_sources
from ..models.checkpoint import CheckpointReader
from ..models.config import load_config
from ..quant.expert_layout import PROJECTIONS, fused_experts_shape
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers


def meta_skeleton(model_dir: str | Path, impl: str, *, check_headers: bool = True) -> nn.Module:
    """The model of ``model_dir`` on the meta device; with ``check_headers`` its parameters are checked against
    the checkpoint's safetensors headers (names and shapes)."""
    if impl == "shardcal":
        cfg = load_config(model_dir)
        model = build_on_meta(cfg, resolve_dtype(cfg, None))
    else:
        model = build_transformers_on_meta(model_dir)
    if check_headers:
        with CheckpointReader(model_dir) as reader:
            if impl == "shardcal":
                check_checkpoint_keys(model, reader, cfg)
            else:
                resolve_sources(model, reader)
    return model


def check_recipe_fits(model: nn.Module, recipe: Recipe) -> list[str]:
    """Apply ``recipe`` to ``model``'s decoder layers as the runner does; return the quantized modules' names.

    ``model`` is changed (quantizers inserted): pass a skeleton (:func:`meta_skeleton`). Raises
    :class:`RecipeError` naming the module and a fix, or the recipe's patterns that match nothing; a
    :class:`~shardcal.errors.ModelLayoutError` when ``[rotation] residual`` cannot rotate the model.
    """
    layers = require_decoder_layers(model)
    if recipe.rotates_residual:
        check_residual_layout(model)  # before quantizers change the skeleton
    candidates = _quantizable_names(model)
    _check_patterns(recipe, candidates)
    prefix = decoder_layer_prefix(model, layers)
    targeted: list[str] = []
    for i, layer in enumerate(layers):
        try:
            targeted += quantize_modules(layer, recipe, prefix=f"{prefix}.{i}")
        except RecipeError as exc:
            raise RecipeError(f"{exc}{fix_hint(str(exc))}") from None
    if not targeted:
        raise RecipeError(
            f"{recipe.source or recipe.name}: recipe {recipe.name!r} quantizes no Linear of the decoder layers "
            f"(include {list(recipe.include)}, exclude {list(recipe.all_excludes)}; the layers' Linears are named "
            f"like {_example(candidates, prefix)})"
        )
    return targeted


def check_targets_fit(model: nn.Module, patterns: Sequence[TargetPattern]) -> list[Target]:
    """Resolve activation-collection target patterns against ``model`` (a skeleton will do) as
    :func:`shardcal.collect_activations` does: a :class:`CollectionError` for a pattern that matches no module or
    one outside the decoder layers."""
    layers = require_decoder_layers(model)
    return resolve_targets(model, patterns, decoder_layer_prefix(model, layers), len(layers))


def _quantizable_names(model: nn.Module) -> list[str]:
    """Every name a recipe's patterns can target: Linears, fused experts (as a whole) and their per-expert
    projections."""
    names = [name for name, sub in model.named_modules() if isinstance(sub, nn.Linear)]
    for name, sub in model.named_modules():
        shape = (
            fused_experts_shape(sub, name, strict=False)
            if any(p.dim() == 3 for p in sub.parameters(recurse=False))
            else None
        )
        if shape is not None:
            names += [name, *(f"{name}.{e}.{p}" for e in range(shape[0]) for p in PROJECTIONS)]
    return names


def _check_patterns(recipe: Recipe, names: list[str]) -> None:
    """The recipe's own include and exclude patterns must each match some module (the defaults need not)."""
    for kind, patterns in (("include", recipe.include), ("exclude", recipe.exclude)):
        for pattern in patterns:
            regex = compile_pattern(pattern)
            if not any(regex.fullmatch(n) for n in names):
                raise RecipeError(
                    f"{recipe.source or recipe.name}: [targets] {kind} pattern {pattern!r} matches no Linear of this "
                    f"model (names look like {_example(names, '')}; a glob's '*' matches dots too, 're:' starts a "
                    "regular expression)"
                )


def _example(names: list[str], prefix: str) -> str:
    inside = [n for n in names if n.startswith(prefix)] or names
    return ", ".join(repr(n) for n in inside[:3]) if inside else "(the model has no Linear)"


_GROUP = re.compile(r"module '([^']+)': .*group_size (\d+) does not divide (?:the last dimension|in_features) (\d+)")
_MODULE = re.compile(r"(?:module|fit) '([^']+)'")


def fix_hint(message: str) -> str:
    """What to change: a group size that divides the width, or an exclude pattern for the module in every layer."""
    module = _MODULE.search(message)
    if module is None:
        return ""
    exclude = re.sub(r"\.\d+(?=\.)", ".*", module.group(1), count=1)
    group = _GROUP.search(message)
    if group is not None:
        size, width = int(group.group(2)), int(group.group(3))
        divides = next((g for g in (128, 64, 32, 16, 8) if g < size and width % g == 0), None)
        if divides is not None:
            return f"; fix: group_size = {divides} (divides {width}), or [targets] exclude = [{exclude!r}]"
    return f"; fix: [targets] exclude = [{exclude!r}]"
