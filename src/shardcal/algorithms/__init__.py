"""Layer-wise PTQ algorithms that run inside :func:`shardcal.calib.runner`, one decoder layer at a time: the registry.

Each algorithm is one class (:class:`~.base.LayerAlgorithm` and its subclasses) carrying its recipe name, its
parameter schema, its validation and its constructor. :data:`ALGORITHMS` lists the built-in classes; recipe
validation (:mod:`shardcal.calib.recipes`) and the runner both ask it. Nothing registers itself on import; a user's
own algorithm is added with an explicit :func:`register_algorithm` call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RecipeError
from ..runtime.params import SpecError
from .autoround import AutoRound
from .awq import AWQ
from .base import LayerAlgorithm
from .gptq import GPTQ
from .smoothquant import SmoothQuant

__all__ = [
    "ALGORITHMS",
    "AWQ",
    "GPTQ",
    "AutoRound",
    "LayerAlgorithm",
    "SmoothQuant",
    "make_algorithm",
    "register_algorithm",
    "validate_algorithm",
]

#: Recipe name -> algorithm class.
ALGORITHMS: dict[str, type[LayerAlgorithm]] = {
    cls.name: cls for cls in (LayerAlgorithm, SmoothQuant, AWQ, GPTQ, AutoRound)
}


def register_algorithm(cls: type[LayerAlgorithm]) -> type[LayerAlgorithm]:
    """Make ``[algorithm] name = cls.name`` valid and run ``cls``'s hooks (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, LayerAlgorithm)):
        raise TypeError(f"register_algorithm needs a LayerAlgorithm subclass, got {cls!r}")
    ALGORITHMS[cls.name] = cls
    return cls


def validate_algorithm(table: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe's ``[algorithm]`` table checked and completed: ``{"name": ..., **parameters}``.

    Raises :class:`~shardcal.runtime.params.SpecError` naming the key (``name``, or the parameter).
    """
    table = dict(table)
    if "name" not in table:
        raise SpecError("name", f"missing (known: {', '.join(ALGORITHMS)})")
    name = table.pop("name")
    if not isinstance(name, str):
        raise SpecError("name", f"must be a string, got {name!r}")
    if name not in ALGORITHMS:
        raise SpecError("name", f"unknown algorithm {name!r} (known: {', '.join(ALGORITHMS)})")
    return {"name": name, **ALGORITHMS[name].validate(table)}


def make_algorithm(table: Mapping[str, Any] | None) -> LayerAlgorithm:
    """The algorithm a (validated) recipe ``[algorithm]`` table names (``rtn`` when absent)."""
    try:
        params = validate_algorithm(table or {"name": "rtn"})
    except SpecError as exc:
        raise RecipeError(f"[algorithm] {exc.key}: {exc}") from None
    return ALGORITHMS[params.pop("name")](params)
