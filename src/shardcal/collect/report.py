"""What activation collection measured: per target and channel statistics, saved as JSON + safetensors, and a plot.

:func:`shardcal.collect_activations` returns an :class:`ActivationReport`: one :class:`TargetStats` per observed
tensor (``"model.layers.3.mlp.down_proj:input"``), identical on every rank and at every world size.
``report.save(out_dir)`` writes ``activation_report.json`` (what was collected, on which model and data, and per
target its token count, largest channels and summary numbers) and ``activation_stats.safetensors`` (the per-channel
tensors, keyed ``"<target>/<statistic>"``); :meth:`ActivationReport.load` reads them back. ``save_plot`` draws the
per-layer absmax of each target pattern and a heatmap of the largest channels.

The report also carries the fingerprint of the model (config, shapes and an exact checksum of the weights, the same
for any sharding) and of the data batches, which :func:`shardcal.calibrate` checks before reusing the statistics
(see :func:`model_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..calib.report import MAX_LAYER_TICKS, layer_locator, save_figure
from ..errors import CollectionError
from ..layerwise.batches import Batch, data_fingerprint
from ..runtime.distributed import all_reduce_, dp_group, world
from ..runtime.fsutil import atomic_path, atomic_write_text, read_json_object

#: The statistics a collection can keep per target (absmax and the token count are always kept).
STATS = ("absmax", "mean", "meansq", "histogram")
#: Histogram bins: the percentile observer's default, so that a report can stand in for its passes.
DEFAULT_BINS = 2048
#: How many of the largest channels (by absmax) each target lists.
DEFAULT_TOP_K = 8
REPORT_JSON = "activation_report.json"
STATS_FILE = "activation_stats.safetensors"
FORMAT = "shardcal-activation-report"
FORMAT_VERSION = 1
#: Per-target tensors in the safetensors file, and their dtypes.
TENSOR_STATS = {"absmax": torch.float32, "mean": torch.float64, "meansq": torch.float64, "histogram": torch.int64}


@dataclass(kw_only=True)
class TargetStats:
    """Statistics of one observed tensor over every real (unpadded) token of the data, merged over all ranks.

    Per channel (the tensor's last dimension): ``absmax`` (float32, max ``|x|``), ``mean`` and ``meansq`` (float64,
    the mean of ``x`` and of ``x**2``; ``variance`` follows). ``histogram`` (int64 ``[bins]``): counts of ``|x|`` over
    all channels in ``bins`` equal bins over ``[0, hist_range]``, ``hist_range`` being the largest absmax (exactly
    the percentile observer's histogram of a per-tensor quantizer). ``top_channels``: ``(channel, absmax)`` of the
    largest channels, largest first (the lower channel first on a tie).
    """

    name: str
    pattern: str
    layer: int
    channels: int
    tokens: int
    absmax: torch.Tensor
    mean: torch.Tensor | None = None
    meansq: torch.Tensor | None = None
    histogram: torch.Tensor | None = None
    top_channels: list[tuple[int, float]] = field(default_factory=list)

    @property
    def module(self) -> str:
        return self.name.rpartition(":")[0]

    @property
    def tensor(self) -> str:
        return self.name.rpartition(":")[2]

    @property
    def hist_range(self) -> float:
        """The histogram's upper edge: the largest channel absmax (0.0 when no token was seen)."""
        return float(self.absmax.max()) if self.absmax.numel() else 0.0

    @property
    def variance(self) -> torch.Tensor | None:
        """Per-channel population variance ``meansq - mean**2`` (float64, clamped at 0), when both were kept."""
        if self.mean is None or self.meansq is None:
            return None
        return (self.meansq - self.mean.square()).clamp_(min=0.0)

    def summary(self) -> dict[str, Any]:
        """The JSON part: everything but the per-channel tensors."""
        a = self.absmax.double()
        return {
            "name": self.name,
            "pattern": self.pattern,
            "layer": self.layer,
            "channels": self.channels,
            "tokens": self.tokens,
            "absmax": float(a.max()) if a.numel() else 0.0,
            "absmax_median": float(a.median()) if a.numel() else 0.0,
            "top_channels": [[c, v] for c, v in self.top_channels],
        }

    @classmethod
    def from_saved(cls, summary: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TargetStats:
        """Inverse of :meth:`summary` + :meth:`tensors` (a ``KeyError``/``TypeError``/``ValueError`` when incomplete)."""
        name = summary["name"]
        values = {stat: tensors.get(f"{name}/{stat}") for stat in TENSOR_STATS}
        if values["absmax"] is None:
            raise KeyError(f"{name}/absmax")
        return cls(
            name=name, pattern=str(summary["pattern"]), layer=int(summary["layer"]), channels=int(summary["channels"]),
            tokens=int(summary["tokens"]), top_channels=[(int(c), float(v)) for c, v in summary["top_channels"]],
            **values,
        )  # fmt: skip

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"{self.name}/{stat}": getattr(self, stat).to(dtype).contiguous()
            for stat, dtype in TENSOR_STATS.items()
            if getattr(self, stat) is not None
        }


def top_channels(absmax: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` channels with the largest absmax, largest first; the lower channel first on a tie."""
    order = torch.sort(absmax.float().cpu(), descending=True, stable=True)
    return [(int(i), float(v)) for v, i in zip(order.values[:k], order.indices[:k])]


@dataclass(kw_only=True)
class ActivationReport:
    """What :func:`shardcal.collect_activations` measured; see the module docstring. ``report[name]`` is a target's
    :class:`TargetStats`."""

    targets: dict[str, TargetStats]
    patterns: list[str]
    stats: list[str]
    bins: int
    top_k: int
    batch_size: int
    world_size: int
    num_samples: int
    num_tokens: int
    fingerprint: dict[str, str]
    save_dir: str | None = None
    seconds: float = 0.0
    resumed_from_layer: int = 0

    def __getitem__(self, name: str) -> TargetStats:
        if name not in self.targets:
            raise KeyError(f"{name!r} is not a collected target (have: {', '.join(list(self.targets)[:4])}, ...)")
        return self.targets[name]

    def __contains__(self, name: object) -> bool:
        return name in self.targets

    def of_pattern(self, pattern: str) -> list[TargetStats]:
        """The targets a pattern selected, in layer order."""
        return [t for t in self.targets.values() if t.pattern == pattern]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "patterns": list(self.patterns),
            "stats": list(self.stats),
            "bins": self.bins,
            "top_k": self.top_k,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "fingerprint": dict(self.fingerprint),
            "save_dir": self.save_dir,
            "seconds": self.seconds,
            "resumed_from_layer": self.resumed_from_layer,
            "targets": [t.summary() for t in self.targets.values()],
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``activation_report.json`` and ``activation_stats.safetensors`` into ``out_dir`` (atomically)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.cpu() for t in self.targets.values() for k, v in t.tensors().items()}
        with atomic_path(out / STATS_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT})
        atomic_write_text(out / REPORT_JSON, json.dumps(self.to_dict(), indent=1))
        return out

    @classmethod
    def load(cls, path: str | Path) -> ActivationReport:
        """A report saved by :meth:`save` (``path``: its directory or its JSON file)."""
        path = Path(path)
        directory = path if path.is_dir() else path.parent
        meta = read_json_object(directory / REPORT_JSON, CollectionError)
        where = directory / REPORT_JSON
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise CollectionError(f"{where}: not a shardcal activation report (format version {FORMAT_VERSION})")
        try:
            with safe_open(str(directory / STATS_FILE), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:
            raise CollectionError(f"{directory / STATS_FILE}: unreadable ({' '.join(str(exc).split())})") from None
        try:
            targets = {e["name"]: TargetStats.from_saved(e, tensors) for e in meta["targets"]}
            return cls(
                targets=targets,
                **{k: meta[k] for k in ("patterns", "stats", "bins", "top_k", "batch_size", "world_size")},
                **{k: meta[k] for k in ("num_samples", "num_tokens", "fingerprint", "save_dir", "seconds")},
                resumed_from_layer=meta["resumed_from_layer"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CollectionError(f"{where}: corrupt activation report (missing or bad {exc})") from None

    def save_plot(self, path: str | Path) -> Path | None:
        """A PNG of :meth:`activation_figure`, written atomically; None (nothing written) when matplotlib is not
        installed."""
        try:
            fig = self.activation_figure()
        except ImportError:
            return None
        return save_figure(fig, path)

    def activation_figure(self) -> Any:
        """A matplotlib Figure: per-layer absmax of each target pattern, and per pattern a heatmap of its largest
        channels' absmax (layers x the ``HEATMAP_CHANNELS`` channels with the largest absmax in any layer). Layer
        axes carry integer labels, at most :data:`~shardcal.calib.report.MAX_LAYER_TICKS` of them (thinned evenly
        on deep models). ImportError without matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm

        maps = [(p, m) for p in self.patterns if (m := self.layer_channel_absmax(p)) is not None][:MAX_HEATMAPS]
        fig, axes = plt.subplots(1 + len(maps), 1, figsize=(10, 3.2 + 2.8 * len(maps)), squeeze=False)
        ax = axes[0][0]
        for pattern in self.patterns:
            per_layer = self.layer_absmax(pattern)
            ax.plot(list(per_layer), list(per_layer.values()), marker="o", markersize=3, label=pattern)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(layer_locator())
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("absmax")
        ax.set_title(f"per-layer absmax ({self.num_samples} samples, {self.num_tokens} tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        for (pattern, (layers, channels, values)), row in zip(maps, axes[1:]):
            ax = row[0]
            positive = values[values > 0]
            norm = LogNorm(vmin=float(positive.min()), vmax=float(positive.max())) if positive.numel() else None
            image = ax.imshow(values.clamp(min=1e-12).numpy(), aspect="auto", cmap="viridis", norm=norm)
            ax.set_xticks(range(len(channels)), [str(c) for c in channels], rotation=90, fontsize=6)
            rows = thinned_rows(len(layers))
            ax.set_yticks(rows, [str(layers[i]) for i in rows], fontsize=7)
            ax.set_xlabel("channel (the largest)")
            ax.set_ylabel("layer")
            ax.set_title(f"{pattern}: absmax of its largest channels", fontsize=9)
            fig.colorbar(image, ax=ax)
        fig.tight_layout()
        return fig

    def layer_absmax(self, pattern: str) -> dict[int, float]:
        """Layer -> the largest absmax of the pattern's targets in that layer."""
        out: dict[int, float] = {}
        for t in self.of_pattern(pattern):
            out[t.layer] = max(out.get(t.layer, 0.0), t.hist_range)
        return out

    def layer_channel_absmax(self, pattern: str, channels: int | None = None) -> tuple | None:
        """``(layers, channel ids, absmax [layers, channels])`` for the pattern's ``channels`` (default
        :data:`HEATMAP_CHANNELS`) largest channels; several targets in one layer combine by max. None when its
        targets differ in channel count."""
        targets = self.of_pattern(pattern)
        if not targets or len({t.channels for t in targets}) != 1:
            return None
        layers = sorted({t.layer for t in targets})
        rows = torch.zeros(len(layers), targets[0].channels)
        for t in targets:
            i = layers.index(t.layer)
            rows[i] = torch.maximum(rows[i], t.absmax.float().cpu())
        k = min(channels or HEATMAP_CHANNELS, rows.shape[1])
        chosen = torch.sort(rows.amax(dim=0), descending=True, stable=True).indices[:k].sort().values
        return layers, [int(c) for c in chosen], rows[:, chosen]


#: Heatmaps show this many channels, and at most this many patterns get one.
HEATMAP_CHANNELS = 32


def thinned_rows(count: int, most: int = MAX_LAYER_TICKS) -> list[int]:
    """Row positions to label among ``count`` heatmap rows: every one up to ``most``, else every k-th (the
    smallest whole step that keeps at most ``most`` labels), starting at row 0."""
    step = max(1, -(-count // most))
    return list(range(0, count, step))


MAX_HEATMAPS = 4


# ----------------------------------------------------------------------------------------------- fingerprints


def json_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as non-negative integers (int64), whatever its dtype."""
    t = t.detach().contiguous().reshape(-1)
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    bits = t.view(as_int).to(torch.int64)
    return bits & ((1 << (8 * size)) - 1) if size < 8 else bits


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """The model's identity, the same however it is sharded: a digest of its config and parameter shapes, and one of
    an exact checksum of its weights (per parameter, the sum of its elements' raw bits: integer sums, so any split of
    a parameter over ranks gives the same value). Collective under torch.distributed."""
    from torch.distributed.tensor import DTensor

    config = getattr(model, "config", None)
    raw = getattr(config, "raw", None) or {}
    named = list(model.named_parameters())
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in named]
    sums = torch.zeros(max(len(named), 1), dtype=torch.int64)
    for i, (_, p) in enumerate(named):
        local = p.to_local() if isinstance(p, DTensor) else p
        if (isinstance(p, DTensor) or world()[0] == 0) and local.numel():
            sums[i] = int(_bits(local).sum().item())
    all_reduce_(sums, "sum", dp_group())
    return {
        "model": json_digest({"config": {k: v for k, v in raw.items() if k != "architectures"}, "params": shapes}),
        "model_weights": json_digest(sums.tolist()),
    }


def run_fingerprint(model: nn.Module, batches: list[Batch]) -> dict[str, str]:
    """Model and data: what a report's statistics depend on (not the world size). Collective."""
    return {**model_fingerprint(model), "data": data_fingerprint(batches)}


def check_fingerprint(report: ActivationReport, fingerprint: dict[str, str], what: str) -> None:
    """Refuse a report collected on another model or data than ``fingerprint`` describes."""
    labels = {"model": "model (config or shapes)", "model_weights": "model weights", "data": "data or batch size"}
    for key, label in labels.items():
        if report.fingerprint.get(key) != fingerprint.get(key):
            raise CollectionError(
                f"{what}: the report was collected on a different {label} (report {str(report.fingerprint.get(key))[:12]}, "
                f"this run {str(fingerprint.get(key))[:12]}); collect on the same model, data and batch_size"
            )
