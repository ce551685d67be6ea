"""``from_pretrained``: build a model from a Hugging Face-format directory on one process.

The model is built on the meta device, checked against the checkpoint (:mod:`.build`), materialised on the
target device and filled from the safetensors files. A directory exported by shardcal (compressed-tensors) loads
into fake-quant modules (:mod:`.quantized`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.checkpoint import CheckpointReader
from ..models.config import load_config
from ..models.decoder import CausalLM
from ..models.published import is_published
from .build import build_on_meta, check_checkpoint_keys, param_dtypes, resolve_dtype, set_param_dtypes
from .quantized import load_quantized_into


def from_pretrained(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> CausalLM:
    """Load a Hugging Face-format model directory (config.json + safetensors) into a plain, unsharded model.

    ``dtype`` defaults to the config's ``torch_dtype``/``dtype`` (float32 when absent); MoE routers stored in
    float32 stay float32. A directory exported by shardcal (compressed-tensors ``quantization_config``) loads
    into fake-quant modules with the stored scales. Bad input raises :class:`~shardcal.errors.ConfigError` or
    :class:`~shardcal.errors.CheckpointError` naming the file and field or tensor.
    """
    cfg = load_config(path)
    target = resolve_dtype(cfg, dtype)
    model = build_on_meta(cfg, target)
    quantization = cfg.raw.get("quantization_config")
    if quantization is not None and not is_published(cfg.raw):  # published FP8: the reader dequantizes it
        return load_quantized_into(model, Path(path), cfg, target, torch.device(device))
    with CheckpointReader(path) as reader:
        check_checkpoint_keys(model, reader, cfg)
        set_param_dtypes(model, param_dtypes(model, reader, target))
        model.to_empty(device=device)
        model.tie_weights()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(reader.get(name))
    return model.eval()
