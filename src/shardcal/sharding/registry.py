"""Where are a model's decoder layers? A registry of (predicate, discoverer) pairs.

Layer-by-layer calibration and FSDP2 wrapping both need the model's stack of decoder layers. Model code
differs in where it keeps them (``model.layers``, ``transformer.h``, ``language_model.layers`` in a VLM, ...),
so the lookup is a registry: built-in discoverers recognise common layouts by duck typing (no Hugging Face
classes are imported), and users register their own layouts, which take precedence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import nn

from ..errors import ModelLayoutError

Predicate = Callable[[nn.Module], bool]
Discoverer = Callable[[nn.Module], "nn.ModuleList | None"]


def _same_typed_layers(candidate: object) -> nn.ModuleList | None:
    """``candidate`` if it is a non-empty ModuleList whose entries all have one type, else None."""
    if not isinstance(candidate, nn.ModuleList) or len(candidate) == 0:
        return None
    first = type(candidate[0])
    if any(type(layer) is not first for layer in candidate):
        return None
    return candidate


def _attribute_path(path: str) -> tuple[Predicate, Discoverer]:
    """A (predicate, discoverer) pair for layers kept at a dotted attribute path, e.g. ``model.layers``."""
    parts = path.split(".")

    def discover(model: nn.Module) -> nn.ModuleList | None:
        obj: object = model
        for part in parts:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return _same_typed_layers(obj)

    def predicate(model: nn.Module) -> bool:
        return discover(model) is not None

    predicate.__qualname__ = discover.__qualname__ = f"layers_at[{path}]"
    return predicate, discover


#: Built-in layouts (attribute paths from the root module), in priority order: a base model's own
#: ``layers``, a causal LM's ``model.layers``, a VLM's ``language_model.layers`` (with or without ``model.``),
#: then GPT-2, GPT-NeoX, Mamba-style and encoder-decoder stacks.
BUILTIN_LAYOUTS: tuple[str, ...] = (
    "layers",
    "model.layers",
    "language_model.layers",
    "model.language_model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "backbone.layers",
    "decoder.layers",
)


class LayerActivationCollector:
    """Class-level registry that finds a model's decoder layers.

    ``register_decoder_layer_support(predicate, discoverer)`` adds a layout: ``predicate(model)`` says whether the
    layout applies, ``discoverer(model)`` returns the ``nn.ModuleList`` of decoder layers (or None to let the
    next layout try). User registrations are consulted before the built-ins, most recent first; the built-ins in
    :data:`BUILTIN_LAYOUTS` order. Registering the same pair twice is a no-op. Built-in layouts accept only a
    non-empty ``nn.ModuleList`` whose layers share one class; a user discoverer decides for itself.
    """

    _user: ClassVar[list[tuple[Predicate, Discoverer]]] = []
    _builtin: ClassVar[list[tuple[Predicate, Discoverer]]] = [_attribute_path(p) for p in BUILTIN_LAYOUTS]

    @classmethod
    def register_decoder_layer_support(cls, predicate: Predicate, discoverer: Discoverer) -> None:
        """Register a layout; it takes precedence over the built-ins and over earlier registrations."""
        pair = (predicate, discoverer)
        if pair in cls._user:
            return
        cls._user.insert(0, pair)

    @classmethod
    def unregister_decoder_layer_support(cls, predicate: Predicate, discoverer: Discoverer) -> None:
        """Remove a layout registered earlier (no-op if it is not registered)."""
        pair = (predicate, discoverer)
        if pair in cls._user:
            cls._user.remove(pair)

    @classmethod
    def get_decoder_layers(cls, model: nn.Module) -> nn.ModuleList | None:
        """The model's decoder layers, or None when no registered layout recognises the model."""
        for predicate, discoverer in (*cls._user, *cls._builtin):
            if not predicate(model):
                continue
            layers = discoverer(model)
            if layers is None:
                continue  # the layout applies but found nothing here: let the next one try
            if not isinstance(layers, nn.ModuleList):
                name = getattr(discoverer, "__qualname__", repr(discoverer))
                raise TypeError(
                    f"decoder-layer discoverer {name} returned {type(layers).__name__}, expected nn.ModuleList or None"
                )
            return layers
        return None

    @classmethod
    def is_supported(cls, model: nn.Module) -> bool:
        """Whether some registered layout finds decoder layers in ``model``."""
        return cls.get_decoder_layers(model) is not None


def no_decoder_layers(model: nn.Module) -> ModelLayoutError:
    """The one error for a model in which no registered layout finds decoder layers (every caller raises this)."""
    return ModelLayoutError(
        f"{type(model).__name__}: no decoder layers found; register the layout with "
        "shardcal.LayerActivationCollector.register_decoder_layer_support(predicate, discoverer), where "
        "discoverer(model) returns the nn.ModuleList of decoder layers"
    )


def require_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers; :func:`no_decoder_layers` when no registered layout finds them."""
    layers = LayerActivationCollector.get_decoder_layers(model)
    if layers is None:
        raise no_decoder_layers(model)
    return layers


def decoder_layer_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    """The qualified name of ``layers`` inside ``model`` (e.g. ``model.layers``), for naming layers in reports."""
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise ValueError("layers is not a submodule of model")
