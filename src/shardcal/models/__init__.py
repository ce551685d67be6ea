"""Pure-torch decoder models that load Hugging Face-format checkpoints (no transformers needed).

The package holds model code only: :mod:`.config` (config.json parsing), :mod:`.decoder` (the models),
:mod:`.rope` (rotary embeddings) and :mod:`.checkpoint` (reading safetensors). The loading entry points live in
:mod:`shardcal.loading`; ``shardcal.models.from_pretrained`` and ``shardcal.models.load_pretrained`` are the same
functions, re-exported lazily here for users (nothing inside the package imports them from here).
"""

from typing import Any

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .decoder import CausalLM, DecoderInputs, DecoderLayer, DecoderModel, SparseMoeBlock

#: Public names defined in a higher layer, resolved on first use (PEP 562).
_LAZY = {"from_pretrained": "shardcal.loading.plain", "load_pretrained": "shardcal.loading.sharded"}

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "DecoderInputs",
    "DecoderLayer",
    "DecoderModel",
    "ModelConfig",
    "SparseMoeBlock",
    "from_pretrained",
    "load_config",
    "load_pretrained",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardcal.models' has no attribute {name!r}")
