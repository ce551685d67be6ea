"""FSDP2 sharding for layer-wise calibration: ``fsdp2_wrap`` and ``fsdp2_root_unsharded``.

Calibration calls decoder layers one at a time, directly, instead of running the whole model. That changes
what FSDP2 has to be told:

* each decoder layer is its own FSDP unit, so a step gathers exactly one layer;
* the root (embeddings, final norm, lm_head) is sharded too, so no rank keeps a full copy of the largest
  matrices — but calling ``model.model.embed_tokens(ids)`` directly skips the root's pre-forward, which is where
  FSDP2 would gather them. :func:`fsdp2_root_unsharded` gathers the root's own group explicitly;
* modules beside the decoder stack (a vision tower, a projector, an MTP head) get units of their own, or they
  would fall into the root's group and be gathered with the embeddings;
* parameters in another dtype than the rest (a float32 MoE router in a bf16 model) cannot share an FSDP2 group,
  so they stay replicated — and must be moved to the compute device by hand, which FSDP2 does not do for
  parameters it ignores.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..errors import DistributedError, ModelLayoutError
from .registry import LayerActivationCollector, require_decoder_layers

#: Child names (of the root, or of the root's ``model``) that hold modules beside the decoder stack.
AUXILIARY_MODULE_NAMES: tuple[str, ...] = (
    "vision_tower",
    "visual",
    "vision_model",
    "multi_modal_projector",
    "mm_projector",
    "mtp",
)

#: Attributes a parallel loader sets on a model it actually distributed (transformers' ``_device_mesh``,
#: ``_tp_size``, ``_is_distributed_loading_by_transformers``; a ``device_mesh`` of other libraries). A ``_tp_plan``
#: is not one of them: transformers sets it on every model, distributed or not (it says how a model *could* be split).
_MESH_ATTRIBUTES: tuple[str, ...] = ("device_mesh", "_device_mesh")
_PARALLEL_SIZE_ATTRIBUTES: tuple[str, ...] = ("_tp_size", "tp_size", "_ep_size", "_pp_size")

#: Set on a model by ``load_pretrained``: what was sharded, over which mesh.
DISTRIBUTION_PLAN_ATTR = "_shardcal_distribution_plan"


def _refuse_distributed(model: nn.Module) -> None:
    """Refuse a model that is already FSDP2-wrapped or that a parallel loader has actually distributed."""
    if getattr(model, DISTRIBUTION_PLAN_ATTR, None):
        raise ModelLayoutError(
            f"{type(model).__name__}: this model was loaded already sharded (load_pretrained records a distribution "
            "plan); fsdp2_wrap needs a plain model: load it with shardcal.models.from_pretrained instead"
        )
    hint = "load the model plainly (one full copy per process, or on the meta device) and let fsdp2_wrap shard it"
    for name, module in model.named_modules():
        where = name or "<root>"
        if isinstance(module, FSDPModule):
            raise ModelLayoutError(
                f"{type(model).__name__}: module {where!r} is already FSDP2-wrapped; wrap a plain model"
            )
        if getattr(module, "_is_distributed_loading_by_transformers", False) is True:
            raise ModelLayoutError(
                f"{type(model).__name__}: module {where!r} was distributed by transformers' loader; {hint}"
            )
        for attr in _MESH_ATTRIBUTES:
            if getattr(module, attr, None) is not None:
                raise ModelLayoutError(
                    f"{type(model).__name__}: module {where!r} carries a device mesh ({attr}): it was distributed by "
                    f"another loader; {hint}"
                )
        for attr in _PARALLEL_SIZE_ATTRIBUTES:
            size = getattr(module, attr, None)
            if isinstance(size, int) and not isinstance(size, bool) and size > 1:
                raise ModelLayoutError(
                    f"{type(model).__name__}: module {where!r} has {attr}={size} (tensor/expert/pipeline parallel); {hint}"
                )
    for pname, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ModelLayoutError(
                f"{type(model).__name__}: parameter {pname!r} is a DTensor (already distributed over a device mesh); {hint}"
            )


def auxiliary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules beside the decoder stack that deserve their own FSDP unit.

    Rules: a child of the root, or of the root's ``model`` child, whose attribute name is one of
    :data:`AUXILIARY_MODULE_NAMES`, that holds parameters, and that does not contain the decoder layers.
    """
    layers = LayerActivationCollector.get_decoder_layers(model)
    found: list[tuple[str, nn.Module]] = []
    parents = [("", model)]
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        parents.append(("model.", inner))
    for prefix, parent in parents:
        for name, child in parent.named_children():
            if name not in AUXILIARY_MODULE_NAMES or child is None:
                continue
            if layers is not None and any(m is layers for m in child.modules()):
                continue
            if next(child.parameters(), None) is None:
                continue
            found.append((prefix + name, child))
    return found


