"""What a calibration run measured: per-layer time, output SQNR, and every quantizer's amax."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .fsutil import atomic_path, atomic_write_text


@dataclass
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


@dataclass
class CalibrationReport:
    recipe: str
    propagate: str
    world_size: int
    num_batches: int
    num_tokens: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from_layer: int = 0

    @property
    def group_sizes(self) -> dict[str, int | str]:
        """Every Linear whose weight group size differs from the recipe's, with the size used (all layers)."""
        return {name: size for layer in self.layers for name, size in layer.group_sizes.items()}

    @property
    def fallback_layers(self) -> list[str]:
        """Names of the decoder layers recalibrated with the recipe's ``[fallback]``."""
        return [layer.name for layer in self.layers if layer.scheme == "fallback"]

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

    def save_plot(self, path: str | Path) -> Path | None:
        """A PNG of per-layer SQNR; None (nothing written) when matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        path = Path(path)
        xs = [layer_report.index for layer_report in self.layers if layer_report.sqnr_db is not None]
        ys = [layer_report.sqnr_db for layer_report in self.layers if layer_report.sqnr_db is not None]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(xs, ys, marker="o")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("output SQNR (dB)")
        ax.set_title(f"{self.recipe}: per-layer output SQNR (propagate={self.propagate})")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        try:
            with atomic_path(path, suffix=".png") as tmp:
                fig.savefig(tmp, dpi=100)
        finally:
            plt.close(fig)
        return path


def amax_summary(amax: torch.Tensor | None) -> dict[str, Any]:
    if amax is None:
        return {"dynamic": True}
    a = amax.detach().float().cpu()
    return {"amax": float(a.max()), "amax_mean": float(a.mean()), "shape": list(a.shape)}
