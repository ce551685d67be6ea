"""Loading entry points: a Hugging Face-format directory -> a model, plain, sharded or quantized.

- :func:`from_pretrained` (:mod:`.plain`) — one process, the whole model; an exported compressed-tensors directory
  loads into fake-quant modules (:mod:`.quantized`).
- :func:`load_pretrained` (:mod:`.sharded`) — FSDP2-sharded, each rank reading only its own rows.
"""

from .plain import from_pretrained
from .sharded import load_pretrained

__all__ = ["from_pretrained", "load_pretrained"]
