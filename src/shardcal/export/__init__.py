"""Checkpoint export, compressed-tensors by default (reload lives in :mod:`shardcal.loading.quantized`).

- :func:`export_checkpoint` — a calibrated (plain or FSDP2-sharded) model -> a checkpoint directory that vLLM and
  transformers (with compressed-tensors) load; streamed layer by layer, writing shared across ranks, atomic.

Modules: :mod:`.format` (the :class:`~.format.ExportFormat` interface and the registry :func:`~.format.formats`),
:mod:`.compressed_tensors` (the compressed-tensors format: specs <-> config, formats, tensor layouts, encoding one
Linear), :mod:`.quant_modules` (which Linears and KV caches are stored quantized, checked), :mod:`.layout` (which
tensor goes where, decided up front), :mod:`.shards` (streaming safetensors files), :mod:`.destination` (the out
directory, staging and the final rename), :mod:`.metadata` (index, config.json, tokenizer files, report, manifest),
:mod:`.export` (the collective export). The format is documented in docs/reference/export-format.md.
"""

from .destination import check_destination
from .export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint
from .format import DEFAULT_FORMAT, ExportFormat, formats, get_format

__all__ = [
    "DEFAULT_FORMAT",
    "DEFAULT_MAX_SHARD_BYTES",
    "ExportFormat",
    "check_destination",
    "export_checkpoint",
    "formats",
    "get_format",
]
