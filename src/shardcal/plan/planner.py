"""Plan before you load: per-rank memory, disk reads, all-gather volume and disk space of a calibration, predicted
from ``config.json``, the safetensors headers and the model built on the meta device (no weight is read; shardcal's
classes and transformers' alike, :mod:`.structure`), so that ``shardcal calibrate`` can
refuse a run that would run out of memory before it loads anything.

What one rank holds during ``shardcal calibrate`` (load, calibrate, export), and how the plan counts it:

* **parameter shards**: every parameter sharded dim-0 over N ranks as FSDP2 does (``ceil(rows / N)`` rows on
  every rank, padding included); parameters off the model's dtype (a float32 router) and, with
  ``shard_root=False``, everything outside the decoder stack stay whole on every rank;
* **one gathered unit** (a decoder layer, the root's embeddings / norm / tied head, an untied ``lm_head`` at
  export): held whole while it is used, and twice for the moment of the all-gather (FSDP2's flat all-gather
  buffer beside the per-parameter copies) when N >= 2;
* **the activation cache**: this rank's whole batches (``rank_batch_indices``) × seq × hidden, twice (the current
  layer's inputs and outputs), plus the rotary tables (cos, sin) of every batch; in host memory on a GPU; twice
  more for an algorithm that reads the full-precision stream (GPTQ's ``stream_correction``: its inputs and outputs);
* **one batch's intermediates** while a layer runs on it (attention or MLP, computed as float32 where fake
  quantization and RMSNorm compute), and the fake-quantized copy of the largest weight;
* **quantizer state** (every calibrated amax, kept for all layers, on every rank) and one layer's observers, and the
  observer's work on the largest weight while weight scales are calibrated;
* **algorithm state** of one layer: GPTQ's Hessians (one ``[in, in]`` exact sum in two float64 limbs, 16 bytes per
  element, per quantized Linear, all at once) and the float64 solve of one of them; AWQ's Gram matrices and clip
  Hessians; SmoothQuant's maxima (and token samples with ``alpha_grid``);
* **export buffers**: the encoded tensors of the largest quantized Linear a rank writes;
* while loading, the checkpoint pages this rank maps (its own rows: resident, but reclaimable page cache);
* a fixed runtime allowance (module objects, FSDP2 state, thread pools).

The sizes of the parts are exact functions of the shapes; the factors for temporaries (how many float32 copies of a
batch or a weight an operation makes) were measured on the real code and are the ``*_BYTES`` / ``*_COPIES``
constants of :mod:`.costs` (the algorithms' own with their memory models, :mod:`shardcal.algorithms.memory`); the
planner is held to measured peaks by ``benchmarks/plan_accuracy.py`` and ``tests/plan/``. Phases (load, embed, layers,
export) add up what is alive at the same time; the peak is the largest phase. A decoder layer's steps are the passes
the runner's own plan for it runs (:func:`shardcal.calib.layer_calibration.predicted_pass_plan`). See docs/scaling.md.

This module is the planner's entry point; each concept lives in a module of its own: what is read of the model
(:mod:`.source`), the recipe's quantizers (:mod:`.quantizers`), the measured constants (:mod:`.costs`), the model
grouped and sized for a run (:mod:`.prepared`), one rank's memory (:mod:`.memory`), the traffic (:mod:`.traffic`) and
the disk (:mod:`.disk`), the whole plan (:mod:`.calibration_plan`), whether it fits (:mod:`.fit`) and its text
(:mod:`.render`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe
from ..errors import ConfigError, PlanError
from ..layerwise.options import CalibrationOptions
from ..loading.foreign import build_transformers_on_meta, choose_impl
from ..models.config import load_config
from .calibration_plan import CalibrationPlan, plan_prepared, plan_source
from .fit import Budget, Shortfall, cheapest_fix, local_budget, parse_bytes, refusal_message, shortfall
from .memory import RankPlan
from .prepared import PreparedModel, batch_rows
from .render import fmt_bytes, format_plan, growth_line
from .settings import PlanSettings
from .source import ModelSource, Param, model_tensors, read_source

__all__ = [
    "Budget",
    "CalibrationPlan",
    "ModelSource",
    "Param",
    "PlanSettings",
    "PreparedModel",
    "RankPlan",
    "Shortfall",
    "batch_rows",
    "cheapest_fix",
    "check_before_loading",
    "check_plannable",
    "fmt_bytes",
    "format_plan",
    "growth_line",
    "load_recipe",
    "local_budget",
    "model_tensors",
    "parse_bytes",
    "plan_calibration",
    "plan_prepared",
    "plan_source",
    "plannable",
    "read_source",
    "refusal_message",
    "shortfall",
]


def plan_calibration(model_dir: str | Path, recipe: str | Path | Recipe, settings: PlanSettings | None = None,
                     dtype: torch.dtype | str | None = None, impl: str = "auto") -> CalibrationPlan:  # fmt: skip
    """Predict what ``shardcal calibrate MODEL_DIR --recipe RECIPE`` holds on each rank, reading only
    ``config.json`` and the safetensors headers (or only ``config.json`` when there are no weights).

    Bad input raises what ``calibrate`` raises (:class:`~shardcal.errors.ConfigError`, ``CheckpointError``,
    ``RecipeError``), before anything is loaded. ``settings`` (:class:`PlanSettings`): ranks, data, device;
    ``impl``: the model class, as ``--model-impl`` chooses it (``auto``: shardcal's when it has one, else
    transformers').
    """
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    return plan_source(read_source(model_dir, dtype, impl), recipe, settings, model_dir, dtype)


def plannable(model_dir: str | Path, impl: str = "auto") -> bool:
    """Whether the planner can plan ``model_dir``'s model with ``impl`` (``--model-impl``): shardcal's classes
    always; a model type only transformers has, when transformers can build it (on the meta device)."""
    try:
        check_plannable(model_dir, impl)
    except (ConfigError, PlanError):
        return False
    return True


def check_plannable(model_dir: str | Path, impl: str = "auto") -> None:
    """Raise :class:`~shardcal.errors.ConfigError` (one line) when the model cannot be built for planning: its
    config unreadable, or a type shardcal has no class for without transformers to build it."""
    if choose_impl(model_dir, impl) == "transformers":
        build_transformers_on_meta(model_dir)
    else:
        load_config(model_dir)


def check_before_loading(
    model_dir: str | Path,
    recipe: Recipe,
    data_shape: tuple[int, int],
    options: CalibrationOptions,
    *,
    cpu_offload: bool = False,
    shard_root: bool = True,
    impl: str = "auto",
    streamed: bool = False,
) -> CalibrationPlan:
    """Plan this rank's calibration and stop every rank before anything is loaded when it does not fit.

    Collective (every rank calls it; one small all-gather decides). Each rank checks its own device's free memory
    and its node's host memory for the node's ranks together (``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun
    and ``--nproc-per-node`` place them). Raises :class:`~shardcal.errors.InsufficientMemoryError` with one line:
    the predicted and available bytes and the cheapest fix. Returns the plan when it fits.
    """
    import os

    from ..errors import InsufficientMemoryError
    from ..runtime.distributed import broadcast_string, ranks_with_flag, world

    rank, size = world()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local = min(max(1, int(os.environ.get("LOCAL_WORLD_SIZE", size))), size)
    node_first = rank - min(int(os.environ.get("LOCAL_RANK", rank % local)), rank)
    settings = PlanSettings(
        world_size=size, local_world_size=local, num_samples=int(data_shape[0]), seq_len=int(data_shape[1]),
        device=device, cpu_offload=cpu_offload, shard_root=shard_root, options=options, streamed=streamed,
    )  # fmt: skip
    source = read_source(model_dir, impl=impl)
    plan = plan_source(source, recipe, settings, model_dir)
    budget = local_budget(device)
    short = shortfall(plan, budget, rank=rank, node_first=min(node_first, max(0, size - local)))
    refused = ranks_with_flag(short is not None)
    if refused:
        message = ""
        if short is not None and rank == refused[0]:
            message = refusal_message(plan, short, cheapest_fix(source, recipe, settings, budget))
        raise InsufficientMemoryError(broadcast_string(message, src=refused[0]))
    return plan
