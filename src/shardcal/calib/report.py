"""What a calibration run measured: per-layer time, output SQNR, and every quantizer's amax."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..runtime.fsutil import atomic_path, atomic_write_text

#: An MoE expert's ``scales_from`` when the recipe gives its inputs no static scale (weights only, or dynamic).
NO_INPUT_SCALES = "no input scales"


@dataclass(kw_only=True)
class LayerReport:
    index: int
    name: str
    seconds: float
    #: 10·log10(signal / noise) of the layer's output with its quantizers on vs off, on the same inputs.
    sqnr_db: float | None
    #: quantizer name -> {"amax": max, "amax_mean": mean, "shape": [...]} (full values are in the state file).
    quantizers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: quantizers that saw no data (MoE experts no token was routed to) and got a fallback amax.
    fallbacks: list[str] = field(default_factory=list)
    #: Linears whose weight group size is not the recipe's (it does not divide their in_features): the group size
    #: used, or "channel" (per-channel scales).
    group_sizes: dict[str, int | str] = field(default_factory=dict)
    #: "recipe", or "fallback" when the layer's SQNR under the recipe was below its ``min_layer_sqnr_db`` and it
    #: was recalibrated with the recipe's ``[fallback]`` (``sqnr_db`` is then the fallback's).
    scheme: str = "recipe"
    #: The SQNR (dB) the layer had under the recipe's own scheme, when it fell back.
    recipe_sqnr_db: float | None = None
    #: per MoE block: ``{"routed_tokens": [per expert, real tokens over all ranks], "scales_from": [per expert:
    #: "routed tokens" | "all tokens" (all-experts mode) | "sibling fallback" | "no input scales" (the recipe gives
    #: the expert's inputs no static scale: weights only, or dynamic)]}``.
    moe: dict[str, dict[str, list]] = field(default_factory=dict)
    #: what the layer's algorithm reports (GPTQ: the damping each Linear needed).
    algorithm: dict[str, Any] = field(default_factory=dict)
    #: targets of a collected activation report whose statistics this layer used (``calibrate(activation_report=)``).
    from_activation_report: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class CalibrationReport:
    recipe: str
    propagate: str
    world_size: int
    num_batches: int
    num_tokens: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from_layer: int = 0
    #: The real tokens that ran through the decoder layers: all of ``num_tokens``, or only the SQNR sample's when the
    #: recipe reads no activation statistics (a data-free recipe: round to nearest, weights and dynamic inputs only).
    layer_tokens: int | None = None

    @property
    def data_free(self) -> bool:
        """Whether only the SQNR sample ran through the layers (nothing else of the data was read)."""
        return self.layer_tokens is not None and self.layer_tokens < self.num_tokens

    @property
    def group_sizes(self) -> dict[str, int | str]:
        """Every Linear whose weight group size differs from the recipe's, with the size used (all layers)."""
        return {name: size for layer in self.layers for name, size in layer.group_sizes.items()}

    @property
    def fallback_layers(self) -> list[str]:
        """Names of the decoder layers recalibrated with the recipe's ``[fallback]``."""
        return [layer.name for layer in self.layers if layer.scheme == "fallback"]

    @property
    def experts_without_tokens(self) -> tuple[int, int]:
        """``(experts no calibration token was routed to, experts)`` over all MoE blocks."""
        counts = [n for entry in self.layers for block in entry.moe.values() for n in block["routed_tokens"]]
        return sum(1 for n in counts if n == 0), len(counts)

    def moe_summary(self) -> str | None:
        """One line on MoE coverage (experts without routed tokens and where their scales came from), or None."""
        unrouted, experts = self.experts_without_tokens
        if experts == 0:
            return None
        sources: dict[str, int] = {}
        for entry in self.layers:
            for block in entry.moe.values():
                for n, source in zip(block["routed_tokens"], block["scales_from"]):
                    if n == 0:
                        sources[source] = sources.get(source, 0) + 1
        line = f"MoE: {unrouted} of {experts} experts got no routed calibration token"
        unscaled = sources.pop(NO_INPUT_SCALES, 0)
        if sources:
            line += "; their input scales come from " + ", ".join(f"{k} ({v})" for k, v in sorted(sources.items()))
        if unscaled:
            line += f"; {unscaled} {'has' if unscaled == 1 else 'have'} no input scale to calibrate"
        return line

    @property
    def mean_sqnr_db(self) -> float | None:
        values = [
            layer_report.sqnr_db
            for layer_report in self.layers
            if layer_report.sqnr_db is not None and math.isfinite(layer_report.sqnr_db)
        ]
        return sum(values) / len(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_json(self, path: str | Path) -> Path:
        """Write the report as JSON, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    def sqnr_figure(self, min_layer_sqnr_db: float | None = None) -> Any:
        """A matplotlib Figure of per-layer SQNR (integer layer ticks, at most :data:`MAX_LAYER_TICKS`), with a
        horizontal line at the recipe's ``[fallback] min_layer_sqnr_db`` when given (the layers under it were
        recalibrated), else at :data:`REFERENCE_SQNR_DB` (labelled a reference), and a subtitle saying what each
        layer's inputs were (:data:`PROPAGATE_MEANING`). ImportError without matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [layer_report.index for layer_report in self.layers if layer_report.sqnr_db is not None]
        ys = [layer_report.sqnr_db for layer_report in self.layers if layer_report.sqnr_db is not None]
        fig, ax = plt.subplots(figsize=(8, 3.8))
        ax.plot(xs, ys, marker="o")
        ax.xaxis.set_major_locator(layer_locator())  # layers are whole numbers, also for 2 of them
        ax.axhline(**_threshold_line(min_layer_sqnr_db))
        ax.legend(fontsize=8, loc="lower left")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("output SQNR (dB)")
        inputs = PROPAGATE_MEANING.get(self.propagate, self.propagate)
        ax.set_title(
            f"{self.recipe}: per-layer output SQNR\ninputs: {inputs} (propagate={self.propagate})", fontsize=10
        )
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def save_plot(self, path: str | Path, min_layer_sqnr_db: float | None = None) -> Path | None:
        """A PNG of per-layer SQNR (:meth:`sqnr_figure`: ``min_layer_sqnr_db`` is the recipe's fallback threshold),
        written atomically with the umask's permissions; None (nothing written) when matplotlib is not installed."""
        try:
            fig = self.sqnr_figure(min_layer_sqnr_db)
        except ImportError:
            return None
        return save_figure(fig, path)


