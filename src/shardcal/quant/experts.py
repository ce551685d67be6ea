"""Quantizers for fused MoE experts: one weight quantizer per expert and projection, inputs observed per expert.

A fused-experts module's layout and each expert's weight slices are :mod:`.expert_layout`'s (found from the
module's structure, then checked against its own forward when the quantizers are attached, on the gathered layer).

There is no ``nn.Linear`` per expert to turn into a ``QuantLinear``. :func:`attach_expert_quantizers` adds, as the
experts module's children ``"0" .. "E-1"``, per-expert :class:`ExpertProjections` holding the quantizers of
``gate_proj`` / ``up_proj`` / ``down_proj`` — so their names are those of the original per-expert Linears
(``mlp.experts.3.gate_proj.weight_quantizer``), which is also how the export names the tensors — and one forward
pre-hook on the experts module that:

* in ``collect`` mode, feeds each expert's input quantizers the tokens routed to it (or all tokens while the
  holders' ``observe_all_tokens`` is set: the all-experts mode): the gate/up input is the block input, the down_proj
  input is what the module's gate function makes of ``x W_gate_up (+ bias)`` for that expert's tokens (full
  precision; :func:`~.expert_layout.down_input`);
* in ``quantize`` mode, fake-quantizes the block input with the largest of the experts' gate/up input ranges,
  which is what vLLM does with per-expert static input scales of a fused MoE layer (it takes their maximum).
  The down_proj input is exported with its calibrated scale but not fake-quantized here: inside the fused forward
  it has no module boundary a hook could reach.

Weights: each expert's slices (:func:`~.expert_layout.weight_slice`, ``[out, in]`` views of the fused parameters in
any layout) are calibrated by its own quantizers; :func:`store_quantized_weights` then writes the fake-quantized
values into the fused parameters (like GPTQ leaves its result in the weights), so the module's own forward computes
with quantized weights and the export encodes exactly those values. Biases are never quantized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ModelLayoutError
from .expert_layout import PROJECTIONS, down_input, fused_experts_layout, probe_layout, weight_slice
from .formats import fake_quantize
from .quantizer import QuantMode, TensorQuantizer
from .spec import QuantizerSpec
from .tokens import active_mask, real_tokens_of


class ProjectionQuantizers(nn.Module):
    """The quantizers of one expert's projection (the place of its ``nn.Linear``): weight and input."""

    def __init__(self, in_features: int, out_features: int, weight: QuantizerSpec | None, input: QuantizerSpec | None,
                 device: torch.device, name: str):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_quantizer = (
            None
            if weight is None
            else TensorQuantizer(weight, (out_features, in_features), device, f"{name}.weight_quantizer")
        )
        self.input_quantizer = None if input is None else TensorQuantizer(input, (in_features,), device, f"{name}.input_quantizer")  # fmt: skip


class ExpertProjections(nn.Module):
    """One expert's ``gate_proj``, ``up_proj`` and ``down_proj`` quantizers (children named like the Linears)."""

    def __init__(self, hidden: int, inter: int, specs: dict[str, tuple[QuantizerSpec | None, QuantizerSpec | None]],
                 device: torch.device, name: str):  # fmt: skip
        super().__init__()
        #: Set by the runner's all-experts mode: this expert observes every token of the block, not only its own.
        self.observe_all_tokens = False
        shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        for proj in PROJECTIONS:
            weight, input = specs.get(proj, (None, None))
            if weight is not None or input is not None:
                self.add_module(proj, ProjectionQuantizers(*shapes[proj], weight, input, device, f"{name}.{proj}"))


def expert_projections(module: nn.Module) -> list[ExpertProjections]:
    """The per-expert quantizer holders attached to a fused-experts module (empty when none are)."""
    return [m for m in module.children() if isinstance(m, ExpertProjections)]


def iter_projections(module: nn.Module) -> Iterator[tuple[int, str, ProjectionQuantizers]]:
    """``(expert, projection name, its quantizers)`` of every attached projection."""
    for child_name, holder in module.named_children():
        if isinstance(holder, ExpertProjections):
            for proj, q in holder.named_children():
                yield int(child_name), proj, q


def attach_expert_quantizers(
    module: nn.Module,
    name: str,
    select: Callable[[str], bool],
    weight: QuantizerSpec | Callable[[str, int], QuantizerSpec | None] | None,
    input: QuantizerSpec | None,
) -> list[str]:
    """Attach per-expert quantizers for the projections ``select(full name)`` targets; return those names.

    ``name`` is the experts module's full name; projection names are ``{name}.{e}.{gate_proj|up_proj|down_proj}``.
    ``weight`` is a spec, or ``weight(projection name, in_features)`` giving each projection's (a recipe's fitted
    group size). Idempotent: a module that has them already is left as it is.
    """
    if fused_experts_layout(module, name) is None:
        return []
    if expert_projections(module):
        return [f"{name}.{e}.{p}" for e, p, _ in iter_projections(module)]
    experts, hidden, inter = probe_layout(module, name).shape  # the weights are at hand: the forward decides
    device = _local_device(module.gate_up_proj)
    targeted = []
    in_features = {"gate_proj": hidden, "up_proj": hidden, "down_proj": inter}
    spec_of = weight if callable(weight) else (lambda _name, _in, spec=weight: spec)
    for e in range(experts):
        specs = {
            p: (spec_of(f"{name}.{e}.{p}", in_features[p]), input) for p in PROJECTIONS if select(f"{name}.{e}.{p}")
        }
        if specs:
            module.add_module(str(e), ExpertProjections(hidden, inter, specs, device, f"{name}.{e}"))
            targeted += [f"{name}.{e}.{p}" for p in specs]
    if targeted:
        module.expert_quantizer_hook = module.register_forward_pre_hook(_experts_pre_hook, with_kwargs=True)
    return targeted


