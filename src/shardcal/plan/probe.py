"""How long a calibration will take, from a short probe: one decoder layer calibrated on one batch and on three.

The probe builds a one-layer model with the checkpoint's own layer weights (random ones when the directory has only
``config.json``), runs the real :func:`shardcal.calibrate` on it with one batch and with three, and fits
``t(batches) = fixed + per_batch * batches``: ``fixed`` is what a layer costs whatever the data (weight scales,
algorithm solves, the SQNR batch), ``per_batch`` what each cached batch adds (observing passes, statistics,
propagation). The estimate for the whole run is, summed over the decoder layers (each layer structure probed once),
``fixed + per_batch * (batches on the busiest rank)``: ranks calibrate their batches in parallel.

On CPU the probe runs with the threads one rank will have (cores / ranks per node), as the launcher gives them.
Wall-clock seconds assume the machine as busy as during the probe; the CPU seconds the probe's process used
(``cpu_seconds_per_rank``) are the work of a one-thread rank, and what to compare on a machine that other jobs
share — with more threads than free cores they grow with the load too (spinning OpenMP threads).
Not counted: loading, the embedding pass, gathers and merges across ranks, export; GPTQ's solves are counted as
if one rank did them all (with N ranks they are shared, so the estimate is an upper bound there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe
from ..calib.runner import calibrate
from ..layerwise.batches import rank_batch_indices
from ..loading.build import build_on_meta
from ..models.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointReader
from ..models.config import ModelConfig
from ..models.decoder import CausalLM
from .calibration_plan import CalibrationPlan
from .prepared import batch_rows
from .settings import PlanSettings

#: Vocabulary of the probe model: its embeddings only feed the probed layer (calibrate never runs the head).
PROBE_VOCAB = 64
#: Timed repeats of each probe run (their mean counts); one untimed run first warms kernels and allocator.
PROBE_REPEATS = 2


def _probe_config(cfg: ModelConfig, layer: int) -> ModelConfig:
    """A one-layer config whose layer 0 is built like ``cfg``'s layer ``layer`` (dense or sparse, its window)."""
    raw = dict(cfg.raw, num_hidden_layers=1, vocab_size=PROBE_VOCAB, tie_word_embeddings=True)
    raw.pop("quantization_config", None)
    if cfg.is_moe and cfg.model_type != "mixtral":
        raw.update(decoder_sparse_step=1, mlp_only_layers=[] if cfg.layer_is_sparse(layer) else [0])
    if cfg.layer_types:
        raw["layer_types"] = [cfg.layer_types[layer]]
        raw.setdefault("max_window_layers", 0 if cfg.layer_sliding_window(layer) is not None else 1)
    return ModelConfig.from_dict(raw, source=f"{cfg.model_type} probe of layer {layer}")


def _fill(model: CausalLM, model_dir: Path | None, layer: int, seed: int = 0) -> None:
    """The probe layer's weights from the checkpoint (``model.layers.<layer>.*``), else random; random embeddings."""
    reader = None
    if model_dir is not None and ((model_dir / INDEX_NAME).is_file() or (model_dir / SINGLE_NAME).is_file()):
        reader = CheckpointReader(model_dir)
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                source = name.replace("model.layers.0.", f"model.layers.{layer}.", 1)
                if reader is not None and name.startswith("model.layers.0.") and source in reader:
                    p.copy_(reader.get(source))
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator).mul_(0.02))
    finally:
        if reader is not None:
            reader.close()


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _seconds(
    model: CausalLM, recipe: Recipe, rows: int, seq_len: int, batches: int, plan: PlanSettings
) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of calibrating the probe model on ``batches`` batches, the mean of the repeats."""
    ids = torch.randint(0, PROBE_VOCAB, (rows * batches, seq_len), generator=torch.Generator().manual_seed(1))
    options = plan.options.replace(batch_size=rows, progress=False, checkpoint_dir=None, report_path=None)
    wall = cpu = 0.0
    for _ in range(PROBE_REPEATS):  # a calibrated layer is calibrated again: the same work (its quantizers exist)
        start, start_cpu = time.perf_counter(), time.process_time()
        calibrate(model, ids, recipe, options)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    return wall / PROBE_REPEATS, cpu / PROBE_REPEATS


def _fit(one: float, three: float) -> tuple[float, float]:
    """``(fixed, per_batch)`` of ``t(b) = fixed + per_batch * b`` through ``t(1)`` and ``t(3)``."""
    per_batch = max((three - one) / 2, 0.0)
    return max(one - per_batch, 0.0), per_batch


def probe_layer(
    cfg: ModelConfig, model_dir: Path | None, layer: int, recipe: Recipe, settings: PlanSettings, device: str
) -> dict[str, tuple[float, float]]:
    """``{"wall": (fixed, per_batch), "cpu": (fixed, per_batch)}`` seconds of calibrating ``cfg``'s layer
    ``layer`` (see the module docstring); ``cpu`` is the process's CPU time (all its threads)."""
    probe_cfg = _probe_config(cfg, layer)
    model = build_on_meta(probe_cfg, cfg.torch_dtype or torch.float32).to_empty(device="cpu")
    model.tie_weights()
    _fill(model, model_dir, layer)
    model = model.to(device).eval()
    rows = min(settings.options.batch_size, settings.num_samples)
    calibrate(model, torch.zeros(1, min(settings.seq_len, 16), dtype=torch.long), recipe,
              settings.options.replace(batch_size=1, progress=False, checkpoint_dir=None, report_path=None))  # fmt: skip
    one = _seconds(model, recipe, rows, settings.seq_len, 1, settings)
    three = _seconds(model, recipe, rows, settings.seq_len, 3, settings)
    return {"wall": _fit(one[0], three[0]), "cpu": _fit(one[1], three[1])}


