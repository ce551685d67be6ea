"""``LayerAlgorithm``: the base class of the layer-wise algorithms, and round to nearest (``rtn``) itself.

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

A class carries everything about its algorithm: its recipe name, its parameter ``schema`` (defaults and checks),
:meth:`validate`, and its constructor (the factory). :mod:`shardcal.algorithms` lists the classes in one registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..params import Schema, check_params
from ..steps import LayerStep


class LayerAlgorithm:
    """Round to nearest: no change to the layer (the base class every algorithm extends)."""

    #: The recipe's ``[algorithm] name``.
    name: ClassVar[str] = "rtn"
    #: Recipe parameters: key -> (default, check). ``validate`` completes a table with the defaults.
    schema: ClassVar[Schema] = {}
    #: Whether the hooks modify the layer's parameters (written back to shards and checkpointed).
    changes_weights: ClassVar[bool] = False
    #: The propagation ``calibrate`` uses when neither its caller nor a ``propagate`` parameter chooses one.
    default_propagate: ClassVar[str] = "fp"

    def __init__(self, params: Mapping[str, Any] | None = None):
        self.params = self.validate(dict(params or {}))

    @classmethod
    def validate(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters completed with defaults; :class:`~shardcal.params.SpecError` naming a bad key."""
        return check_params(f"algorithm {cls.name!r}", params, cls.schema)

    @property
    def propagate(self) -> str:
        """What ``calibrate`` uses when its caller does not choose (``propagate=None``)."""
        return self.params.get("propagate", self.default_propagate)

    def before_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after quantizers are inserted, before weight quantizers are calibrated."""

    def after_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after weight quantizers are calibrated (in ``disabled`` mode), before activation calibration."""

    def layer_report(self, step: LayerStep) -> dict[str, Any]:
        """What the algorithm reports about the layer it just ran on (JSON-able, the same on every rank)."""
        return {}
