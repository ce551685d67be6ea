"""What activation collection observes: target patterns (``model.layers.*.mlp.down_proj:input``), resolved to modules.

A target is a module name pattern and the tensor to observe, ``PATTERN[:input|output]``:

* the pattern is matched against the model's module names (``model.named_modules()``) segment by segment: it has
  as many dot-separated segments as the name, and each segment is an ``fnmatch`` pattern for the name's segment
  (``*`` stands for one segment, or part of one: ``model.layers.1*``); so ``model.layers.*`` names the decoder
  layers themselves, not their submodules;
* ``:input`` is the first positional argument the module is called with (the ``hidden_states`` keyword when it
  has none); ``:output`` (the default) is what it returns, the first element when that is a tuple or list. So
  ``model.layers.*:output`` is the residual stream after each decoder layer.

Only modules inside the decoder layers (the layers themselves included) are observed: they run while their layer
is gathered for its step. A pattern that also matches a module outside them (the embeddings, the final norm,
``lm_head``) is refused; the embeddings' output is ``<layers>.0:input`` and the last residual stream
``<layers>.<last>:output``. Errors are :class:`~shardcal.errors.CollectionError`, one line naming the pattern.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CollectionError

#: The tensors a target can observe.
SELECTORS = ("input", "output")
#: The tensor observed when a target names none.
DEFAULT_SELECTOR = "output"


@dataclass(frozen=True)
class TargetPattern:
    """One target as given: ``text`` (``"model.layers.*:output"``), its module pattern and its tensor selector."""

    text: str
    module: str
    tensor: str


@dataclass(frozen=True)
class Target:
    """One observed tensor: module ``module`` (a full module name) inside decoder layer ``layer``."""

    module: str
    tensor: str
    pattern: str  # the TargetPattern.text it came from
    layer: int
    relative: str  # the module's name inside its layer ("" for the layer itself)

    @property
    def name(self) -> str:
        """``"<module>:<tensor>"``, the key of this target in reports and saved activations."""
        return f"{self.module}:{self.tensor}"


def parse_target(text: Any) -> TargetPattern:
    """``"PATTERN[:input|output]"`` as a :class:`TargetPattern`; a :class:`CollectionError` naming a bad one."""
    if not isinstance(text, str) or not text.strip():
        raise CollectionError(f"target {text!r}: not a module name pattern (e.g. 'model.layers.*.mlp.down_proj:input')")
    text = text.strip()
    module, colon, selector = text.rpartition(":")
    if not colon:
        module, selector = text, DEFAULT_SELECTOR
    if selector not in SELECTORS:
        raise CollectionError(
            f"target {text!r}: unknown tensor selector {':' + selector!r} (use {' or '.join(':' + s for s in SELECTORS)})"
        )
    if not module or any(not part for part in module.split(".")):
        raise CollectionError(f"target {text!r}: {module!r} is not a module name pattern (empty name segment)")
    return TargetPattern(text, module, selector)


def parse_targets(targets: str | Iterable[str]) -> list[TargetPattern]:
    """Every target of ``targets`` (one string or several) parsed; at least one is needed."""
    texts = [targets] if isinstance(targets, str) else list(targets)
    if not texts:
        raise CollectionError("targets: none given (e.g. 'model.layers.*:output')")
    return [parse_target(t) for t in texts]


def name_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches ``pattern`` segment by segment (see the module docstring)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def layer_of(name: str, prefix: str, num_layers: int) -> tuple[int, str] | None:
    """``(layer index, name inside the layer)`` of module ``name`` under decoder layers ``prefix``, or None."""
    head = f"{prefix}." if prefix else ""
    if not name.startswith(head):
        return None
    index, _, relative = name[len(head) :].partition(".")
    if not index.isdigit() or int(index) >= num_layers or str(int(index)) != index:
        return None
    return int(index), relative


def resolve_targets(model: nn.Module, patterns: Sequence[TargetPattern], prefix: str, num_layers: int) -> list[Target]:
    """The targets ``patterns`` select in ``model``, ordered by layer, then module order, then pattern order.

    Raises a :class:`CollectionError` naming the pattern when it matches no module, or a module outside the decoder
    layers. A module and tensor selected by several patterns is observed once (for the first of them).
    """
    names = [name for name, _ in model.named_modules()]
    order = {name: i for i, name in enumerate(names)}
    last = f"{prefix}.{num_layers - 1}" if prefix else str(num_layers - 1)
    found: dict[str, Target] = {}
    for p in patterns:
        matched = [name for name in names if name and name_matches(p.module, name)]
        if not matched:
            raise CollectionError(
                f"target {p.text!r}: matches no module of {type(model).__name__} (its decoder layers are "
                f"{prefix}.0 .. {last}; names are matched segment by segment, '*' within one segment)"
            )
        for name in matched:
            where = layer_of(name, prefix, num_layers)
            if where is None:
                raise CollectionError(
                    f"target {p.text!r}: matches {name}, which is outside the decoder layers; only modules inside "
                    f"them are observed (the embeddings are {prefix}.0:input, the last residual stream {last}:output)"
                )
            target = Target(name, p.tensor, p.text, where[0], where[1])
            found.setdefault(target.name, target)
    return sorted(found.values(), key=lambda t: (t.layer, order[t.module], SELECTORS.index(t.tensor)))


def observed_tensor(tensor: str, args: tuple, kwargs: dict[str, Any], output: Any = None) -> Any:
    """What a hook observes: for ``"input"`` the first positional argument (else the ``hidden_states`` keyword), for
    ``"output"`` the output (its first element for a tuple or list). May be something other than a tensor."""
    if tensor == "input":
        if args:
            return args[0]
        return kwargs.get("hidden_states")
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.is_floating_point()
