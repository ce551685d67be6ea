"""Recipes as TOML files: a shipped recipe by name or a user's file by path, parsed and checked key by key into a
:class:`~.recipe.Recipe` (schema in docs/reference/quant-recipes.md).

::

    name = "w8a8-int8"
    description = "int8 per-channel weights, int8 per-tensor static input activations"
    use = "what it is for, in a few words"   # optional, shown by `shardcal recipes`
    recommended = false          # optional: the recipe `shardcal recipes` recommends for its scheme
    group_size_fallback = true   # a group size that does not divide a Linear's in_features: fit it (see below)

    [targets]                    # optional
    include = ["*"]              # glob on full module names, or "re:<regex>" (full match)
    exclude = []                 # added to the default excludes
    default_excludes = true      # lm_head, MoE router gates, vision towers

    [weight]                     # [input] and [output] take the same keys; at least one of the three
    format = "int8"              # int8 | int4 | fp8_e4m3 | nvfp4 | mxfp4 | mxfp8
    granularity = "channel"      # tensor | channel | group | token (dynamic activations only) | block (weights)
    axis = 0                     # channel only (default 0 for weights, -1 for activations)
    group_size = 128             # group only (with dynamic = true: per token, for activations)
    block_size = [128, 128]      # block only: rows x columns of a weight per scale
    observer = "max"             # max | percentile | mse, or a table: { name = "mse", max_shrink = 0.3 }
    symmetric = true             # false: asymmetric (zero points; int weights only, max or mse observer)
    dynamic = false              # activations only: amax from each tensor at run time

    [algorithm]                  # optional: rtn (default), smoothquant, gptq, awq, with their parameters
    name = "rtn"

    [kv_cache]                   # optional: per-tensor FP8 scales for every attention's cached keys and values
    format = "fp8_e4m3"          # the only format (vLLM's FP8 KV cache)
    observer = "max"             # max | percentile | mse, as for [input]

    [rotation]                   # optional: Hadamard rotations, folded into weights and / or online
    residual = "random-hadamard" # the residual stream rotated, folded into the weights: hadamard | random-hadamard
    seed = 0                     # random-hadamard's signs
    type = "hadamard"            # online input rotations: deterministic Sylvester blocks (vLLM's Hadamard kernel)
    block = 128                  # the online Hadamard block (a power of two; none: no online rotation)
    include = ["*.down_proj"]    # which targeted Linears rotate online (patterns as in [targets]); exclude = [...]

    [fallback]                   # optional: decoder layers whose output SQNR is under the floor are recalibrated
    min_layer_sqnr_db = 25.0     # with [fallback.weight] / [fallback.input] (same keys as above) instead,
    [fallback.weight]            # or kept in full precision with full_precision = true
    format = "int8"
    granularity = "channel"

A recipe is the layer above both quantizer specs (:mod:`shardcal.quant`) and algorithms
(:mod:`shardcal.algorithms`): its ``[algorithm]`` table is checked by the algorithm registry. This module is the
schema (parsed and checked); :mod:`.recipe` is the parsed recipe (which Linears, and the spec each one gets), and
:mod:`.attach` puts a recipe's quantizers on modules. Shipped recipes live in the top-level ``recipes/`` folder of a
source checkout, and in ``shardcal/recipes/`` of an installed wheel; :func:`load_recipe` takes a shipped name or a
path. Every problem is a :class:`RecipeError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

from ..algorithms import validate_algorithm
from ..errors import RecipeError
from ..quant.spec import QuantizerSpec
from ..runtime.params import SpecError, is_finite_number
from .recipe import ROLES, Recipe, Rotation, compile_pattern

_TOP_KEYS = (
    "name",
    "description",
    "use",
    "recommended",
    "targets",
    "algorithm",
    "group_size_fallback",
    "kv_cache",
    "rotation",
    "fallback",
) + ROLES
_ROTATION_KEYS = ("type", "block", "include", "exclude", "residual", "seed")
#: The rotation types a recipe may name: ``hadamard`` (compressed-tensors' deterministic Sylvester Hadamard).
ROTATION_TYPES: tuple[str, ...] = ("hadamard",)
#: ``[rotation] residual``: the residual stream's rotation folded into the weights (:mod:`shardcal.algorithms.residual`).
RESIDUAL_ROTATIONS: tuple[str, ...] = ("hadamard", "random-hadamard")
_FALLBACK_KEYS = ("min_layer_sqnr_db", "full_precision", "weight", "input")
_TARGET_KEYS = ("include", "exclude", "default_excludes")
_QUANT_KEYS = ("format", "granularity", "axis", "group_size", "block_size", "observer", "symmetric", "dynamic")


# ----------------------------------------------------------------------------------------------- loading


def shipped_recipes_dir() -> Path:
    """The folder of shipped recipe TOML files: inside the installed package, or the source checkout's
    top-level ``recipes``."""
    package = Path(__file__).resolve().parents[1]  # src/shardcal (installed: site-packages/shardcal)
    for candidate in (package / "recipes", package.parents[1] / "recipes"):
        if candidate.is_dir():
            return candidate
    raise RecipeError(f"the shipped recipes are missing (looked in {package / 'recipes'}); reinstall shardcal")


def shipped_recipes() -> list[str]:
    """Names of the shipped recipes (``w8a8-int8``, ``fp8``, ...), sorted."""
    return sorted(p.stem for p in shipped_recipes_dir().glob("*.toml"))


def shipped_recipe_path(name: str) -> Path:
    """The TOML file of shipped recipe ``name``; :class:`RecipeError` naming the closest shipped names if unknown."""
    shipped = shipped_recipes()
    if name not in shipped:
        raise RecipeError(f"unknown recipe {name!r}{_did_you_mean(name, shipped)}; `shardcal recipes` lists them, "
                          "or pass a path to a .toml file of your own")  # fmt: skip
    return shipped_recipes_dir() / f"{name}.toml"


def _did_you_mean(name: str, shipped: list[str]) -> str:
    import difflib

    word = name.removesuffix(".toml")
    ratio = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in shipped}
    best = max(ratio.values(), default=0.0)
    close = [c for c in difflib.get_close_matches(word, shipped, n=3, cutoff=0.6) if ratio[c] >= best - 0.02]
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe ({exc})") from None


def load_recipe(name_or_path: str | Path | Recipe) -> Recipe:
    """A shipped recipe by name (``"w8a8-int8"``) or a TOML file by path.

    A :class:`~pathlib.Path`, a string with a path separator or ending in ``.toml``, or an existing file, is a path:
    a path that does not exist is an error (never silently a shipped recipe of the same name). Raises
    :class:`RecipeError` naming the file and key for anything wrong, and the closest shipped names for an unknown one.
    """
    if isinstance(name_or_path, Recipe):
        return name_or_path
    text = str(name_or_path)
    path = Path(name_or_path)
    is_path = isinstance(name_or_path, Path) or "/" in text or "\\" in text or text.endswith(".toml")
    if path.is_file():
        return parse_recipe(_read(path), source=str(path), default_name=path.stem)
    if is_path:
        hint = ""
        if path.stem in shipped_recipes():
            hint = f"; {path.stem!r} is the name of a shipped recipe (pass the name alone: --recipe {path.stem})"
        raise RecipeError(f"{path}: no such recipe file{hint}")
    shipped = shipped_recipe_path(text)
    return parse_recipe(_read(shipped), source=str(shipped), default_name=shipped.stem)


def parse_recipe(text: str, source: str = "<recipe>", default_name: str = "recipe") -> Recipe:
    """Parse recipe TOML text; ``source`` names the file in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{source}: not valid TOML ({exc})") from None
    return recipe_from_dict(data, source, default_name)


