"""``Recipe``: what a recipe says of each module of a model — whether it is quantized, with which quantizer specs
(a grouped weight's group size fitted to the Linear), its ``[rotation]`` block, the algorithm, the KV cache's spec and
the ``[fallback]`` recipe.

A :class:`Recipe` is plain, frozen data, read from TOML by :mod:`.recipes` (which checks every key); the runner,
the export and the planner ask it about module names. Module-name patterns: ``re:<regex>`` (full match) or a glob
(``*`` matches dots too); the default excludes (:data:`DEFAULT_EXCLUDES`) keep the LM head, MoE routers and vision
towers in full precision.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import RecipeError
from ..quant.spec import MX_FORMATS, QuantizerSpec

#: Formats whose block of the last dim is part of the format (nvfp4's 16, MX's 32): never fitted per Linear.
FIXED_BLOCKS = ("nvfp4", *MX_FORMATS)

#: Modules never quantized unless ``default_excludes = false``: the LM head, MoE routers, vision towers.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    "lm_head",
    "*.lm_head",
    "*.mlp.gate",
    "*.block_sparse_moe.gate",
    "*.shared_expert_gate",
    "*.router",
    "*vision_tower*",
    "*vision_model*",
    "visual.*",
    "*.visual.*",
    "*multi_modal_projector*",
)
ROLES: tuple[str, ...] = ("weight", "input", "output")
#: The smallest Hadamard block a ``[rotation]`` falls back to for a Linear its ``block`` does not divide.
MIN_ROTATION_BLOCK = 16
#: Group sizes of grouped weights that vLLM's kernels accept besides per channel (Marlin's
#: ``MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]``, -1 being per channel), largest first.
VLLM_GROUP_SIZES: tuple[int, ...] = (128, 64, 32)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A module-name pattern: ``re:<regex>`` (full match) or a glob (``*`` matches dots too)."""
    if pattern.startswith("re:"):
        return re.compile(pattern[3:])
    return re.compile(fnmatch.translate(pattern))