def detach_expert_quantizers(module: nn.Module) -> bool:
    """Remove what :func:`attach_expert_quantizers` attached (the per-expert quantizers and the pre-hook); return
    whether there was anything."""
    holders = [name for name, child in module.named_children() if isinstance(child, ExpertProjections)]
    for name in holders:
        del module._modules[name]
    hook = module.__dict__.pop("expert_quantizer_hook", None)
    if hook is not None:
        hook.remove()
    return bool(holders)


def _local_device(t: torch.Tensor) -> torch.device:
    from torch.distributed.tensor import DTensor

    return t.to_local().device if isinstance(t, DTensor) else t.device


#: What the experts' forward calls the routed experts argument (transformers 5; GPT-OSS: ``router_indices``).
ROUTING_KWARGS = ("top_k_index", "router_indices")


def routed_experts(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The ``[T, k]`` expert indices a fused-experts forward was called with (second argument), or None."""
    if len(args) > 1:
        return args[1]
    return next((kwargs[k] for k in ROUTING_KWARGS if k in kwargs), None)


def _routing(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden, routed_experts(args, kwargs)


def _experts_pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    projections = list(iter_projections(module))
    inputs = [(e, p, q.input_quantizer) for e, p, q in projections if q.input_quantizer is not None]
    if not inputs:
        return None
    modes = {q.mode for _, _, q in inputs}
    if QuantMode.COLLECT in modes:
        _observe(module, args, kwargs, inputs)
        return None
    gate_up = [q for _, p, q in inputs if p != "down_proj" and q.mode is QuantMode.QUANTIZE]
    if not gate_up:
        return None
    hidden, _ = _routing(args, kwargs)
    quantized = _quantize_block_input(hidden, gate_up)
    if args:
        return (quantized, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": quantized}


def _quantize_block_input(x: torch.Tensor, quantizers: list[TensorQuantizer]) -> torch.Tensor:
    """``x`` fake-quantized with the largest static range of the experts (vLLM's rule), or dynamically."""
    first = quantizers[0]
    if first.spec.dynamic:
        return first(x)
    amax = torch.stack([q.amax for q in quantizers]).amax(dim=0)
    return fake_quantize(x, amax, first.spec, first.layout)


@torch.no_grad()
def _observe(module: nn.Module, args: tuple, kwargs: dict[str, Any], inputs: list) -> None:
    hidden, index = _routing(args, kwargs)
    if index is None:
        raise ModelLayoutError(
            f"{type(module).__name__}: fused experts called without top_k_index (or router_indices); cannot tell "
            "the routed tokens"
        )
    x = hidden.reshape(-1, hidden.shape[-1])
    all_tokens = any(h.observe_all_tokens for h in expert_projections(module))
    real = active_mask()  # padding never counts
    real = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if real is None else real.to(x.device)
    by_expert: dict[int, list[tuple[str, TensorQuantizer]]] = {}
    for e, p, q in inputs:
        by_expert.setdefault(e, []).append((p, q))
    for e, quantizers in by_expert.items():
        chosen = real if all_tokens else real & (index.reshape(x.shape[0], -1) == e).any(dim=-1)
        tokens = x[chosen]
        with real_tokens_of(None):  # the rows are chosen here already
            for p, q in quantizers:
                if p != "down_proj":
                    q(tokens)
            down = [q for p, q in quantizers if p == "down_proj"]
            if down:
                down[0](down_input(module, e, tokens))


def calibrate_expert_weights(module: nn.Module) -> None:
    """Calibrate every attached weight quantizer from its expert's slice (the gathered weight), then disable it."""
    for e, p, q in iter_projections(module):
        if q.weight_quantizer is not None:
            q.weight_quantizer.calibrate_from(weight_slice(module, e, p).detach())
            q.weight_quantizer.mode = QuantMode.DISABLED


@torch.no_grad()
def store_quantized_weights(module: nn.Module) -> int:
    """Write each calibrated expert slice back fake-quantized into the fused parameters; return how many."""
    written = 0
    for e, p, q in iter_projections(module):
        wq = q.weight_quantizer
        if wq is None:
            continue
        w = weight_slice(module, e, p)
        fake_quantize(w, wq.amax, wq.spec, wq.layout, wq.amin, out=w)  # in place, a chunk of rows at a time
        wq.mode = QuantMode.DISABLED  # the weights hold their quantized values now
        written += 1
    return written


def shared_input_quantizer(module: nn.Module, projection: str) -> TensorQuantizer | None:
    """One input quantizer for every expert's ``projection`` of the block, with the largest calibrated range.

    gate_proj and up_proj read the block input and share one range (what :func:`_experts_pre_hook` quantizes
    with); down_proj inputs get the largest of the experts' own ranges. vLLM's fused MoE kernels take the maximum
    over experts too. None when the projection has no input quantizers; dynamic inputs keep their spec only.
    """
    roles = ("gate_proj", "up_proj") if projection != "down_proj" else ("down_proj",)
    found = [q.input_quantizer for _, p, q in iter_projections(module) if p in roles and q.input_quantizer is not None]
    if not found:
        return None
    first = found[0]
    shared = TensorQuantizer(first.spec, first.layout.observed_shape, first.amax.device if first.amax is not None else None,
                             f"{first.name} (shared by the block's experts)")  # fmt: skip
    if not first.spec.dynamic:
        if not all(q.calibrated for q in found):
            return first  # the export reports the uncalibrated quantizer by name
        shared.set_amax(torch.stack([q.amax for q in found]).amax(dim=0))
    return shared
