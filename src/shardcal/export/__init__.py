"""compressed-tensors export (reload lives in :mod:`shardcal.loading.quantized`).

- :func:`export_checkpoint` — a calibrated (plain or FSDP2-sharded) model -> a checkpoint directory that vLLM and
  transformers (with compressed-tensors) load; streamed layer by layer, writing shared across ranks, atomic.

Modules: :mod:`.ct_config` (specs <-> compressed-tensors config, formats, tensor layouts), :mod:`.ct_tensors`
(encode / decode one Linear), :mod:`.plan` (which tensor goes where, decided up front), :mod:`.shards` (streaming
safetensors files), :mod:`.export` (the collective export). The format is documented in
docs/export-format.md.
"""

from .export import DEFAULT_MAX_SHARD_BYTES, check_destination, export_checkpoint

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "check_destination", "export_checkpoint"]
