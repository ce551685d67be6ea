"""The whole prediction of a calibration (:class:`CalibrationPlan`: the model, every rank's memory, the traffic, the
disk), made from a read model source and a recipe for given settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe
from ..errors import UsageError
from .disk import checkpoint_dir_bytes, export_files
from .memory import RankPlan, rank_plan
from .prepared import PlannedRun, PreparedModel
from .settings import PlanSettings
from .source import ModelSource
from .traffic import traffic


@dataclass(kw_only=True)
class CalibrationPlan:
    """The whole prediction; :meth:`to_dict` is what ``shardcal plan --json`` prints."""

    model: dict[str, Any]
    recipe: str
    algorithm: str
    settings: PlanSettings
    ranks: list[RankPlan]
    io: dict[str, int]
    disk: dict[str, int]
    time: dict[str, Any] | None = None

    @property
    def peak_rank(self) -> RankPlan:
        """The rank with the highest peak (the first of them)."""
        return max(self.ranks, key=lambda r: (r.peak, -r.rank))

    @property
    def peak_bytes_per_rank(self) -> int:
        """The highest peak of any rank."""
        return self.peak_rank.peak

    def node_ranks(self, first: int = 0) -> list[RankPlan]:
        """The ranks of the node whose first rank is ``first`` (``local_world_size`` consecutive ranks)."""
        return self.ranks[first : first + self.settings.local]

    def to_dict(self) -> dict[str, Any]:
        """What ``shardcal plan --json`` prints."""
        s, peak = self.settings, self.peak_rank
        out = {
            "model": dict(self.model),
            "recipe": self.recipe,
            "algorithm": self.algorithm,
            "world_size": s.world_size,
            "ranks_per_node": s.local,
            "device": s.device,
            "cpu_offload": s.cpu_offload,
            "offload_activations": s.offload_activations,
            "shard_root": s.shard_root,
            "data": {
                "num_samples": s.num_samples,
                "seq_len": s.seq_len,
                "batch_size": s.options.batch_size,
                "num_batches": -(-s.num_samples // s.options.batch_size),
            },
            "peak_bytes_per_rank": peak.peak,
            "peak_rank": peak.rank,
            "peak_phase": peak.peak_phase,
            "required_bytes_per_rank": max(r.required for r in self.ranks),
            "host_peak_bytes_per_rank": max(r.host_peak for r in self.ranks),
            "parts": dict(peak.parts),
            "largest_gathered_unit": peak.largest_unit,
            "io": dict(self.io),
            "disk": dict(self.disk),
            "ranks": [r.to_dict() for r in self.ranks],
        }
        if self.time is not None:
            out["time"] = dict(self.time)
        return out


def plan_prepared(prepared: PreparedModel, settings: PlanSettings, model_dir: str | Path | None = None,
                  full: bool = True) -> CalibrationPlan:  # fmt: skip
    """The plan of a :class:`PreparedModel` for ``settings`` (``full=False``: no disk figures, which need every
    stored tensor's header)."""
    if settings.shard_root != prepared.shard_root:
        raise UsageError("settings.shard_root differs from the prepared model's")
    m = PlannedRun(prepared, settings)
    st = prepared.st
    model = {
        "dir": str(model_dir) if model_dir is not None else None,
        "model_type": st.model_type,
        "layers": st.num_layers,
        "parameters": prepared.numel,
        "parameter_bytes": prepared.nbytes,
        "dtype": str(prepared.dtype).removeprefix("torch."),
    }
    disk: dict[str, int] = {}
    if full:
        files = export_files(m)
        disk = {
            "export_bytes": sum(size for _, size in files),
            "export_files": len(files),
            "checkpoint_dir_bytes": checkpoint_dir_bytes(m),
        }
    return CalibrationPlan(
        model=model,
        recipe=prepared.recipe.name,
        algorithm=prepared.algorithm.get("name", "rtn"),
        settings=settings,
        ranks=[rank_plan(m, r) for r in range(settings.world_size)],
        io=traffic(m),
        disk=disk,
    )


def plan_source(source: ModelSource, recipe: str | Path | Recipe, settings: PlanSettings | None = None,
                model_dir: str | Path | None = None, dtype: torch.dtype | str | None = None) -> CalibrationPlan:  # fmt: skip
    """The plan for an already read :class:`ModelSource` (see :func:`~.planner.plan_calibration`)."""
    settings = settings or PlanSettings()
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    plan = plan_prepared(PreparedModel(source, recipe, settings.shard_root, dtype), settings, model_dir)
    plan.model["checkpoint_bytes"] = source.checkpoint_bytes
    plan.model["source"] = "config.json" if source.file_dtypes is None else "config.json + safetensors headers"
    return plan
