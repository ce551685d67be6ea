"""shardcal: layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors.

Public API (see docs/api.md):

- :class:`LayerActivationCollector` — where a model keeps its decoder layers (registry).
- :func:`fsdp2_wrap`, :func:`fsdp2_root_unsharded`, :func:`layer_unsharded` — FSDP2 sharding for layer-wise use.
- :func:`layer_steps` — the layer-stepping primitive other layer-wise algorithms build on.
- :func:`calibrate` — the calibration runner; :func:`load_recipe` — quantization recipes.
- :func:`export_checkpoint` — compressed-tensors export (streamed, distributed, atomic).
- :mod:`shardcal.models` — pure-torch decoder models: ``from_pretrained``, ``load_pretrained``.
"""

from . import errors
from .calibrate import calibrate
from .errors import ShardcalError
from .export import export_checkpoint
from .fsdp2_utils import fsdp2_root_unsharded, fsdp2_wrap, layer_unsharded
from .layer_steps import LayerStep, layer_steps
from .recipes import load_recipe
from .registry import LayerActivationCollector
from .report import CalibrationReport

__version__ = "0.1.0"


__all__ = [
    "CalibrationReport",
    "LayerActivationCollector",
    "LayerStep",
    "ShardcalError",
    "calibrate",
    "errors",
    "export_checkpoint",
    "fsdp2_root_unsharded",
    "fsdp2_wrap",
    "layer_steps",
    "layer_unsharded",
    "load_recipe",
    "__version__",
]
