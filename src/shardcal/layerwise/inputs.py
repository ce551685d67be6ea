"""What each decoder layer is called with, for any causal LM: shardcal's own models and models it did not write.

A layer is called as ``layer(hidden_states, *args, **kwargs)``; the hidden states change from layer to layer, the
rest (rotary tables, masks, position ids, flags) come from the model and depend only on the batch. This module
computes "the rest" once per batch and keeps it beside the hidden states:

* **shardcal's models** have ``embed(input_ids, attention_mask)``, which returns the stack's inputs directly
  (``position_embeddings`` and ``attention_mask``, the same for every layer).
* **Any other model** (transformers' classes, a user's module) runs its own forward with a forward pre-hook on
  the decoder layers that records the arguments a layer is called with (positional and keyword) and stops the
  forward there. Hooks are registered first (``prepend``), so the stopping layer is not even gathered by FSDP2;
  they are removed on exit, also on error. Layers can take different arguments in one model (sliding-window and
  full-attention layers, per-layer-type rotary tables): on the first batch's first sequence the forward runs
  through every layer but the last, recording all of them, and layers whose arguments are identical (the same
  objects, or equal tensors) and whose declared kind matches (``config.layer_types``, an attention's
  ``sliding_window``) share a *group*. On every batch only the first layer of each group is recorded, stopping at
  the last of those.

Every rank agrees on the groups (rank 0's), and when recording a batch means running layers (several groups), all
ranks run the same number of forwards — a rank with fewer batches runs small dummy ones — because under FSDP2 each
layer run is a collective.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelLayoutError
from ..runtime.distributed import all_reduce_, broadcast_json, world
from ..sharding.fsdp2 import fsdp2_root_unsharded
from ..sharding.residency import decoder_layers_replaced, residency_of
from .batches import Batch


@dataclass
class LayerCall:
    """The arguments of a layer call besides the hidden states: positional ``args`` after them, and ``kwargs``.

    ``hidden_keyword`` is set when the model passes the hidden states as a keyword (e.g. ``hidden_states=...``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden_keyword: str | None = None

    def to(self, device: torch.device) -> LayerCall:
        return LayerCall(move(self.args, device), move(self.kwargs, device), self.hidden_keyword)


@dataclass
class CachedInputs:
    """One batch's inputs to a decoder layer: hidden states, the padding mask, and each layer group's call.

    ``groups[i]`` is the index in ``calls`` of layer ``i``'s arguments (one group for shardcal's own models).
    """

    hidden_states: torch.Tensor
    token_mask: torch.Tensor | None  # [B, L] 1 = real token; statistics skip padding
    calls: list[LayerCall]
    groups: tuple[int, ...]

    def call_of(self, layer_index: int) -> LayerCall:
        return self.calls[self.groups[layer_index]]

    def with_hidden(self, hidden_states: torch.Tensor) -> CachedInputs:
        return CachedInputs(hidden_states, self.token_mask, self.calls, self.groups)


def move(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) on ``device``; other objects as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move(o, device) for o in obj)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    return obj


def call_layer(layer: Callable[..., Any], name: str, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """Run ``layer`` (the module, or a callable standing for its forward) with ``hidden`` in place of the hidden
    states; return its hidden-states output.

    A layer may return the hidden states or a tuple/list whose first element they are; anything else is an error
    naming the layer.
    """
    if call.hidden_keyword is not None:
        out = layer(*call.args, **{**call.kwargs, call.hidden_keyword: hidden})
    else:
        out = layer(hidden, *call.args, **call.kwargs)
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor) or first.shape != hidden.shape:
        what = type(out).__name__ if not isinstance(first, torch.Tensor) else f"a tensor of shape {list(first.shape)}"
        raise ModelLayoutError(
            f"{name}: the decoder layer returned {what}, not the hidden states (a tensor of shape "
            f"{list(hidden.shape)}, or a tuple whose first element is one)"
        )
    return first


# ----------------------------------------------------------------------------------------------- shardcal's models


def _embedder(model: nn.Module, layers: nn.ModuleList) -> nn.Module | None:
    """The module that holds the decoder layers, when it can embed (``embed(input_ids, attention_mask)``)."""
    for module in model.modules():
        if any(child is layers for child in module.children()):
            return module if callable(getattr(module, "embed", None)) else None
    return None


