"""Building a model on the meta device and checking a checkpoint against it, shared by every loader.

The model is built on the meta device (no memory, no random init) and checked against the checkpoint (every key
present, shapes and dtypes right, nothing unexpected) before anything is materialised or read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.checkpoint import CheckpointReader, dominant_floating_dtype
from ..models.config import ModelConfig
from ..models.decoder import CausalLM, SparseMoeBlock

#: Checkpoint keys that old exports carry but that hold nothing we need (recomputed, not learned).
IGNORED_KEY_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)

_DTYPE_ARGS: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHOWN = 5  # at most this many keys named in one error message


def build_on_meta(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """The model's structure on the meta device, in ``dtype``: no memory, no initialisation."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return model.to(dtype)


def router_weight_names(model: nn.Module) -> set[str]:
    """Names of MoE router weights, which may stay float32 in a lower-precision model."""
    return {f"{name}.gate.weight" for name, module in model.named_modules() if isinstance(module, SparseMoeBlock)}


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real (rotary tables, for instance).

    ``with meta_parameters(): model = MyLM(cfg)`` allocates each parameter only for the moment its module's
    constructor creates it; :func:`~shardcal.loading.sharded.load_pretrained` then shards and fills it from a
    checkpoint. (A ``torch.device("meta")`` context would put computed buffers on the meta device too.)
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # construction only: restored on exit, also on error
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def resolve_dtype(cfg: ModelConfig | None, dtype: torch.dtype | str | None) -> torch.dtype:
    """The requested dtype (a torch dtype or its name), else the config's ``torch_dtype``, else float32.

    ``"auto"`` means the config's dtype, as in transformers.
    """
    if isinstance(dtype, str):
        if dtype == "auto":
            dtype = None
        else:
            name = dtype.removeprefix("torch.")
            if name not in _DTYPE_ARGS:
                raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPE_ARGS)}")
            dtype = _DTYPE_ARGS[name]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or its name, got {dtype!r}")
    return dtype or (cfg.torch_dtype if cfg is not None else None) or torch.float32


def module_dtype(dtype: torch.dtype | str, reader: CheckpointReader | None, keys: Iterable[str]) -> torch.dtype:
    """The dtype a module built elsewhere (transformers' class) is cast to for ``dtype``: ``"auto"`` is the
    checkpoint's own — the floating dtype of at least 16 bits holding most of ``keys``' values (a published FP8
    checkpoint's bf16), float32 where none is or there are no weights (``reader`` None) — else as
    :func:`resolve_dtype` reads it."""
    if dtype != "auto":
        return resolve_dtype(None, dtype)
    if reader is None:
        return torch.float32
    found = dominant_floating_dtype((reader.dtype(k), math.prod(reader.shape(k))) for k in keys)
    return found or torch.float32


def named_keys(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check_checkpoint_keys(model: nn.Module, reader: CheckpointReader, cfg: ModelConfig) -> None:
    """Every parameter present with the right shape and a float dtype, and no unexpected tensor.

    Errors name the file and the tensor keys. ``named_parameters`` lists a tied ``lm_head.weight`` once, under
    the embeddings, so a tied checkpoint may omit ``lm_head.weight``; when it stores it, the shape must match.
    """
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    if cfg.tie_word_embeddings and "lm_head.weight" in reader:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    check_tensor_names(
        reader, list(expected), f"of this {cfg.model_type} config", f"a {cfg.model_type} model with this config"
    )
    check_float_shapes(reader, expected)


def check_tensor_names(reader: CheckpointReader, expected: list[str], owner: str, unexpected_context: str) -> None:
    """Every name in ``expected`` is in the checkpoint and nothing else is (but ignorable leftovers).

    ``owner`` completes "N tensor(s) ... are missing"; ``unexpected_context`` completes "(not part of ...)".
    """
    missing = [name for name in expected if name not in reader]
    if missing:
        whose = f" {owner}" if owner else ""
        raise CheckpointError(f"{reader.source}: {len(missing)} tensor(s){whose} are missing: {named_keys(missing)}")
    allowed = set(expected)
    unexpected = [k for k in reader.keys() if k not in allowed and not k.endswith(IGNORED_KEY_SUFFIXES)]
    if unexpected:
        raise CheckpointError(
            f"{reader.file_of(unexpected[0])}: unexpected tensor(s) {named_keys(unexpected)} (not part of {unexpected_context})"
        )


def check_float_shapes(reader: CheckpointReader, shapes: dict[str, tuple[int, ...]]) -> None:
    """Each named tensor has the shape the config implies and a floating-point dtype."""
    for name, shape in shapes.items():
        found = reader.shape(name)
        if found != shape:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {name!r} has shape {list(found)}, the config implies {list(shape)}"
            )
        if not reader.dtype(name).is_floating_point:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {name!r} has dtype {reader.dtype_name(name)}, expected a float type"
            )


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
