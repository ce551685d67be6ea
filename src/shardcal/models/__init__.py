"""Pure-torch decoder models that load Hugging Face-format checkpoints (no transformers needed)."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .decoder import CausalLM, DecoderInputs, DecoderLayer, DecoderModel, SparseMoeBlock
from .loading import from_pretrained
from .sharded import load_pretrained

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelConfig",
    "load_config",
    "CausalLM",
    "DecoderInputs",
    "DecoderLayer",
    "DecoderModel",
    "SparseMoeBlock",
    "from_pretrained",
    "load_pretrained",
]
