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

from ..algorithms import residual
from ..errors import CheckpointError
from ..models.checkpoint import CheckpointReader
from ..models.config import load_config
from ..models.published import is_published
from ..runtime.distributed import world
from ..sharding.fsdp2 import DISTRIBUTION_PLAN_ATTR, default_mesh, fsdp2_units, fsdp2_wrap, init_fsdp2_root, local_rows
from .build import (
    build_on_meta,
    check_checkpoint_keys,
    module_dtype,
    param_dtypes,
    resolve_dtype,
    set_param_dtypes,
)
from .plain import from_pretrained
from .sources import NameMap, Source, resolve_buffers, resolve_sources


def _fill_local(model: nn.Module, reader: CheckpointReader, sources: dict[str, Source]) -> int:
    """Copy each parameter's local part from its checkpoint source; return the bytes this rank read."""
    read = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = sources[name]
            if isinstance(param, DTensor):
                start, stop = local_rows(param)
                local = param.to_local()
                if stop > start:
                    rows = source.rows(reader, start, stop)
                    local.copy_(rows)
                    read += rows.numel() * rows.element_size()
            else:  # replicated (off-dtype, or an unsharded root): every rank reads it whole
                full = source.full(reader)
                param.copy_(full)
                read += full.numel() * full.element_size()
    return read


def real_buffers(model: nn.Module, reader: CheckpointReader, stored: dict[str, str]) -> dict[str, torch.Tensor]:
    """The values of the model's buffers, kept across materialisation (``to_empty`` would leave them garbage).

    A persistent buffer the checkpoint holds (``stored``: buffer name -> key) gets the stored value, in the buffer's
    dtype; any other buffer already real (built with :func:`~shardcal.loading.build.meta_parameters`, or computed
    by the module) keeps its value; one on the meta device must be in the checkpoint.
    """
    out = {}
    for name, buf in model.named_buffers():
        if name in stored:
            out[name] = reader.get(stored[name]).to(buf.dtype)
        elif buf.device.type != "meta":
            out[name] = buf.detach().clone()
        elif name in reader:
            out[name] = reader.get(name)
        else:
            raise CheckpointError(
                f"{type(model).__name__}: buffer {name!r} is on the meta device and not in {reader.source.name}; build "
                "the model inside shardcal.loading.meta_parameters() so that buffers (rotary tables) stay real"
            )
    return out


def load_pretrained(
    path: str | Path,
    *,
    model: nn.Module | None = None,
    name_map: NameMap | None = None,
    shard: bool = True,
    shard_root: bool = True,
    dtype: torch.dtype | str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
    untie_word_embeddings: bool = False,
) -> nn.Module:
    """Load a Hugging Face-format directory as an FSDP2-sharded model; each rank reads only its own rows.

    Without ``model``, shardcal's own class for the config's ``model_type`` is built. With ``model`` — any module
    whose parameters are on the meta device (e.g. built inside :func:`~shardcal.loading.build.meta_parameters`) —
    each parameter is found in the checkpoint under its state-dict name, through ``name_map`` (a dict or a function
    from parameter name to checkpoint key), or in the layouts original checkpoints use (per-expert tensors of fused
    experts, Llava-style VLM prefixes); ``dtype`` (optional) casts its floating parameters.

    Collective: every rank of the default process group must call it. ``shard=False`` is plain
    :func:`from_pretrained` (every rank loads everything; shardcal's classes only). The returned model records a
    distribution plan (``model._shardcal_distribution_plan``: sharded modules, mesh, bytes this rank read), which is
    why ``fsdp2_wrap`` refuses it — it is wrapped already.

    ``untie_word_embeddings``: a model whose LM head shares the embeddings loads with a head of its own, read from the
    embeddings (or the checkpoint's head tensor, when it stores one), and its config untied — what a recipe's residual
    rotation needs, since once sharded they cannot be parted.
    """
    if not shard:
        if model is not None:
            raise CheckpointError("load_pretrained(model=..., shard=False): load a module of your own with shard=True")
        plain = from_pretrained(path, dtype=dtype)
        if untie_word_embeddings:
            residual.untie_word_embeddings(plain)
        return plain
    cfg = load_config(path) if model is None else None
    if model is None and cfg.raw.get("quantization_config") is not None and not is_published(cfg.raw):
        raise CheckpointError(
            f"{path}: load_pretrained reads unquantized checkpoints; load an exported (quantized) directory "
            "with shardcal.models.from_pretrained"
        )
    with CheckpointReader(path) as reader:
        if model is None:
            target = resolve_dtype(cfg, dtype)
            model = build_on_meta(cfg, target)
            check_checkpoint_keys(model, reader, cfg)
            set_param_dtypes(model, param_dtypes(model, reader, target))
            sources = {name: Source([[name]]) for name, _ in model.named_parameters()}
            stored = {}
        else:
            _check_on_meta(model)
            sources = resolve_sources(model, reader, name_map)
            stored = resolve_buffers(model, reader, name_map)
            if dtype is not None:
                target = module_dtype(dtype, reader, (k for src in sources.values() for k in src.keys()))
                set_param_dtypes(
                    model, {n: target if p.is_floating_point() else p.dtype for n, p in model.named_parameters()}
                )
        if untie_word_embeddings:
            sources = _untie_on_meta(model, reader, sources)
        buffers = real_buffers(model, reader, stored)
        mesh = mesh if mesh is not None else default_mesh(model)
        fsdp2_wrap(model, shard_root=shard_root, mp_policy=mp_policy, cpu_offload=cpu_offload, mesh=mesh)
        device = "cpu" if cpu_offload else (mesh.device_type if mesh.device_type == "cpu" else _current_device(mesh))
        model.to_empty(device=device)
        with torch.no_grad():
            for name, value in buffers.items():
                _copy_buffer(model.get_buffer(name), value)
        if callable(getattr(model, "tie_weights", None)):
            model.tie_weights()
        read = _fill_local(model, reader, sources)
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


def _untie_on_meta(model: nn.Module, reader: CheckpointReader, sources: dict[str, Source]) -> dict[str, Source]:
    """Give a tied head a weight of its own (still on the meta device; the config untied too), read from the
    checkpoint's head tensor when it stores one, else from the embeddings' (see ``untie_word_embeddings``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    embed, _, head = residual.root_modules(model)
    if head.weight is not embed.weight:
        return sources
    embed_name = names[id(embed.weight)]
    residual.untie_word_embeddings(model)
    head_name = next(n for n, p in model.named_parameters() if p is head.weight)
    return {**sources, head_name: Source([[head_name]]) if head_name in reader else sources[embed_name]}


def _copy_buffer(target: torch.Tensor, value: torch.Tensor) -> None:
    """A buffer's value into the materialised model: whole (FSDP2 leaves buffers replicated), or this rank's rows
    of one a module keeps sharded itself (a DTensor)."""
    if isinstance(target, DTensor):
        start, stop = local_rows(target)
        target.to_local().copy_(value[start:stop])
    else:
        target.copy_(value)


def _check_on_meta(model: nn.Module) -> None:
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if real:
        raise CheckpointError(
            f"{type(model).__name__}: load_pretrained(model=...) needs a model built on the meta device (no rank holds "
            f"the full model); parameter {real[0]!r} is on {dict(model.named_parameters())[real[0]].device}: build it "
            "inside shardcal.loading.meta_parameters()"
        )


def _full_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _current_device(mesh: DeviceMesh) -> torch.device:
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
