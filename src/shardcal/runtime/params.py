"""Parameter tables checked against a schema: observers' and algorithms' parameters in recipes.

A schema maps each key to ``(default, check)``; ``check(value)`` returns what is wrong (a phrase such as
``"must be an integer"``) or None. :func:`check_params` completes a table with defaults and raises
:class:`SpecError` naming the key for an unknown key or a bad value; the recipe loader turns that into a
:class:`~shardcal.errors.RecipeError` naming the file too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

#: A value check: None when the value is fine, else what is wrong with it.
Check = Callable[[Any], "str | None"]
Schema = Mapping[str, tuple[Any, Check]]


class SpecError(ValueError):
    """A field of a spec or parameter table has a bad value; ``key`` names the field (``observer.bins``, ...)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def check_params(owner: str, params: Mapping[str, Any], schema: Schema, key_prefix: str = "") -> dict[str, Any]:
    """``params`` completed with the schema's defaults; :class:`SpecError` for an unknown key or a bad value.

    ``owner`` names whose parameters these are in messages (``"observer 'mse'"``, ``"algorithm 'gptq'"``);
    ``key_prefix`` is prepended to the key the error names (``"observer."``).
    """
    unknown = sorted(set(params) - set(schema))
    if unknown:
        known = ", ".join(schema) or "none"
        raise SpecError(key_prefix + unknown[0], f"unknown parameter {unknown[0]!r} for {owner} (known: {known})")
    out = {}
    for key, (default, check) in schema.items():
        value = params.get(key, default)
        problem = check(value)
        if problem:
            raise SpecError(key_prefix + key, f"{owner}: {key} {problem}, got {value!r}")
        out[key] = value
    return out


def is_finite_number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def number(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in the interval from ``lo`` to ``hi`` (each end open or closed)."""

    def check(v: Any) -> str | None:
        if not is_finite_number(v):
            return "must be a number"
        if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            return f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        return None

    return check


def integer(lo: int) -> Check:
    """An integer (not a bool) of at least ``lo``."""

    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return "must be an integer"
        return f"must be at least {lo}" if v < lo else None

    return check


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def one_of(*choices: str) -> Check:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"

    return check


def subset_of(*choices: str) -> Check:
    """A list of distinct entries, each one of ``choices``."""

    def check(v: Any) -> str | None:
        if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
            return "must be a list of strings"
        bad = [c for c in v if c not in choices]
        if bad:
            return f"has unknown entry {bad[0]!r} (known: {', '.join(choices)})"
        if len(set(v)) != len(v):
            return "has a duplicate entry"
        return None

    return check


def number_list(lo: float, hi: float) -> Check:
    """A list of finite numbers in ``[lo, hi]`` (possibly empty)."""

    def check(v: Any) -> str | None:
        if not isinstance(v, list) or any(not is_finite_number(a) or not lo <= a <= hi for a in v):
            return f"must be a list of numbers in [{lo}, {hi}]"
        return None

    return check


def table_or_none(v: Any) -> str | None:
    return None if v is None or isinstance(v, dict) else "must be a table"
