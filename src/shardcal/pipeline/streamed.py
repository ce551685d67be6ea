"""A streamed calibration: the decoder layers stay on disk until their step, and each is exported at the end of it.

:func:`calibrate_streamed` is what :func:`~.calibrate.calibrate_to_checkpoint` runs when it streams: the model is
loaded by :func:`shardcal.loading.streamed.load_streamed` (everything but the decoder layers, sharded), the export is
planned from the model's structure and the recipe before anything is calibrated (:func:`~shardcal.export.export.
plan_streamed_export`), and every decoder layer is written into the export while its step still holds it — so a rank
never holds more than the layer in its step, the next layer's read and the activations. A recipe with a
``[fallback]`` decides after a layer's step how it is stored: its layers are laid out as they are written.
:func:`streaming_refusal` says which runs cannot stream, and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..calib.attach import quantize_modules
from ..calib.recipe import Recipe
from ..calib.report import CalibrationReport
from ..calib.runner import calibrate
from ..export.export import ExportSession, plan_streamed_export
from ..layerwise.options import CalibrationOptions
from ..sharding.residency import residency_of

#: What ``stream=`` (``--stream``) takes: stream when the resident run does not fit, always, or never.
STREAM_MODES: tuple[str, ...] = ("auto", "on", "off")


def streaming_refusal(recipe: Recipe, impl: str) -> str | None:
    """Why a run with ``recipe`` and model implementation ``impl`` (shardcal's class or transformers') cannot stream
    (None: it can)."""
    if recipe.rotates_residual:
        return (
            f"recipe {recipe.name!r} rotates the residual stream ([rotation] residual), folded into every layer's "
            "weights before the first step: that needs the whole model at once"
        )
    return None


def calibrate_streamed(
    model_dir: Path,
    out_dir: Path,
    recipe: Recipe,
    ids: object,
    options: CalibrationOptions,
    *,
    overwrite: bool,
    shard_root: bool,
    export_format: object,
    export_dtype: object,
    impl: str = "shardcal",
) -> StreamedRun:
    """Load ``model_dir`` streamed (``impl``: shardcal's model class or transformers'), calibrate it on ``ids`` with
    ``recipe`` and export it to ``out_dir``, each decoder layer written at the end of its step (collective). A
    failure or Ctrl-C anywhere leaves no ``out_dir`` (and no staging directory). Returns the calibration report and where the time went."""
    from ..loading.streamed import load_streamed

    start = time.perf_counter()
    model = load_streamed(model_dir, shard_root=shard_root, impl=impl)
    residency = residency_of(model)
    try:
        plan = plan_streamed_export(model, recipe, _attach, format=export_format, dtype=export_dtype)
        session = ExportSession(
            model, out_dir, recipe, overwrite=overwrite, tokenizer_dir=model_dir, format=export_format,
            dtype=export_dtype, source=model_dir, planned=plan,
            layers_laid_out_when_written=recipe.fallback is not None,
        )  # fmt: skip
        try:
            residency.on_release(session.write_held_layer)
            loaded = time.perf_counter()
            report = calibrate(model, ids, recipe, options)
            calibrated = time.perf_counter()
            session.write_remaining()
            session.finish(report)
        except BaseException:
            session.abort()
            raise
    finally:
        residency.close()
    return StreamedRun(
        report=report, load_seconds=loaded - start, calibration_seconds=calibrated - loaded,
        export_seconds=time.perf_counter() - calibrated,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StreamedRun:
    """What :func:`calibrate_streamed` did: the report, and its wall time by phase (``load_seconds``: everything but
    the decoder layers, and the export planned; ``calibration_seconds``: the layers, each read, calibrated and written;
    ``export_seconds``: the rest of the export)."""

    report: CalibrationReport
    load_seconds: float
    calibration_seconds: float
    export_seconds: float


def _attach(layer: nn.Module, recipe: Recipe, prefix: str) -> None:
    """What calibration attaches to a decoder layer before its step (the quantizers, the input rotations)."""
    quantize_modules(layer, recipe, prefix=prefix)
