"""LayerActivationCollector finds decoder layers by duck typing, and user layouts take precedence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from shardcal import LayerActivationCollector
from shardcal.models import CausalLM, ModelConfig
from shardcal.sharding.registry import BUILTIN_LAYOUTS, decoder_layer_prefix

from _tiny_models import TINY_CONFIGS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class OtherBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def blocks(n: int = 3, cls: type[nn.Module] = Block) -> nn.ModuleList:
    return nn.ModuleList(cls() for _ in range(n))


def nest(path: str, leaf: nn.Module) -> nn.Module:
    """A plain module tree with ``leaf`` at dotted ``path`` (every intermediate a bare nn.Module)."""
    root = nn.Module()
    node = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(parts[-1], leaf)
    return root


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Every registration a test makes is removed afterwards, whatever happens."""
    before = list(LayerActivationCollector._user)
    yield
    for pair in list(LayerActivationCollector._user):
        if pair not in before:
            LayerActivationCollector.unregister_decoder_layer_support(*pair)
    assert LayerActivationCollector._user == before


def test_builtin_layouts_are_the_documented_ones() -> None:
    assert BUILTIN_LAYOUTS == (
        "layers",
        "model.layers",
        "language_model.layers",
        "model.language_model.layers",
        "transformer.h",
        "gpt_neox.layers",
        "backbone.layers",
        "decoder.layers",
    )


@pytest.mark.parametrize("path", BUILTIN_LAYOUTS)
def test_builtin_layout_is_found(path: str) -> None:
    layers = blocks()
    model = nest(path, layers)
    assert LayerActivationCollector.get_decoder_layers(model) is layers
    assert LayerActivationCollector.is_supported(model)
    assert decoder_layer_prefix(model, layers) == path


def test_builtin_priority_follows_the_listed_order() -> None:
    """A model with both ``model.layers`` and ``transformer.h`` gets ``model.layers`` (listed first)."""
    model = nest("model.layers", blocks())
    model.add_module("transformer", nest("h", blocks(2, OtherBlock)))
    assert LayerActivationCollector.get_decoder_layers(model) is model.model.layers


def test_our_causal_lm_is_supported() -> None:
    model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS["qwen2_moe"]))
    # Dense and sparse decoder layers are one class, so the stack counts as uniform.
    assert LayerActivationCollector.get_decoder_layers(model) is model.model.layers
    assert decoder_layer_prefix(model, model.model.layers) == "model.layers"


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(nn.Linear(4, 4), id="no-layers"),
        pytest.param(nest("model.blocks", blocks()), id="unknown-path"),
        pytest.param(nest("model.layers", nn.ModuleList()), id="empty-list"),
        pytest.param(nest("model.layers", nn.Sequential(Block(), Block())), id="not-a-modulelist"),
        pytest.param(nest("model.layers", nn.ModuleList([Block(), OtherBlock(), Block()])), id="mixed-types"),
    ],
)
def test_unsupported_model(model: nn.Module) -> None:
    assert LayerActivationCollector.get_decoder_layers(model) is None
    assert LayerActivationCollector.is_supported(model) is False


def test_plain_attribute_that_is_not_a_module_is_ignored() -> None:
    model = nn.Module()
    model.layers = [Block(), Block()]  # a plain list, not registered as a submodule
    assert LayerActivationCollector.get_decoder_layers(model) is None


def test_mixed_types_fall_through_to_the_next_layout() -> None:
    """A mixed-type list at a higher-priority path is rejected; a uniform one further down is still found."""
    model = nest("model.layers", nn.ModuleList([Block(), OtherBlock()]))
    model.add_module("decoder", nest("layers", blocks()))
    assert LayerActivationCollector.get_decoder_layers(model) is model.decoder.layers


def test_custom_layout() -> None:
    model = nest("trunk.stages", blocks(4))
    assert not LayerActivationCollector.is_supported(model)

    def predicate(m: nn.Module) -> bool:
        return hasattr(m, "trunk")

    def discoverer(m: nn.Module) -> nn.ModuleList:
        return m.trunk.stages

    LayerActivationCollector.register_decoder_layer_support(predicate, discoverer)
    assert LayerActivationCollector.get_decoder_layers(model) is model.trunk.stages
    assert LayerActivationCollector.is_supported(model)
    LayerActivationCollector.unregister_decoder_layer_support(predicate, discoverer)
    assert not LayerActivationCollector.is_supported(model)


