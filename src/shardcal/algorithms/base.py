"""``LayerAlgorithm``: the base class of the layer-wise algorithms, and round to nearest (``rtn``) itself.

An algorithm is chosen by a recipe's ``[algorithm]`` table (``name = "gptq"``, plus its parameters) and gets
two hook points in each calibration step, while the layer is gathered on every rank and its quantizers are
inserted:

1. :meth:`LayerAlgorithm.before_weight_calibration` — change the layer's function-preserving parametrisation
   before weight scales are computed (SmoothQuant and AWQ fold per-channel scales into weights/norms);
2. :meth:`LayerAlgorithm.after_weight_calibration` — change weights given the calibrated weight scales
   (GPTQ's error-compensating updates).

The runner takes care of the rest: algorithms that set ``changes_weights`` have the gathered weights written
back into the FSDP2 shards after the hooks, and included in calibration checkpoints. An algorithm whose statistics
already give some activation quantizers' amax (:meth:`LayerAlgorithm.derived_amax`) spares the runner observing
them; when none is left to observe and the hooks kept the layer's full-precision outputs (``step.outputs``, valid
for a ``preserves_function`` algorithm), the runner runs no observing pass at all. Statistics an algorithm
collects across ranks must be merged with collectives every rank takes (``group`` may be None in a single
process).

A class carries everything about its algorithm: its recipe name, its parameter ``schema`` (defaults and checks),
:meth:`validate`, its constructor (the factory) and its memory model for the planner (:meth:`planned_memory`, see
:mod:`.memory`; each class defines its own, and the planner refuses one that does not). :mod:`shardcal.algorithms` lists the classes in one registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..layerwise.steps import LayerStep
from ..runtime.params import Schema, check_params
from .memory import AlgorithmMemory, LayerPlanContext

#: What an algorithm's passes leave as the layer's outputs (:attr:`AlgorithmStep.keeps`): the layer's full-precision
#: outputs, or its final outputs (the layer as the algorithm leaves it, quantizers on).
KEEPS_FULL_PRECISION, KEEPS_FINAL = "full-precision", "final"


@dataclass(frozen=True, kw_only=True)
class AlgorithmStep:
    """What an algorithm's hooks will do in one layer's step, stated before they run (:meth:`LayerAlgorithm.plan_step`):
    whether they run the layer over the data (``passes``); what they leave as ``step.outputs`` (``keeps``:
    :data:`KEEPS_FULL_PRECISION`, :data:`KEEPS_FINAL` or None), and whether they may leave none after all
    (``may_keep_none``: a guard that decides on the data); the activation quantizers whose amax
    :meth:`LayerAlgorithm.derived_amax` will give (``derives``). The runner plans the layer's passes from it
    (:mod:`shardcal.calib.passes`) and checks after the hooks that they did what they said."""

    passes: bool = False
    keeps: str | None = None
    may_keep_none: bool = False
    derives: tuple[Any, ...] = ()


class LayerAlgorithm:
    """Round to nearest: no change to the layer (the base class every algorithm extends)."""

    #: The recipe's ``[algorithm] name``.
    name: ClassVar[str] = "rtn"
    #: Recipe parameters: key -> (default, check). ``validate`` completes a table with the defaults.
    schema: ClassVar[Schema] = {}
    #: Whether the hooks modify the layer's parameters (written back to shards and checkpointed).
    changes_weights: ClassVar[bool] = False
    #: Whether the hooks change only the layer's parametrisation, not the function it computes in full precision
    #: (SmoothQuant's folds): the layer's SQNR is then measured against the layer after them, and outputs the hooks
    #: kept (``step.outputs``) stay valid.
    preserves_function: ClassVar[bool] = False
    #: The propagation ``calibrate`` uses when neither its caller nor a ``propagate`` parameter chooses one.
    default_propagate: ClassVar[str] = "fp"

    def __init__(self, params: Mapping[str, Any] | None = None):
        self.params = self.validate(dict(params or {}))
        #: Set by ``calibrate(..., activation_report=...)`` when :meth:`takes_collected_max`: given, per capture point,
        #: the target names that hold its per-channel ``max |x|`` (``"<module>:input"``), the collected maxima — or
        #: None when the report lacks one (the algorithm then computes its statistics itself).
        self.collected_max: Callable[[Sequence[Sequence[str]]], Any] | None = None

    def takes_collected_max(self) -> bool:
        """Whether the algorithm can use collected per-channel input maxima instead of a statistics pass."""
        return False

    @classmethod
    def validate(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters completed with defaults; :class:`~shardcal.runtime.params.SpecError` naming a bad key."""
        return check_params(f"algorithm {cls.name!r}", params, cls.schema)

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """The memory the algorithm holds on ``context``'s rank while it runs on ``context``'s layer, for the
        validated recipe table ``params``. Round to nearest holds nothing. A subclass states its own: the planner
        refuses a class that does not define this method itself."""
        return AlgorithmMemory(cls.name)

    @property
    def smooths_before_rotation(self) -> bool:
        """Whether :meth:`before_weight_calibration` works on each Linear's inputs in their own channels (SmoothQuant's
        folds), so that the runner folds the recipe's ``[rotation]`` into the weights after it: each weight is rotated
        once, instead of rotated, then un-rotated and rotated again for a fold."""
        return False

    @property
    def reference_stream(self) -> bool:
        """Whether the algorithm reads each layer's full-precision stream (``step.reference_inputs`` /
        ``step.reference_outputs``: what the unquantized model gives and makes of the layer), which the runner then
        carries beside the propagated one."""
        return False

    @property
    def propagate(self) -> str:
        """What ``calibrate`` uses when its caller does not choose (``propagate=None``)."""
        return self.params.get("propagate", self.default_propagate)

    def plan_step(self, step: LayerStep, recipe: Any) -> AlgorithmStep:
        """What the hooks will do in ``step`` (see :class:`AlgorithmStep`), called once the layer's quantizers are
        inserted, before :meth:`before_weight_calibration`. Round to nearest does nothing."""
        return AlgorithmStep()

    def before_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after quantizers are inserted, before weight quantizers are calibrated."""

    def after_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        """Called after weight quantizers are calibrated (in ``disabled`` mode), before activation calibration."""

    def derived_amax(self, step: LayerStep) -> list[tuple[Any, torch.Tensor, int]]:
        """Activation quantizers of the layer whose calibrated amax the algorithm's own statistics give — exactly
        what their observers would record over the same tokens, merged over ranks — as ``(quantizer, amax, elements
        observed)``; called after :meth:`after_weight_calibration`. The runner sets them instead of observing."""
        return []

    def layer_report(self, step: LayerStep) -> dict[str, Any]:
        """What the algorithm reports about the layer it just ran on (JSON-able, the same on every rank)."""
        return {}