def _embedded(
    embedder: nn.Module, batch: Batch, n_layers: int, device: torch.device, cache: torch.device
) -> CachedInputs:
    mask = None if batch.attention_mask is None else batch.attention_mask.to(device)
    inputs = embedder.embed(batch.input_ids.to(device), mask)
    call = LayerCall((), {"position_embeddings": inputs.position_embeddings, "attention_mask": inputs.attention_mask})
    token_mask = None if batch.attention_mask is None else batch.attention_mask.to(cache)
    return CachedInputs(inputs.hidden_states.to(cache), token_mask, [call.to(cache)], (0,) * n_layers)


# ----------------------------------------------------------------------------------------------- any other model


class _Recorded(BaseException):
    """Raised by the recording hook to stop the model's forward once the last wanted layer's call is recorded
    (a BaseException, so that an ``except Exception`` inside a model's forward does not swallow it)."""


def _forward_arguments(model: nn.Module, batch: Batch, device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """How to call the model's forward for ``batch``: ids positionally, the padding mask and no cache by keyword."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        params = {}
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if batch.attention_mask is not None:
        if "attention_mask" not in params and not any_keyword:
            raise ModelLayoutError(
                f"{type(model).__name__}.forward takes no attention_mask, but the calibration data are padded "
                "(rows of different lengths); give rows of one length"
            )
        kwargs["attention_mask"] = batch.attention_mask.to(device)
    if "use_cache" in params or (any_keyword and hasattr(getattr(model, "config", None), "use_cache")):
        kwargs["use_cache"] = False  # no KV cache: the layers get cache=None
    return (batch.input_ids.to(device),), kwargs


#: Keyword arguments that carry a KV cache: a recorded call must not keep one (every later call would extend it).
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _split_hidden(name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, LayerCall]:
    """The hidden states a layer is called with, and the rest of its call (without a KV cache)."""
    kwargs = {k: (None if k in CACHE_KEYWORDS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if args:
        return args[0], LayerCall(tuple(args[1:]), dict(kwargs))
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return kwargs["hidden_states"], LayerCall((), rest, "hidden_states")
    raise ModelLayoutError(f"{name}: the decoder layer was called without the hidden states (no positional argument)")


def _record(
    model: nn.Module, layers: nn.ModuleList, prefix: str, batch: Batch, wanted: Sequence[int], device: torch.device
) -> dict[int, tuple[torch.Tensor | None, LayerCall]]:
    """Run the model's forward on ``batch`` until the calls of the ``wanted`` layers are recorded.

    Only layer 0's hidden states are kept (the stack's input); other layers' are dropped at once (``None``).
    """
    records: dict[int, tuple[torch.Tensor | None, LayerCall]] = {}
    last = max(wanted)
    handles = []

    def hook(index: int):
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden, call = _split_hidden(f"{prefix}.{index}", args, kwargs)
            records[index] = (hidden if index == 0 else None, call)
            if index == last:
                raise _Recorded

        return record

    for index in wanted:
        handles.append(layers[index].register_forward_pre_hook(hook(index), with_kwargs=True, prepend=True))
    args, kwargs = _forward_arguments(model, batch, device)
    try:
        model(*args, **kwargs)
    except _Recorded:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = [i for i in wanted if i not in records]
    if missing:
        raise ModelLayoutError(
            f"{type(model).__name__}: its forward never called decoder layer {prefix}.{missing[0]} (the layers the "
            "registry found); the model's forward must run its decoder layers"
        )
    return records


def _same(a: Any, b: Any) -> bool:
    """The same argument: the same object, or equal tensors / containers / plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float, str, bool, type(None))) and isinstance(b, (int, float, str, bool, type(None))):
        return a == b
    return False


def _same_call(a: LayerCall, b: LayerCall) -> bool:
    return a.hidden_keyword == b.hidden_keyword and _same(a.args, b.args) and _same(a.kwargs, b.kwargs)


