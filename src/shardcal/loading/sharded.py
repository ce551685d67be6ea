"""``load_pretrained``: load a checkpoint already sharded, each rank reading only the rows it owns.

``from_pretrained`` + ``fsdp2_wrap`` needs every rank to hold the whole model for a moment. Here the model is
built on the meta device, wrapped with :func:`shardcal.fsdp2_wrap` (which works on meta parameters),
materialised as local shards only, and each rank copies its own rows of each tensor straight out of the
memory-mapped safetensors files. No rank reads or holds a full copy; nothing is broadcast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..distributed import world
from ..errors import CheckpointError
from ..fsdp2_utils import DISTRIBUTION_PLAN_ATTR, default_mesh, fsdp2_units, fsdp2_wrap, init_fsdp2_root, local_rows
from ..models.checkpoint import CheckpointReader
from ..models.config import load_config
from ..models.decoder import CausalLM
from .build import build_on_meta, check_checkpoint_keys, param_dtypes, resolve_dtype, set_param_dtypes
from .plain import from_pretrained


def _fill_local(model: nn.Module, reader: CheckpointReader) -> int:
    """Copy each parameter's local part from the checkpoint; return the bytes this rank read."""
    read = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                start, stop = local_rows(param)
                local = param.to_local()
                if stop > start:
                    rows = reader.get_rows(name, start, stop)
                    local.copy_(rows)
                    read += rows.numel() * rows.element_size()
            else:  # replicated (off-dtype, or an unsharded root): every rank reads it whole
                full = reader.get(name)
                param.copy_(full)
                read += full.numel() * full.element_size()
    return read


def load_pretrained(
    path: str | Path,
    *,
    shard: bool = True,
    shard_root: bool = True,
    dtype: torch.dtype | str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
) -> CausalLM:
    """Load a Hugging Face-format directory as an FSDP2-sharded model; each rank reads only its own rows.

    Collective: every rank of the default process group must call it. ``shard=False`` is plain
    :func:`from_pretrained` (every rank loads everything). The returned model records a distribution plan
    (``model._shardcal_distribution_plan``: sharded modules, mesh, bytes this rank read), which is why
    ``fsdp2_wrap`` refuses it — it is wrapped already.
    """
    if not shard:
        return from_pretrained(path, dtype=dtype)
    cfg = load_config(path)
    if cfg.raw.get("quantization_config") is not None:
        raise CheckpointError(
            f"{path}: load_pretrained reads unquantized checkpoints; load an exported (quantized) directory "
            "with shardcal.models.from_pretrained"
        )
    target = resolve_dtype(cfg, dtype)
    model = build_on_meta(cfg, target)
    with CheckpointReader(path) as reader:
        check_checkpoint_keys(model, reader, cfg)
        set_param_dtypes(model, param_dtypes(model, reader, target))
        mesh = mesh if mesh is not None else default_mesh(model)
        fsdp2_wrap(model, shard_root=shard_root, mp_policy=mp_policy, cpu_offload=cpu_offload, mesh=mesh)
        device = "cpu" if cpu_offload else (mesh.device_type if mesh.device_type == "cpu" else _current_device(mesh))
        model.to_empty(device=device)
        model.tie_weights()
        read = _fill_local(model, reader)
    init_fsdp2_root(model)
    plan: dict[str, Any] = {
        "sharded_modules": [n for n, m in model.named_modules() if any(m is u for u in fsdp2_units(model))],
        "shard_root": shard_root,
        "mesh_device_type": mesh.device_type,
        "world_size": mesh.size(),
        "rank": world()[0],
        "bytes_read": read,
        "model_bytes": sum(_full_bytes(p) for p in model.parameters()),
    }
    setattr(model, DISTRIBUTION_PLAN_ATTR, plan)
    return model.eval()


def _full_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _current_device(mesh: DeviceMesh) -> torch.device:
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
