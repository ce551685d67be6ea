"""What ``calibrate(..., activation_report=report)`` takes from a collected :class:`ActivationReport`.

A report holds the full-precision model's statistics on the calibration data. ``calibrate`` uses them instead of
computing the same statistics again, where they are exactly what it would compute:

* **static activation quantizers with the ``rtn`` algorithm** (nothing changes the weights, so every Linear sees the
  collected tensors): a per-tensor ``input_quantizer`` (``output_quantizer``) of Linear ``X`` whose report has target
  ``X:input`` (``X:output``) gets its amax from it instead of observing — a ``max`` observer the largest channel
  absmax, a ``percentile`` observer the percentile read off the report's histogram (same bins required). The
  result is bit-identical to observing. Not for MoE experts' quantizers in all-experts mode (they observe every
  token, the report their routed ones).
* **SmoothQuant without ``alpha_grid``**: the per-channel ``max |x|`` of each smoothing pair's capture point — the
  report's ``input_layernorm:output`` (or ``q_proj``/``k_proj``/``v_proj:input``),
  ``post_attention_layernorm:output`` (Gemma: ``pre_feedforward_layernorm``), ``self_attn.o_proj:input``,
  ``mlp.down_proj:input`` (per expert in an MoE block) — replaces SmoothQuant's statistics pass over the layer. A
  layer that lacks one of them is observed as usual. Layer 0 gets the very same scales; later layers see inputs from
  smoothed layers before them, which differ from the collected ones by float rounding only.

Everything else (AWQ, GPTQ, mse observers, the alpha grid) observes as usual. The report must come from the same model
(config, shapes, weights) and the same data batches (same ``batch_size``), and calibration must propagate full
precision outputs (``propagate="fp"``); otherwise, or when nothing of the recipe can use it, it is refused with a
:class:`~shardcal.errors.CollectionError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..calib.recipe import Recipe
from ..errors import CollectionError
from ..layerwise.batches import Batch
from ..quant.observers import make_observer
from ..quant.quantizer import TensorQuantizer
from .report import ActivationReport, check_fingerprint, json_digest, run_fingerprint

#: Quantizer role -> the target tensor whose statistics it can take.
ROLES = {"input_quantizer": "input", "output_quantizer": "output"}
WHAT = "activation_report"


class ActivationFeed:
    """The statistics of ``report`` one calibration run takes (see the module docstring). ``used`` lists what was
    taken since the caller last cleared it."""

    def __init__(self, report: ActivationReport, quantizers: bool, smoothing: bool):
        self.report = report
        self.quantizers = quantizers
        self.smoothing = smoothing
        self.used: list[str] = []

    @classmethod
    def for_run(
        cls,
        report: ActivationReport | str | Path,
        model: nn.Module,
        batches: list[Batch],
        recipe: Recipe,
        algorithm: Any,
        propagate: str,
    ) -> ActivationFeed:
        """Check ``report`` against this run and say what it feeds; a :class:`CollectionError` if it cannot.
        Collective (the model's fingerprint)."""
        if not isinstance(report, ActivationReport):
            report = ActivationReport.load(report)
        if propagate != "fp":
            raise CollectionError(
                f"{WHAT}: it holds the full-precision model's activations, but propagate={propagate!r} observes the "
                "quantized model's; calibrate with propagate='fp' or without the report"
            )
        check_fingerprint(report, run_fingerprint(model, batches), WHAT)
        quantizers = not algorithm.changes_weights and any(
            _reusable(spec, report) for spec in (recipe.input, recipe.output) if spec is not None
        )
        smoothing = algorithm.takes_collected_max()
        if not quantizers and not smoothing:
            raise CollectionError(
                f"{WHAT}: recipe {recipe.name!r} (algorithm {algorithm.name!r}) uses none of its statistics (they feed "
                "static per-tensor max / percentile activation quantizers under the rtn algorithm, and SmoothQuant "
                "without alpha_grid); calibrate without it"
            )
        return cls(report, quantizers, smoothing)

    def digest(self) -> str:
        """Identifies the report in a calibration checkpoint's fingerprint."""
        return json_digest({k: v for k, v in self.report.to_dict().items() if k not in ("seconds", "save_dir")})

    def amax_for(self, name: str, quantizer: TensorQuantizer) -> tuple[torch.Tensor, int] | None:
        """The amax of quantizer ``name`` (``<linear>.input_quantizer``) from the report and the number of elements it
        stands for (what the observer would have counted), or None (observe it)."""
        owner, _, role = name.rpartition(".")
        if not self.quantizers or role not in ROLES or not _reusable(quantizer.spec, self.report):
            return None
        if quantizer.layout.num_slots != 1:
            return None
        stats = self.report.targets.get(f"{owner}:{ROLES[role]}")
        if stats is None:
            return None
        self.used.append(stats.name)
        top = stats.absmax.max().reshape(quantizer.layout.amax_shape).float()
        elements = stats.tokens * stats.channels
        if quantizer.spec.observer == "max":
            return top, elements
        observer = make_observer(quantizer.spec, quantizer.layout, "cpu")  # the percentile from the same counts
        observer.amax = top
        observer.counts = stats.histogram.to(torch.float64)
        return observer.compute_amax(), elements

    def smoothing_maxima(self, candidates: Sequence[Sequence[str]]) -> list[torch.Tensor] | None:
        """Per smoothing pair, the absmax of the first of its candidate targets the report has; None when a pair
        has none (SmoothQuant then observes the layer itself)."""
        found = []
        for names in candidates:
            name = next((n for n in names if n in self.report.targets), None)
            if name is None:
                return None
            found.append(name)
        self.used.extend(found)
        return [self.report.targets[n].absmax.clone() for n in found]


def _reusable(spec: Any, report: ActivationReport) -> bool:
    """Whether a quantizer spec's amax follows from the report's statistics (per-tensor static max or percentile)."""
    if spec.dynamic or spec.granularity != "tensor":
        return False
    if spec.observer == "max":
        return True
    return (
        spec.observer == "percentile"
        and "histogram" in report.stats
        and int(spec.observer_params.get("bins", -1)) == report.bins
    )
