"""``from_pretrained``: build a model from a Hugging Face-format directory on one process.

The model is built on the meta device (no memory, no random init), materialised on the target device, and
filled from the safetensors files, checking every key and shape against the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from .checkpoint import CheckpointReader
from .config import ModelConfig, load_config
from .decoder import CausalLM, SparseMoeBlock

#: Checkpoint keys that old exports carry but that hold nothing we need (recomputed, not learned).
IGNORED_KEY_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def build_on_meta(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The model's structure on the meta device, in ``dtype``: no memory, no initialisation."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return model.to(dtype)


def router_weight_names(model: nn.Module) -> set[str]:
    """Names of MoE router weights, which may stay float32 in a lower-precision model."""
    return {f"{name}.gate.weight" for name, module in model.named_modules() if isinstance(module, SparseMoeBlock)}


def resolve_dtype(cfg: ModelConfig, dtype: torch.dtype | str | None) -> torch.dtype:
    """The requested dtype, else the config's ``torch_dtype``, else float32."""
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(names)}")
        dtype = names[dtype]
    return dtype or cfg.torch_dtype or torch.float32


def check_checkpoint_keys(model: nn.Module, reader: CheckpointReader, cfg: ModelConfig) -> None:
    """Every parameter present with the right shape, and no unexpected tensor; errors name the key."""
    expected = dict(model.named_parameters())
    for name, param in expected.items():
        if name not in reader:
            raise CheckpointError(f"{reader.model_dir}: tensor {name!r} is missing from the checkpoint")
        shape = reader.shape(name)
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {name!r} has shape {list(shape)}, the config implies {list(param.shape)}"
            )
        if not reader.dtype(name).is_floating_point:
            raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} has dtype {reader.dtype_name(name)}, expected a float")
    for key in reader.keys():
        if key in expected or key.endswith(IGNORED_KEY_SUFFIXES):
            continue
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        raise CheckpointError(f"{reader.file_of(key)}: unexpected tensor {key!r} (not part of a {cfg.model_type} model with this config)")


def param_dtypes(model: nn.Module, reader: CheckpointReader, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Per-parameter dtype: ``dtype``, except routers that the checkpoint stores in float32."""
    routers = router_weight_names(model)
    return {
        name: (torch.float32 if name in routers and reader.dtype(name) == torch.float32 else dtype)
        for name, _ in model.named_parameters()
    }


def set_param_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    for name, param in model.named_parameters():
        if param.dtype != dtypes[name]:
            param.data = param.data.to(dtypes[name])


def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu") -> CausalLM:
    """Load a Hugging Face-format model directory (config.json + safetensors) into a plain, unsharded model.

    ``dtype`` defaults to the config's ``torch_dtype`` (float32 when absent); MoE routers stored in float32 stay
    float32. A directory exported by shardcal (compressed-tensors ``quantization_config``) loads into
    fake-quant modules with the stored scales.
    """
    cfg = load_config(path)
    target = resolve_dtype(cfg, dtype)
    model = build_on_meta(cfg, target)
    quantization = cfg.raw.get("quantization_config")
    if quantization is not None:
        from ..export import load_quantized_into  # late import: export depends on quant, which is optional here

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