def _untied_output_head(model: nn.Module) -> nn.Module | None:
    """``model.lm_head`` when it shares no parameter with the rest of the model (i.e. embeddings are untied)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or next(head.parameters(), None) is None:
        return None
    head_params = {id(p) for p in head.parameters()}
    inside_head = {id(m) for m in head.modules()}
    for module in model.modules():
        if id(module) not in inside_head and any(id(p) in head_params for p in module.parameters(recurse=False)):
            return None
    return head


def fsdp2_units(model: nn.Module, replicate: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The modules to give FSDP units of their own, in wrapping order.

    Decoder layers, then auxiliary modules, then an untied ``lm_head``: calibration gathers the root group to
    embed, and a separate output head keeps the (vocab x hidden) matrix out of that gather. A tied head shares
    the embedding matrix and stays in the root group. Modules in ``replicate`` (and their descendants) are left
    out, e.g. a vision tower that an expert-parallel loader wants to keep replicated.
    """
    skip = {id(m) for r in replicate for m in r.modules()}
    candidates = [*require_decoder_layers(model), *(m for _, m in auxiliary_modules(model))]
    head = _untied_output_head(model)
    if head is not None:
        candidates.append(head)
    return [m for m in candidates if id(m) not in skip]


def dominant_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype holding most parameter elements."""
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    if not counts:
        raise ModelLayoutError(f"{type(model).__name__}: has no floating-point parameters to shard")
    return counts.most_common(1)[0][0]


def _off_dtype_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters whose dtype differs from the dominant one: FSDP2 cannot group them with the rest."""
    main = dominant_dtype(model)
    return {name: p for name, p in model.named_parameters() if p.dtype != main}


def default_mesh(model: nn.Module) -> DeviceMesh:
    """A 1-D mesh over the whole world, on the model's accelerator, the process's accelerator, or CPU (gloo)."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "fsdp2_wrap needs an initialized torch.distributed process group (run under torchrun, or call "
            "torch.distributed.init_process_group first; a single process may use world_size=1)"
        )
    return init_device_mesh(_mesh_device_type(model), (dist.get_world_size(),))


def _mesh_device_type(model: nn.Module) -> str:
    for p in model.parameters():
        if p.device.type not in ("cpu", "meta"):
            return p.device.type
    backend = str(dist.get_backend())
    if torch.cuda.is_available() and "nccl" in backend:
        return "cuda"
    return "cpu"


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _move_ignored(params: dict[str, nn.Parameter], device: torch.device) -> None:
    """Put replicated (ignored) parameters on the shards' device; meta stays meta (materialised later)."""
    for p in params.values():
        if p.device != device and p.device.type != "meta":
            p.data = p.data.to(device)


def _warn_off_dtype(model: nn.Module, params: dict[str, nn.Parameter]) -> None:
    total = sum(p.numel() for p in model.parameters())
    off = sum(p.numel() for p in params.values())
    names = ", ".join(list(params)[:3]) + (", ..." if len(params) > 3 else "")
    dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params.values()}))
    warnings.warn(
        f"fsdp2_wrap: {len(params)} parameter(s) in {dtypes} differ from the model's dtype "
        f"{str(dominant_dtype(model)).removeprefix('torch.')} and stay replicated on every rank "
        f"({100.0 * off / max(total, 1):.3f}% of elements): {names}",
        stacklevel=3,
    )


@contextlib.contextmanager
def _keep_architectures(model: nn.Module) -> Iterator[None]:
    """fully_shard renames classes (``FSDPCausalLM``); keep ``config.architectures`` as it was."""
    config = getattr(model, "config", None)
    holders = [h for h in (config, getattr(config, "raw", None)) if h is not None]
    saved = []
    for h in holders:
        value = h.get("architectures") if isinstance(h, dict) else getattr(h, "architectures", None)
        saved.append((h, list(value) if isinstance(value, list) else value))
    try:
        yield
    finally:
        for h, value in saved:
            if value is None:
                continue
            if isinstance(h, dict):
                h["architectures"] = value
            else:
                h.architectures = value


def fsdp2_wrap(
    model: nn.Module,
    shard_root: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    mesh: DeviceMesh | None = None,
) -> nn.ModuleList:
    """Shard ``model`` with FSDP2 for layer-by-layer use; return its decoder layers.

    Every decoder layer becomes an FSDP unit (``reshard_after_forward=True``), then auxiliary modules
    (:func:`auxiliary_modules`), then — with ``shard_root`` — the root, which keeps the embeddings, final norm
    and lm_head sharded instead of replicated. Parameters off the dominant dtype are ignored by FSDP2 and kept
    replicated on the shards' device. Models that are already wrapped or distributed by another loader are
    refused.
    """
    _refuse_distributed(model)
    layers = require_decoder_layers(model)
    mesh = mesh if mesh is not None else default_mesh(model)
    ignored = _off_dtype_params(model)
    if ignored:
        _warn_off_dtype(model, ignored)
        _move_ignored(ignored, _mesh_device(mesh))
    kwargs: dict = {"mesh": mesh, "ignored_params": set(ignored.values()) or None}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    # Pinned host memory needs an accelerator; on a CPU mesh "offload" keeps shards where they already are.
    pin = mesh.device_type != "cpu"
    kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin) if cpu_offload else OffloadPolicy()
    with _keep_architectures(model):
        for module in fsdp2_units(model):
            if module is getattr(model, "lm_head", None) and not shard_root:
                continue  # shard_root=False: everything outside the decoder stack stays replicated
            fully_shard(module, reshard_after_forward=True, **kwargs)
        if shard_root:
            fully_shard(model, reshard_after_forward=True, **kwargs)
            init_fsdp2_root(model)
    return layers