def test_custom_layout_takes_precedence_over_builtin() -> None:
    model = nest("model.layers", blocks())
    model.add_module("real_stack", blocks(2, OtherBlock))

    def predicate(m: nn.Module) -> bool:
        return hasattr(m, "real_stack")

    def discoverer(m: nn.Module) -> nn.ModuleList:
        return m.real_stack

    assert LayerActivationCollector.get_decoder_layers(model) is model.model.layers
    LayerActivationCollector.register_decoder_layer_support(predicate, discoverer)
    assert LayerActivationCollector.get_decoder_layers(model) is model.real_stack


def test_later_registration_takes_precedence_over_earlier() -> None:
    model = nn.Module()
    model.add_module("a", blocks(1))
    model.add_module("b", blocks(2))

    def always(m: nn.Module) -> bool:
        return True

    def find_a(m: nn.Module) -> nn.ModuleList:
        return m.a

    def find_b(m: nn.Module) -> nn.ModuleList:
        return m.b

    LayerActivationCollector.register_decoder_layer_support(always, find_a)
    LayerActivationCollector.register_decoder_layer_support(always, find_b)
    assert LayerActivationCollector.get_decoder_layers(model) is model.b
    LayerActivationCollector.unregister_decoder_layer_support(always, find_b)
    assert LayerActivationCollector.get_decoder_layers(model) is model.a


def test_registering_the_same_pair_twice_is_a_no_op() -> None:
    def predicate(m: nn.Module) -> bool:
        return hasattr(m, "stack")

    def discoverer(m: nn.Module) -> nn.ModuleList:
        return m.stack

    before = len(LayerActivationCollector._user)
    LayerActivationCollector.register_decoder_layer_support(predicate, discoverer)
    LayerActivationCollector.register_decoder_layer_support(predicate, discoverer)
    assert len(LayerActivationCollector._user) == before + 1
    # One unregister removes it completely.
    LayerActivationCollector.unregister_decoder_layer_support(predicate, discoverer)
    assert len(LayerActivationCollector._user) == before
    assert LayerActivationCollector.get_decoder_layers(nest("stack", blocks())) is None  # not a built-in path


def test_unregistering_an_unknown_pair_is_a_no_op() -> None:
    before = list(LayerActivationCollector._user)
    LayerActivationCollector.unregister_decoder_layer_support(lambda m: True, lambda m: None)
    assert LayerActivationCollector._user == before


def test_custom_discoverer_returning_none_falls_through() -> None:
    """A predicate that matches but a discoverer that finds nothing lets the built-ins try."""
    model = nest("model.layers", blocks())

    def always(m: nn.Module) -> bool:
        return True

    def nothing(m: nn.Module) -> None:
        return None

    LayerActivationCollector.register_decoder_layer_support(always, nothing)
    assert LayerActivationCollector.get_decoder_layers(model) is model.model.layers


def test_custom_predicate_false_skips_discoverer() -> None:
    calls: list[nn.Module] = []

    def never(m: nn.Module) -> bool:
        return False

    def discoverer(m: nn.Module) -> nn.ModuleList:
        calls.append(m)
        return blocks()

    LayerActivationCollector.register_decoder_layer_support(never, discoverer)
    assert LayerActivationCollector.get_decoder_layers(nn.Linear(2, 2)) is None
    assert calls == []


def test_custom_discoverer_must_return_a_module_list() -> None:
    model = nest("stack", blocks())

    def always(m: nn.Module) -> bool:
        return True

    def as_python_list(m: nn.Module) -> list[nn.Module]:
        return list(m.stack)

    LayerActivationCollector.register_decoder_layer_support(always, as_python_list)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as_python_list"):
        LayerActivationCollector.get_decoder_layers(model)


def test_layers_found_on_a_meta_model() -> None:
    """Discovery touches no tensors, so it works before materialisation."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS["llama"]))
    assert LayerActivationCollector.get_decoder_layers(model) is model.model.layers