def _declared_kind(model: nn.Module, layers: nn.ModuleList, index: int) -> tuple[Any, ...]:
    """What a model says about a layer's attention, by duck typing: its ``layer_types`` entry, sliding window."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    types = getattr(text, "layer_types", None)
    kind = types[index] if isinstance(types, (list, tuple)) and len(types) == len(layers) else None
    layer = layers[index]
    attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    sliding = getattr(attention, "sliding_window", None) if attention is not None else None
    return (kind, getattr(layer, "attention_type", None), sliding if isinstance(sliding, (int, type(None))) else None)


def _groups(
    model: nn.Module, layers: nn.ModuleList, records: dict[int, tuple[torch.Tensor | None, LayerCall]]
) -> list[int]:
    """Layer index -> index of the first layer called with the same arguments and declaring the same kind."""
    groups: list[int] = []
    representatives: list[int] = []
    for i in range(len(layers)):
        for g, r in enumerate(representatives):
            if _declared_kind(model, layers, i) == _declared_kind(model, layers, r) and _same_call(
                records[i][1], records[r][1]
            ):
                groups.append(g)
                break
        else:
            representatives.append(i)
            groups.append(len(representatives) - 1)
    return groups


def _dummy_batch() -> Batch:
    return Batch(torch.zeros(1, 8, dtype=torch.long))


def _captured(
    model: nn.Module,
    layers: nn.ModuleList,
    prefix: str,
    batches: Sequence[Batch],
    device: torch.device,
    cache: torch.device,
    kinds_of: nn.ModuleList | None = None,
) -> list[CachedInputs]:
    """Every batch's layer inputs from the model's own forward (see the module docstring). Collective. ``kinds_of``:
    the real layers, whose declared kinds group them, where ``layers`` stand in for them."""
    n_layers = len(layers)
    rank, world_size = world()
    # The groups, from the first batch's first sequence alone: every layer but the last runs on it, all are
    # recorded; rank 0's grouping is everyone's.
    probe = _first_row(batches[0]) if batches else _dummy_batch()
    grouping = _record(model, layers, prefix, probe, range(n_layers), device)
    groups = broadcast_json(_groups(model, kinds_of or layers, grouping) if rank == 0 else None)
    del grouping
    representatives = [groups.index(g) for g in range(max(groups) + 1)]

    forwards = torch.tensor([len(batches)], dtype=torch.int64)
    if max(representatives) > 0 and world_size > 1:  # recording runs layers (collectives): equal counts everywhere
        all_reduce_(forwards, "max")
    out = []
    for b in range(int(forwards)):
        batch = batches[b] if b < len(batches) else _dummy_batch()
        records = _record(model, layers, prefix, batch, representatives, device)
        if b < len(batches):
            out.append(_cached(batch, records, representatives, groups, cache))
    return out


def _first_row(batch: Batch) -> Batch:
    """The batch's first sequence (padded as in the batch): what the layer groups are found on, at a fraction of
    running every layer on the whole batch. A layer's arguments differ from another's by the layer's kind (a
    sliding window, its rotary table), which shows on any sequence of the batch's length."""
    mask = None if batch.attention_mask is None else batch.attention_mask[:1]
    return Batch(batch.input_ids[:1], mask)


def _cached(
    batch: Batch, records: dict, representatives: list[int], groups: list[int], cache: torch.device
) -> CachedInputs:
    hidden = records[0][0]
    calls = [records[r][1].to(cache) for r in representatives]
    token_mask = None if batch.attention_mask is None else batch.attention_mask.to(cache)
    return CachedInputs(hidden.detach().to(cache), token_mask, calls, tuple(groups))


# ----------------------------------------------------------------------------------------------- entry point


class PassThrough(nn.Module):
    """Stands in for a decoder layer that is not in memory (a streamed model's, on the meta device) while the model's
    own forward is recorded: called as the layer would be, it gives back the hidden states it gets, and answers for
    the layer's other attributes (an ``attention_type`` the forward reads to pick the layer's mask). The forward then
    runs past every layer without computing one — each layer's call recorded as the model makes it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.__dict__["_stands_for"] = layer

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_stands_for"], name)


def stand_ins_for(layers: nn.ModuleList) -> nn.ModuleList:
    """A :class:`PassThrough` for each decoder layer, in order: each answers for its own layer."""
    return nn.ModuleList(PassThrough(layer) for layer in layers)


def layer_inputs(
    model: nn.Module,
    layers: nn.ModuleList,
    prefix: str,
    batches: Sequence[Batch],
    device: torch.device,
    cache_device: torch.device,
) -> list[CachedInputs]:
    """The first decoder layer's inputs for each of this rank's batches, with every layer's call arguments.

    Runs inside :func:`fsdp2_root_unsharded` (the root's embeddings gathered once). Collective when the model is
    sharded: every rank calls it, also one with no batches. A model whose decoder layers are streamed (not in memory)
    and that has no ``embed`` is recorded with :class:`PassThrough` layers in place of its own.
    """
    with torch.no_grad(), fsdp2_root_unsharded(model):
        embedder = _embedder(model, layers)
        if embedder is not None:
            return [_embedded(embedder, b, len(layers), device, cache_device) for b in batches]
        if not residency_of(model).streamed:
            return _captured(model, layers, prefix, batches, device, cache_device)
        stand_ins = stand_ins_for(layers)
        with decoder_layers_replaced(model, layers, stand_ins):
            return _captured(model, stand_ins, prefix, batches, device, cache_device, kinds_of=layers)