#: The SQNR plot's line when the recipe sets no ``[fallback] min_layer_sqnr_db``: a reference, not a rule (8-bit
#: formats usually stay above it; a layer far under it is worth a look).
REFERENCE_SQNR_DB = 30.0
#: The per-layer SQNR plot's file name in an export directory (written beside the export by the pipeline).
SQNR_PLOT_NAME = "calibration_sqnr.png"
#: What ``propagate`` means for the SQNR plot's subtitle: the inputs each layer was calibrated and measured on.
PROPAGATE_MEANING = {
    "fp": "full-precision outputs of the previous layer",
    "qdq": "quantized outputs of the previous layer",
}
#: The most layer labels a plot's axis shows (thinned to integer steps beyond it).
MAX_LAYER_TICKS = 12


def layer_locator() -> Any:
    """A matplotlib tick locator for decoder-layer axes: integers only, at most :data:`MAX_LAYER_TICKS` of them."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(nbins=MAX_LAYER_TICKS - 1, integer=True, min_n_ticks=1)


def _threshold_line(min_layer_sqnr_db: float | None) -> dict[str, Any]:
    """``axhline`` keywords: the fallback threshold, or the reference line."""
    if min_layer_sqnr_db is not None:
        label = f"fallback threshold {min_layer_sqnr_db:g} dB (layers under it recalibrated)"
        return {"y": min_layer_sqnr_db, "color": "tab:red", "linestyle": "--", "label": label}
    label = f"{REFERENCE_SQNR_DB:g} dB reference (the recipe sets no fallback)"
    return {"y": REFERENCE_SQNR_DB, "color": "tab:gray", "linestyle": ":", "label": label}


def amax_summary(amax: torch.Tensor | None) -> dict[str, Any]:
    if amax is None:
        return {"dynamic": True}
    a = amax.detach().float().cpu()
    return {"amax": float(a.max()), "amax_mean": float(a.mean()), "shape": list(a.shape)}


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a matplotlib figure as a PNG, atomically with the umask's permissions, and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return path