def _layer_kinds(cfg: ModelConfig) -> dict[tuple[Any, ...], list[int]]:
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        kinds.setdefault((cfg.layer_is_sparse(i), cfg.layer_sliding_window(i)), []).append(i)
    return kinds


def estimate_time(
    cfg: ModelConfig,
    recipe: str | Path | Recipe,
    settings: PlanSettings,
    model_dir: str | Path | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Probe each layer structure once and extrapolate the calibration time over layers and batches.

    Returns ``calibrate_seconds`` (the estimate for ``calibrate()``, as busy a machine as during the probe assumed),
    ``layer_seconds`` (per layer, the busiest rank), ``fixed_seconds``, ``batch_seconds``, ``batches_per_rank``,
    ``cpu_seconds_per_rank`` (the CPU time the busiest rank's process needs, all its threads; gathers across
    ranks not counted), ``probe_seconds`` (what the probe took), ``probe_device`` and ``probe_threads``.
    """
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    device = device or settings.device
    if device == "cuda" and not torch.cuda.is_available():
        from ..errors import UsageError

        raise UsageError(
            "--probe on cuda needs a GPU here; probe with --device cpu, or run the probe where the GPUs are"
        )
    threads = max(1, (os.cpu_count() or 1) // settings.local) if device == "cpu" else torch.get_num_threads()
    rows = batch_rows(settings.num_samples, settings.options.batch_size)
    busiest = max(len(rank_batch_indices(len(rows), r, settings.world_size)) for r in range(settings.world_size))
    folder = Path(model_dir) if model_dir is not None else None
    start = time.perf_counter()
    sums = {"wall": [0.0, 0.0], "cpu": [0.0, 0.0]}  # (fixed, per_batch) summed over the layers
    with _threads(threads):
        for layers in _layer_kinds(cfg).values():
            for key, (fixed, per_batch) in probe_layer(cfg, folder, layers[0], recipe, settings, device).items():
                sums[key][0] += len(layers) * fixed
                sums[key][1] += len(layers) * per_batch
    probe_seconds = time.perf_counter() - start
    n = cfg.num_hidden_layers
    (fixed, per_batch), (cpu_fixed, cpu_batch) = sums["wall"], sums["cpu"]
    total = fixed + per_batch * busiest
    return {
        "calibrate_seconds": total,
        "layer_seconds": total / n,
        "fixed_seconds": fixed / n,
        "batch_seconds": per_batch / n,
        "batches_per_rank": busiest,
        "cpu_seconds_per_rank": cpu_fixed + cpu_batch * busiest,
        "probe_seconds": probe_seconds,
        "probe_device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name()})",
        "probe_threads": threads,
    }


def with_time(
    plan: CalibrationPlan, cfg: ModelConfig, recipe: str | Path | Recipe, model_dir: str | Path | None
) -> CalibrationPlan:
    """``plan`` with its ``time`` estimate filled in by :func:`estimate_time`."""
    plan.time = estimate_time(cfg, recipe, plan.settings, model_dir)
    return plan