def init_fsdp2_root(model: nn.Module) -> None:
    """Settle which FSDP2 unit is the root before any submodule runs.

    FSDP2 decides lazily, at the first forward, that the module running it is the root. The runner calls
    decoder layers directly, so without this the first layer called would claim to be the root and a later
    full forward would fail. Waits while parameters are still on the meta device (``load_pretrained``
    materialises them after wrapping); called again from :func:`fsdp2_root_unsharded`.
    """
    if not is_fsdp2_root(model):
        return
    state = model._get_fsdp_state()
    if state._is_root is not None:
        return
    if any(p.device.type == "meta" for p in model.parameters()):
        return
    state._lazy_init()


def is_fsdp2_root(model: nn.Module) -> bool:
    """Whether ``model`` itself is an FSDP2 unit (and so holds a parameter group of its own)."""
    return isinstance(model, FSDPModule) and bool(model._get_fsdp_state()._fsdp_param_groups)


@contextlib.contextmanager
def fsdp2_root_unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Gather the root's own parameters (embeddings, final norm, lm_head) for direct submodule calls.

    Calling ``model.model.embed_tokens(ids)`` skips the root's pre-forward, so FSDP2 never gathers the root's
    group and the call fails with "mixed torch.Tensor and DTensor". Inside this context the root's group is
    unsharded; it is resharded on exit, also on exception. Collective: every rank must enter it. A no-op for a
    model that is not an FSDP2 root; nesting is safe (only the outermost context gathers and reshards).
    """
    if not is_fsdp2_root(model):
        yield model
        return
    init_fsdp2_root(model)
    groups = model._get_fsdp_state()._fsdp_param_groups
    already_unsharded = all(g.is_unsharded for g in groups)
    if not already_unsharded:
        model.unshard()
    try:
        yield model
    finally:
        if not already_unsharded:
            model.reshard()


@contextlib.contextmanager
def layer_unsharded(layer: nn.Module) -> Iterator[nn.Module]:
    """Gather an FSDP2 unit once and keep it gathered across any number of direct calls, then reshard.

    Inside, ``reshard_after_forward`` is off, so repeated calls of ``layer`` reuse the one gather; on exit the
    layer is resharded and its setting restored. A no-op for a module that is not an FSDP2 unit.
    """
    if not isinstance(layer, FSDPModule):
        yield layer
        return
    layer.unshard()
    layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield layer
    finally:
        layer.set_reshard_after_forward(True, recurse=False)
        layer.reshard()


def sync_unsharded_to_shards(layer: nn.Module) -> int:
    """Write a gathered unit's (possibly modified) parameters back into this rank's shards.

    FSDP2's sharded parameters are the source of truth: resharding frees the gathered copies, so an algorithm
    that edits weights while the layer is gathered (GPTQ, SmoothQuant folding) must copy its rows back, or the
    edit is lost. Call it inside :func:`layer_unsharded`. A no-op (returns 0) for a module that is not an FSDP2
    unit, whose parameters were edited in place. Returns the number of parameters written back.
    """
    if not isinstance(layer, FSDPModule):
        return 0
    written = 0
    with torch.no_grad():
        for group in layer._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                full = fsdp_param.unsharded_param
                start, stop = local_rows(fsdp_param.sharded_param)
                local = fsdp_param.sharded_param.to_local()
                if stop > start:
                    local.copy_(full[start:stop].to(local.dtype))
                written += 1
    return written


def local_rows(param: DTensor) -> tuple[int, int]:
    """The global row range ``[start, stop)`` that this rank's shard of a dim-0 sharded DTensor holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]):
        raise NotImplementedError("only dim-0 sharding is supported")
    return offset[0], offset[0] + shape[0]


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent buffer of ``module`` by its state-dict name: what a checkpoint holds beside parameters
    (DeepSeek-V3's ``mlp.gate.e_score_correction_bias``). FSDP2 shards parameters only: buffers stay whole on every
    rank. Computed, non-persistent buffers (rotary tables) are not listed."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        skipped = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in skipped:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out