def _error(source: str, key: str, message: str) -> RecipeError:
    return RecipeError(f"{source}: key {key!r}: {message}")


def _check_keys(table: Mapping[str, Any], known: tuple[str, ...], source: str, prefix: str) -> None:
    for key in table:
        if key not in known:
            raise _error(source, prefix + key, f"unknown key (known here: {', '.join(known)})")


def _table(value: Any, source: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _error(source, key, f"must be a table, got {type(value).__name__}")
    return value


def _typed(value: Any, types: tuple[type, ...], source: str, key: str, what: str) -> Any:
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise _error(source, key, f"must be {what}, got {value!r}")
    return value


def _patterns(value: Any, source: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(source, key, f"must be a list of strings, got {value!r}")
    for i, pattern in enumerate(value):
        try:
            compile_pattern(pattern)
        except (re.error, OverflowError, RecursionError) as exc:  # huge repeat counts, deep nesting
            raise _error(source, f"{key}[{i}]", f"invalid regular expression {pattern[:80]!r} ({exc})") from None
    return tuple(value)


def _spec(table: dict[str, Any], role: str, source: str, key_prefix: str = "") -> QuantizerSpec:
    """One quantizer table (``[weight]``, ``[input]``, ...); error keys are ``key_prefix + role + "." + key``."""
    where = key_prefix + role
    _check_keys(table, _QUANT_KEYS, source, f"{where}.")
    if "format" not in table:
        raise _error(source, f"{where}.format", "missing (one of int8, int4, fp8_e4m3, nvfp4, mxfp4, mxfp8)")
    kwargs: dict[str, Any] = {}
    for key, types, what in (
        ("format", (str,), "a string"),
        ("granularity", (str,), "a string"),
        ("axis", (int,), "an integer"),
        ("group_size", (int,), "an integer"),
        ("block_size", (list,), "a list of two integers, [rows, cols]"),
        ("symmetric", (bool,), "true or false"),
        ("dynamic", (bool,), "true or false"),
    ):
        if key in table:
            kwargs[key] = _typed(table[key], types, source, f"{where}.{key}", what)
    if kwargs.get("granularity") == "channel" and "axis" not in kwargs:
        kwargs["axis"] = 0 if role == "weight" else -1
    if role == "weight" and kwargs.get("dynamic"):
        raise _error(source, f"{where}.dynamic", "weights are quantized statically (dynamic = false)")
    if role != "weight" and kwargs.get("symmetric") is False:
        raise _error(source, f"{where}.symmetric", "asymmetric quantization is for weights only ([weight])")
    if role == "weight" and kwargs.get("granularity") == "token":
        raise _error(source, f"{where}.granularity", "'token' is for activations ([input] with dynamic = true)")
    if role != "weight" and kwargs.get("granularity") == "block":
        raise _error(source, f"{where}.granularity", "'block' is for weights ([weight])")
    if "observer" in table:
        obs = table["observer"]
        if isinstance(obs, dict):
            obs = dict(obs)
            if "name" not in obs:
                raise _error(source, f"{where}.observer.name", "missing (max, percentile or mse)")
            kwargs["observer"] = _typed(obs.pop("name"), (str,), source, f"{where}.observer.name", "a string")
            kwargs["observer_params"] = obs
        else:
            kwargs["observer"] = _typed(obs, (str,), source, f"{where}.observer", "a string or a table")
    if kwargs.get("dynamic") and "observer" in table:
        raise _error(source, f"{where}.observer", "a dynamic quantizer is not calibrated, so it takes no observer")
    try:
        return QuantizerSpec(**kwargs)
    except SpecError as exc:
        raise _error(source, f"{where}.{exc.key}", str(exc)) from None


def _kv_cache_spec(table: dict[str, Any], source: str) -> QuantizerSpec:
    """The ``[kv_cache]`` table: FP8 E4M3, per tensor, static (what vLLM's FP8 KV cache reads)."""
    spec = _spec(table, "kv_cache", source)
    for key, ok, want in (
        ("format", spec.format == "fp8_e4m3", "'fp8_e4m3' (vLLM's FP8 KV cache)"),
        ("granularity", spec.granularity == "tensor", "'tensor' (one k_scale / v_scale per attention layer)"),
        ("dynamic", not spec.dynamic, "false (k_scale / v_scale are calibrated)"),
    ):
        if not ok:
            raise _error(source, f"kv_cache.{key}", f"must be {want}")
    return spec


def _rotation(table: dict[str, Any], source: str) -> Rotation:
    """The ``[rotation]`` table (see the module docstring)."""
    _check_keys(table, _ROTATION_KEYS, source, "rotation.")
    kind = _typed(table.get("type", "hadamard"), (str,), source, "rotation.type", "a string")
    if kind not in ROTATION_TYPES:
        raise _error(source, "rotation.type", f"unknown rotation type {kind!r} (known: {', '.join(ROTATION_TYPES)})")
    residual = table.get("residual")
    if residual is not None:
        residual = _typed(residual, (str,), source, "rotation.residual", "a string")
        if residual not in RESIDUAL_ROTATIONS:
            raise _error(source, "rotation.residual", f"unknown {residual!r} (known: {', '.join(RESIDUAL_ROTATIONS)})")
    seed = _typed(table.get("seed", 0), (int,), source, "rotation.seed", "an integer")
    if seed < 0:
        raise _error(source, "rotation.seed", f"must be at least 0, got {seed}")
    if "block" not in table:
        if residual is None:
            raise _error(
                source, "rotation.block", "missing (the online Hadamard block, a power of two such as 128; or give "
                "residual = \"hadamard\" for a rotation folded into the weights alone)"
            )  # fmt: skip
        for key in ("type", "include", "exclude"):
            if key in table:
                raise _error(source, f"rotation.{key}", "applies to online rotations, which need a block")
        return Rotation(block=None, residual=residual, seed=seed)
    block = _typed(table["block"], (int,), source, "rotation.block", "an integer")
    if block < 2 or block & (block - 1):
        raise _error(source, "rotation.block", f"must be a power of two of at least 2, got {block}")
    include = _patterns(table.get("include", ["*"]), source, "rotation.include")
    exclude = _patterns(table.get("exclude", []), source, "rotation.exclude")
    return Rotation(block=block, include=include, exclude=exclude, type=kind, residual=residual, seed=seed)


def _with_fallback(recipe: Recipe, table: dict[str, Any], source: str) -> Recipe:
    """``recipe`` with its ``[fallback]`` (see the module docstring): the floor and the fallback recipe."""
    _check_keys(table, _FALLBACK_KEYS, source, "fallback.")
    if "min_layer_sqnr_db" not in table:
        raise _error(source, "fallback.min_layer_sqnr_db", "missing (the output SQNR floor in dB)")
    floor = _typed(table["min_layer_sqnr_db"], (int, float), source, "fallback.min_layer_sqnr_db", "a number")
    if not is_finite_number(floor):
        raise _error(source, "fallback.min_layer_sqnr_db", f"must be a finite number, got {floor!r}")
    full = _typed(table.get("full_precision", False), (bool,), source, "fallback.full_precision", "true or false")
    specs = {
        role: _spec(_table(table[role], source, f"fallback.{role}"), role, source, "fallback.")
        for role in ("weight", "input")
        if role in table
    }
    _check_asymmetric_weight_only(specs, source, "fallback.")
    if full == bool(specs):
        raise _error(
            source,
            "fallback",
            "give the fallback scheme: [fallback.weight] and/or [fallback.input], or full_precision = true (not both)",
        )
    fallback = dataclasses.replace(
        recipe, name=f"{recipe.name}:fallback", weight=specs.get("weight"), input=specs.get("input"), output=None
    )
    return dataclasses.replace(recipe, min_layer_sqnr_db=float(floor), fallback=fallback)


def _check_asymmetric_weight_only(specs: Mapping[str, QuantizerSpec], source: str, key_prefix: str) -> None:
    """Asymmetric weights are for weight-only schemes: vLLM's W4A16 / W8A16 kernels take zero points, its W8A8
    kernels need symmetric weights."""
    weight = specs.get("weight")
    if weight is not None and not weight.symmetric and specs.get("input") is not None:
        raise _error(
            source,
            f"{key_prefix}weight.symmetric",
            "asymmetric weights are for weight-only recipes (vLLM's W8A8 / FP8 kernels need symmetric weights); "
            "drop [input] or set symmetric = true",
        )


def recipe_from_dict(data: Mapping[str, Any], source: str = "<recipe>", default_name: str = "recipe") -> Recipe:
    """Build a :class:`Recipe` from parsed TOML data (see the module docstring for the schema)."""
    _check_keys(data, _TOP_KEYS, source, "")
    name = _typed(data.get("name", default_name), (str,), source, "name", "a string")
    description = _typed(data.get("description", ""), (str,), source, "description", "a string")
    use = _typed(data.get("use", ""), (str,), source, "use", "a string")
    recommended = _typed(data.get("recommended", False), (bool,), source, "recommended", "true or false")
    targets = _table(data.get("targets", {}), source, "targets")
    _check_keys(targets, _TARGET_KEYS, source, "targets.")
    include = _patterns(targets.get("include", ["*"]), source, "targets.include")
    exclude = _patterns(targets.get("exclude", []), source, "targets.exclude")
    default_excludes = _typed(
        targets.get("default_excludes", True), (bool,), source, "targets.default_excludes", "true or false"
    )
    fallback = _typed(data.get("group_size_fallback", True), (bool,), source, "group_size_fallback", "true or false")
    specs = {role: _spec(_table(data[role], source, role), role, source) for role in ROLES if role in data}
    if not specs:
        raise _error(source, "weight", "a recipe needs at least one of [weight], [input], [output]")
    _check_asymmetric_weight_only(specs, source, "")
    kv_cache = _kv_cache_spec(_table(data["kv_cache"], source, "kv_cache"), source) if "kv_cache" in data else None
    rotation = _rotation(_table(data["rotation"], source, "rotation"), source) if "rotation" in data else None
    try:
        algorithm = validate_algorithm(_table(data.get("algorithm", {"name": "rtn"}), source, "algorithm"))
    except SpecError as exc:
        raise _error(source, f"algorithm.{exc.key}", str(exc)) from None
    recipe = Recipe(
        name=name,
        description=description,
        include=include,
        exclude=exclude,
        default_excludes=default_excludes,
        algorithm=algorithm,
        source=source,
        group_size_fallback=fallback,
        kv_cache=kv_cache,
        rotation=rotation,
        use=use,
        recommended=recommended,
        **specs,
    )
    if "fallback" in data:
        recipe = _with_fallback(recipe, _table(data["fallback"], source, "fallback"), source)
    return recipe
