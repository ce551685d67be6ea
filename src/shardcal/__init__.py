"""shardcal: layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors.

Public API (see docs/reference/api.md):

- :class:`LayerActivationCollector` — where a model keeps its decoder layers (registry).
- :func:`fsdp2_wrap`, :func:`fsdp2_root_unsharded`, :func:`layer_unsharded` — FSDP2 sharding for layer-wise use.
- :func:`layer_steps` — the layer-stepping primitive other layer-wise algorithms build on.
- :func:`calibrate` with :class:`CalibrationOptions` — the calibration runner; :func:`load_recipe` — recipes.
- :func:`collect_activations` with :class:`CollectionOptions` → :class:`ActivationReport`, :class:`ActivationDataset`
  — activation statistics and raw activations of chosen modules, layer by layer.
- :func:`export_checkpoint` — compressed-tensors export (streamed, distributed, atomic).
- :func:`calibrate_to_checkpoint` → :class:`PipelineResult` — what ``shardcal calibrate`` does, as one call: a model
  directory in (checked before loading, planned, loaded sharded, calibrated), an export out.
- :func:`from_pretrained`, :func:`load_pretrained` — load a Hugging Face-format directory (plain or sharded).
- :func:`init_distributed` (torchrun's process group, or one process), :class:`Tokenizer` (a model directory's
  ``tokenizer.json``), :func:`load_token_data` (calibration data from a text or token-id file) and
  :func:`load_calibration_data` with :class:`DataOptions` (chat conversations rendered with the model's template,
  JSONL and parquet records, several sources mixed).

Names are resolved on first use (PEP 562), so ``import shardcal`` (and ``shardcal --help``) does not import torch.
"""

from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ActivationDataset": "shardcal.collect.store",
    "ActivationReport": "shardcal.collect.report",
    "CalibrationOptions": "shardcal.calib.runner",
    "CalibrationReport": "shardcal.calib.report",
    "CollectionOptions": "shardcal.collect.runner",
    "DataOptions": "shardcal.data.sources",
    "LayerActivationCollector": "shardcal.sharding.registry",
    "LayerStep": "shardcal.layerwise.steps",
    "PipelineResult": "shardcal.pipeline.calibrate",
    "ShardcalError": "shardcal.errors",
    "Tokenizer": "shardcal.io.tokenizer.tokenizer",
    "calibrate": "shardcal.calib.runner",
    "calibrate_to_checkpoint": "shardcal.pipeline.calibrate",
    "collect_activations": "shardcal.collect.runner",
    "export_checkpoint": "shardcal.export.export",
    "from_pretrained": "shardcal.loading.plain",
    "fsdp2_root_unsharded": "shardcal.sharding.fsdp2",
    "fsdp2_wrap": "shardcal.sharding.fsdp2",
    "init_distributed": "shardcal.runtime.distributed",
    "layer_steps": "shardcal.layerwise.steps",
    "layer_unsharded": "shardcal.sharding.fsdp2",
    "load_calibration_data": "shardcal.data.sources",
    "load_pretrained": "shardcal.loading.sharded",
    "load_recipe": "shardcal.calib.recipes",
    "load_token_data": "shardcal.data.token_data",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'shardcal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
