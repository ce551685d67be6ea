"""shardcal: layer-by-layer PTQ calibration of FSDP2-sharded LLMs, exported as compressed-tensors."""

from . import errors
from .errors import ShardcalError
from .registry import LayerActivationCollector

__version__ = "0.1.0"

__all__ = ["LayerActivationCollector", "ShardcalError", "errors", "__version__"]
