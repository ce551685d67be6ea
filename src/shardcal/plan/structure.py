"""What the planner plans from: the model built on the meta device, read as tables — parameters, Linears (and the
per-expert projections of fused experts), FSDP2 units, and each decoder layer's shape.

Nothing here is written per family: the same reading serves shardcal's classes and transformers' (``--model-impl``),
through the registry that finds the decoder layers (:mod:`shardcal.sharding.registry`), the FSDP2 units
``fsdp2_wrap`` would make (:func:`shardcal.sharding.fsdp2.fsdp2_units`), fused experts as
:mod:`shardcal.quant.expert_layout` reads them, and the foldable pairs the algorithms find
(:mod:`shardcal.algorithms.mappings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..algorithms.mappings import KINDS, layer_smoothings
from ..algorithms.memory import PlannedSmoothing
from ..errors import PlanError
from ..export.layout import stored_buffers
from ..loading.build import router_weight_names
from ..quant.expert_layout import PROJECTIONS, fused_experts_shape
from ..sharding.fsdp2 import fsdp2_units
from ..sharding.registry import LayerActivationCollector, decoder_layer_prefix

ROOT = "<root>"


@dataclass(frozen=True)
class Linear:
    """A Linear module (or one projection of one fused expert): its name, sizes, and the decoder layer it belongs
    to (None outside the stack)."""

    name: str
    in_features: int
    out_features: int
    layer: int | None


@dataclass(frozen=True)
class LayerShape:
    """What the forward of one decoder layer holds depends on: its experts (0: a dense layer), its widest MLP
    (the widest expert of a sparse layer), and its attention's sliding window (None: the whole prefix)."""

    num_experts: int
    ffn_width: int
    sliding_window: int | None

    @property
    def sparse(self) -> bool:
        return self.num_experts > 0