@dataclass(frozen=True)
class Rotation:
    """``[rotation]``: the targeted Linears whose names match ``include`` (and no ``exclude``) compute
    ``(x H) (W H)^T`` instead of ``x W^T``, ``H`` the orthonormal block-diagonal Sylvester Hadamard with blocks of
    ``block`` (:func:`shardcal.quant.hadamard.hadamard_blocks`): ``W H`` is folded into the weight before it is
    calibrated, ``x H`` is computed online, before the input quantizer. Exported as compressed-tensors'
    ``transform_config`` (``input`` online, ``weight_input`` fused); ``block`` None: no online rotation.
    ``residual``: the whole residual stream rotated too, folded into the weights before anything is calibrated
    (:mod:`shardcal.algorithms.residual`; ``random-hadamard`` with signs from ``seed``), or None."""

    block: int | None
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    type: str = "hadamard"
    residual: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "_include_re", [compile_pattern(p) for p in self.include])
        object.__setattr__(self, "_exclude_re", [compile_pattern(p) for p in self.exclude])

    def __hash__(self) -> int:
        return hash((self.block, self.include, self.exclude, self.type, self.residual, self.seed))

    def matches(self, module_name: str) -> bool:
        """Whether the Linear with this full name (one the recipe quantizes) gets the online rotation."""
        return (
            self.block is not None
            and any(r.fullmatch(module_name) for r in self._include_re)
            and not any(r.fullmatch(module_name) for r in self._exclude_re)
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"residual": self.residual, "seed": self.seed} if self.residual is not None else {}
        if self.block is not None:
            out.update(type=self.type, block=self.block, include=list(self.include), exclude=list(self.exclude))
        return out


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A parsed recipe. ``matches(name)`` says whether the Linear named ``name`` (full path) is quantized."""

    name: str
    weight: QuantizerSpec | None = None
    input: QuantizerSpec | None = None
    output: QuantizerSpec | None = None
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    default_excludes: bool = True
    algorithm: Mapping[str, Any] = field(default_factory=lambda: {"name": "rtn"})
    description: str = ""
    source: str | None = None
    group_size_fallback: bool = True
    #: What the recipe is for, in a few words (``shardcal recipes`` shows it); no effect on calibration.
    use: str = ""
    #: The recipe ``shardcal recipes`` recommends for its scheme; no effect on calibration.
    recommended: bool = False
    #: The ``[kv_cache]`` quantizer of every attention's keys and values (FP8 per tensor), or None.
    kv_cache: QuantizerSpec | None = None
    #: ``[fallback]``: decoder layers whose output SQNR (dB) is below ``min_layer_sqnr_db`` are recalibrated with
    #: ``fallback`` (the same recipe with the fallback's quantizers; none at all for full precision).
    min_layer_sqnr_db: float | None = None
    fallback: Recipe | None = None
    #: ``[rotation]``: online Hadamard rotations of some Linears' inputs, or None.
    rotation: Rotation | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "_include_re", [compile_pattern(p) for p in self.include])
        object.__setattr__(self, "_exclude_re", [compile_pattern(p) for p in self.all_excludes])

    def __hash__(self) -> int:
        return hash(
            (self.name, self.source, self.weight, self.input, self.output, self.include, self.exclude, self.kv_cache)
            + (self.min_layer_sqnr_db, self.fallback, self.rotation)
        )

    @property
    def quantizes_linears(self) -> bool:
        """Whether the recipe has any Linear quantizer (a full-precision fallback has none)."""
        return bool(self.specs)

    @property
    def all_excludes(self) -> tuple[str, ...]:
        return self.exclude + (DEFAULT_EXCLUDES if self.default_excludes else ())

    def excludes(self, module_name: str) -> bool:
        """Whether an exclude pattern names this module (a Linear, or fused experts as a whole)."""
        return any(r.fullmatch(module_name) for r in self._exclude_re)

    def matches(self, module_name: str) -> bool:
        """Whether the Linear with this full name is quantized: an include matches and no exclude does."""
        return any(r.fullmatch(module_name) for r in self._include_re) and not any(
            r.fullmatch(module_name) for r in self._exclude_re
        )

    def weight_spec(self, module_name: str, in_features: int) -> QuantizerSpec | None:
        """The weight spec for the Linear ``module_name`` with ``in_features`` inputs: the recipe's, or — for a
        grouped weight whose group size does not divide ``in_features`` — the largest group size of
        :data:`VLLM_GROUP_SIZES` below the recipe's that divides it, else per-channel scales. With
        ``group_size_fallback = false`` a group size that does not fit is a :class:`RecipeError` naming the Linear."""
        spec = self.weight
        if (
            spec is None
            or spec.granularity != "group"
            or spec.format in FIXED_BLOCKS
            or in_features % spec.group_size == 0
        ):
            return spec
        if not self.group_size_fallback:
            raise RecipeError(
                f"{self.source or self.name}: recipe {self.name!r} does not fit module {module_name!r}: group_size "
                f"{spec.group_size} does not divide in_features {in_features} (group_size_fallback = false)"
            )
        for size in VLLM_GROUP_SIZES:
            if size < spec.group_size and in_features % size == 0:
                return dataclasses.replace(spec, group_size=size)
        return dataclasses.replace(spec, granularity="channel", axis=0, group_size=None)

    @property
    def rotates_residual(self) -> bool:
        """Whether ``[rotation] residual`` rotates the residual stream (folded into the weights before calibration)."""
        return self.rotation is not None and self.rotation.residual is not None

    def rotation_block(self, module_name: str, in_features: int) -> int | None:
        """The Hadamard block that rotates the targeted Linear ``module_name``'s inputs, or None: the recipe's
        ``block``, or the largest power of two below it that divides ``in_features`` (SmolLM2's 576 takes 64 where
        ``block = 128``). Under :data:`MIN_ROTATION_BLOCK` that is a :class:`RecipeError` naming the Linear."""
        if self.rotation is None or self.rotation.block is None or not self.rotation.matches(module_name):
            return None
        block = min(self.rotation.block, in_features & -in_features)
        if block < min(MIN_ROTATION_BLOCK, self.rotation.block):
            raise RecipeError(
                f"{self.source or self.name}: recipe {self.name!r} does not fit module {module_name!r}: its "
                f"in_features {in_features} has no power-of-two divisor of at least {MIN_ROTATION_BLOCK} for a "
                "[rotation] block (exclude the module from the rotation)"
            )
        return block

    @property
    def specs(self) -> dict[str, QuantizerSpec]:
        """``{"weight": spec, "input": spec, ...}`` for the quantizers the recipe has."""
        return {role: s for role in ROLES if (s := getattr(self, role)) is not None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "targets": {
                "include": list(self.include),
                "exclude": list(self.exclude),
                "default_excludes": self.default_excludes,
            },
            **{role: spec.to_dict() for role, spec in self.specs.items()},
            "algorithm": dict(self.algorithm),
            "group_size_fallback": self.group_size_fallback,
            **({"kv_cache": self.kv_cache.to_dict()} if self.kv_cache is not None else {}),
            **({"rotation": self.rotation.to_dict()} if self.rotation is not None else {}),
            **({"fallback": self._fallback_dict()} if self.fallback is not None else {}),
        }

    def _fallback_dict(self) -> dict[str, Any]:
        specs = {role: spec.to_dict() for role, spec in self.fallback.specs.items()}
        return {"min_layer_sqnr_db": self.min_layer_sqnr_db, "full_precision": not specs, **specs}
