"""Layer-wise PTQ algorithms that run inside :func:`shardcal.calibrate`, one decoder layer at a time.

An algorithm is chosen by a recipe's ``[algorithm]`` table (``name = "gptq"``, plus its parameters) and gets
two hook points in each calibration step, while the layer is gathered on every rank and its quantizers are
inserted:

1. :meth:`LayerAlgorithm.before_weight_calibration` — change the layer's function-preserving parametrisation
   before weight scales are computed (SmoothQuant and AWQ fold per-channel scales into weights/norms);
2. :meth:`LayerAlgorithm.after_weight_calibration` — change weights given the calibrated weight scales
   (GPTQ's error-compensating updates).

The runner takes care of the rest: algorithms that set ``changes_weights`` have the gathered weights written
back into the FSDP2 shards after the hooks, and included in calibration checkpoints. Statistics an algorithm
collects across ranks must be merged with collectives every rank takes (``group`` may be None in a single
process).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..layer_steps import LayerStep

__all__ = ["LayerAlgorithm", "ALGORITHMS", "register", "make_algorithm"]


class LayerAlgorithm:
    """Round to nearest: no change to the layer (the base class every algorithm extends)."""

    name = "rtn"
    #: Whether the hooks modify the layer's parameters (written back to shards and checkpointed).
    changes_weights = False
    #: The propagation ``calibrate`` uses when its caller does not choose one (``propagate=None``).
    default_propagate = "fp"

    def __init__(self, params: Mapping[str, Any] | None = None):
        self.params = dict(params or {})

    def before_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after quantizers are inserted, before weight quantizers are calibrated."""

    def after_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after weight quantizers are calibrated (in ``disabled`` mode), before activation calibration."""


ALGORITHMS: dict[str, Callable[[Mapping[str, Any]], LayerAlgorithm]] = {"rtn": LayerAlgorithm}


def register(name: str, factory: Callable[[Mapping[str, Any]], LayerAlgorithm]) -> None:
    """Make ``[algorithm] name = "<name>"`` run ``factory(params)``'s hooks."""
    ALGORITHMS[name] = factory


def make_algorithm(table: Mapping[str, Any] | None) -> LayerAlgorithm:
    """The algorithm a recipe's ``[algorithm]`` table names (``rtn`` when absent)."""
    table = dict(table or {})
    name = table.pop("name", "rtn")
    if name not in ALGORITHMS:
        from ..errors import RecipeError

        raise RecipeError(f"algorithm {name!r} is not implemented (available: {', '.join(sorted(ALGORITHMS))})")
    return ALGORITHMS[name](table)


# Built-in algorithms (each registers itself and its recipe parameter validator).
from . import awq, gptq, smoothquant  # noqa: E402,F401