@dataclass
class ModelStructure:
    """A model as the planner sees it (see the module docstring); :func:`read_structure` builds it."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    layer_prefix: str
    layers: list[LayerShape]
    #: ``(name, shape)`` in ``named_parameters`` order (a tied head once, under the embeddings).
    params: list[tuple[str, tuple[int, ...]]]
    #: The parameters' dtypes as built (None: every parameter in the dtype the planner is asked for).
    built_dtypes: dict[str, torch.dtype] | None
    linears: list[Linear]
    #: Parameter name -> the FSDP2 unit that gathers it (a layer's name, an auxiliary module's, ``lm_head``, root).
    units: dict[str, str]
    #: FSDP2 units outside the stack other than the root, in module order (wrapped even with ``shard_root=False``,
    #: except ``lm_head``).
    side_units: list[str]
    routers: set[str]
    #: A fused experts parameter -> its per-expert tensors as the export stores them: ``(name, shape)``.
    fused: dict[str, list[tuple[str, tuple[int, ...]]]]
    model: nn.Module = field(repr=False)
    _smoothings: dict[int, list[PlannedSmoothing]] = field(default_factory=dict, repr=False)
    #: The model's persistent buffers ``(name, shape, dtype)`` (DeepSeek-V3's router correction bias): the export
    #: stores them beside the parameters.
    buffers: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> list[str]:
        return [f"{self.layer_prefix}.{i}" for i in range(self.num_layers)]

    def unit_of(self, name: str) -> str:
        """The unit of the parameter (or module) ``name``."""
        if name in self.units:
            return self.units[name]
        return _unit_of(name, self.layer_prefix, self.side_units)

    def smoothings(self, index: int) -> list[PlannedSmoothing]:
        """The foldable pairs of decoder layer ``index`` of every kind, as the algorithms find them at run time."""
        if index not in self._smoothings:
            layer = LayerActivationCollector.get_decoder_layers(self.model)[index]
            prefix = f"{self.layer_prefix}.{index}"
            names = {id(m): n for n, m in layer.named_modules(prefix=prefix)}
            self._smoothings[index] = [
                PlannedSmoothing(s.kind, int(s.consumers[0].in_features), tuple(names[id(c)] for c in s.consumers))
                for s in layer_smoothings(layer, KINDS, prefix=prefix)
            ]
        return self._smoothings[index]


def _unit_of(name: str, layer_prefix: str, side_units: list[str]) -> str:
    if name.startswith(layer_prefix + "."):
        return ".".join(name.split(".")[: layer_prefix.count(".") + 2])
    return max((u for u in side_units if name.startswith(u + ".")), key=len, default=ROOT)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def _attention_children(layer: nn.Module) -> set[str]:
    return {n for n, _ in layer.named_children() if "attn" in n or "attention" in n}


def _layer_shape(layer: nn.Module, hidden: int) -> LayerShape:
    attention = _attention_children(layer)
    experts, width = 0, 0
    for name, module in layer.named_modules():
        if name.split(".")[0] in attention:
            continue
        if isinstance(module, nn.Linear) and module.out_features == hidden:
            width = max(width, module.in_features)
        shape = fused_experts_shape(module, name, strict=False)
        if shape is not None:
            experts, width = max(experts, shape[0]), max(width, shape[2])
        elif name.endswith("experts") and isinstance(module, nn.ModuleList):
            experts = max(experts, len(module))
    window = None
    for name in sorted(attention):
        window = window or getattr(getattr(layer, name), "sliding_window", None)
    return LayerShape(experts, width, window if isinstance(window, int) else None)


def _linears(model: nn.Module, layer_prefix: str) -> tuple[list[Linear], dict[str, list[tuple[str, tuple[int, ...]]]]]:
    def layer_of(name: str) -> int | None:
        if not name.startswith(layer_prefix + "."):
            return None
        return int(name[len(layer_prefix) + 1 :].split(".")[0])

    out: list[Linear] = []
    fused: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out.append(Linear(name, module.in_features, module.out_features, layer_of(name)))
            continue
        shape = fused_experts_shape(module, name, strict=False)
        if shape is None:
            continue
        experts, hidden, inter = shape
        stored: dict[str, list[tuple[str, tuple[int, ...]]]] = {"gate_up_proj": [], "down_proj": []}
        for e in range(experts):
            for p in PROJECTIONS:
                in_f, out_f = (inter, hidden) if p == "down_proj" else (hidden, inter)
                out.append(Linear(f"{name}.{e}.{p}", in_f, out_f, layer_of(name)))
                stored["down_proj" if p == "down_proj" else "gate_up_proj"].append(
                    (f"{name}.{e}.{p}.weight", (out_f, in_f))
                )
        fused[f"{name}.gate_up_proj"], fused[f"{name}.down_proj"] = stored["gate_up_proj"], stored["down_proj"]
        for leaf, projections in (("gate_up_proj_bias", ("gate_proj", "up_proj")), ("down_proj_bias", ("down_proj",))):
            if isinstance(getattr(module, leaf, None), nn.Parameter):  # GPT-OSS: stored per expert as well
                fused[f"{name}.{leaf}"] = [
                    (f"{name}.{e}.{p}.bias", (hidden if p == "down_proj" else inter,))
                    for e in range(experts)
                    for p in projections
                ]
    return out, fused


def read_structure(model: nn.Module, model_type: str, *, hidden_size: int | None = None,
                   num_attention_heads: int | None = None, head_dim: int | None = None,
                   built_dtypes: bool = True) -> ModelStructure:  # fmt: skip
    """The planner's tables of ``model`` (built on the meta device). Sizes the modules do not carry (hidden size,
    heads, head dim) come from the arguments or the model's (text) config. ``built_dtypes``: keep the parameters'
    dtypes as built (False: they take the dtype the planner is asked for)."""
    layers = LayerActivationCollector.get_decoder_layers(model)
    if layers is None:
        raise PlanError(
            f"{type(model).__name__} ({model_type}): no decoder layers found, so there is nothing to plan; register "
            "the layout with shardcal.LayerActivationCollector.register_decoder_layer_support"
        )
    text = _text_config(model)
    hidden = hidden_size or int(text.hidden_size)
    heads = num_attention_heads or int(text.num_attention_heads)
    head_dim = head_dim or int(getattr(text, "head_dim", None) or hidden // heads)
    prefix = decoder_layer_prefix(model, layers)
    names = {id(m): n for n, m in model.named_modules()}
    order = {id(m): k for k, (_, m) in enumerate(model.named_modules())}
    inside = {id(x) for x in layers}
    side = [names[id(m)] for m in sorted(fsdp2_units(model), key=lambda m: order[id(m)]) if id(m) not in inside]
    params = [(n, tuple(int(d) for d in p.shape)) for n, p in model.named_parameters()]
    units = {n: _unit_of(n, prefix, side) for n, _ in params}
    linears, fused = _linears(model, prefix)
    dtypes = {n: p.dtype for n, p in model.named_parameters()} if built_dtypes else None
    buffers = [(n, tuple(int(d) for d in b.shape), b.dtype) for n, b in stored_buffers(model).items()]
    return ModelStructure(
        model_type, hidden, heads, head_dim, prefix, [_layer_shape(layer, hidden) for layer in layers], params,
        dtypes, linears, units, side, router_weight_names(model), fused, model, buffers=buffers,
    )  # fmt: skip
