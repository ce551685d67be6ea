"""Quantizers for fused MoE experts: one weight quantizer per expert and projection, inputs observed per expert.

transformers stores a block's experts as two 3-D parameters (Qwen2/3-MoE, Mixtral, DeepSeek-style blocks)::

    gate_up_proj [E, 2I, H]   rows 0..I-1: expert e's gate_proj weight, rows I..2I-1: its up_proj weight
    down_proj    [E, H, I]    expert e's down_proj weight
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])

There is no ``nn.Linear`` per expert to turn into a ``QuantLinear``. :func:`attach_expert_quantizers` adds, as the
experts module's children ``"0" .. "E-1"``, per-expert :class:`ExpertProjections` holding the quantizers of
``gate_proj`` / ``up_proj`` / ``down_proj`` — so their names are those of the original per-expert Linears
(``mlp.experts.3.gate_proj.weight_quantizer``), which is also how the export names the tensors — and one forward
pre-hook on the experts module that:

* in ``collect`` mode, feeds each expert's input quantizers the tokens routed to it (or all tokens while the
  holders' ``observe_all_tokens`` is set: the all-experts mode): the gate/up input is the block input, the down_proj input
  is ``act(x W_gate^T) * (x W_up^T)`` computed for that expert's tokens (full precision);
* in ``quantize`` mode, fake-quantizes the block input with the largest of the experts' gate/up input ranges,
  which is what vLLM does with per-expert static input scales of a fused MoE layer (it takes their maximum).
  The down_proj input is exported with its calibrated scale but not fake-quantized here: inside the fused forward
  it has no module boundary a hook could reach.

Weights: each expert's slices are calibrated by its own quantizers; :func:`store_quantized_weights` then writes the
fake-quantized values into the fused parameters (like GPTQ leaves its result in the weights), so the module's own
forward computes with quantized weights and the export encodes exactly those values.

Layouts other than the one above (GPT-OSS's transposed, interleaved experts with biases; unknown 3-D parameters)
are refused with an error naming the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ModelLayoutError
from .formats import fake_quantize
from .quantizer import QuantMode, TensorQuantizer
from .spec import QuantizerSpec
from .tokens import active_mask, real_tokens_of

#: The per-expert projections, in export order, and how each takes its weight out of the fused parameters.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _is_fused_experts_candidate(module: nn.Module) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def fused_experts_shape(module: nn.Module, name: str, strict: bool = True) -> tuple[int, int, int] | None:
    """``(experts, hidden, intermediate)`` of a fused-experts module of the supported layout; None for a module
    without 3-D parameters; for a fused layout shardcal does not know, :class:`ModelLayoutError` naming the module
    (``strict``) or None (its parameters are then stored as they are)."""
    if not _is_fused_experts_candidate(module):
        return None
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    own = {n for n, _ in module.named_parameters(recurse=False)}
    problem = None
    if (
        not isinstance(gate_up, torch.Tensor)
        or not isinstance(down, torch.Tensor)
        or own != {"gate_up_proj", "down_proj"}
    ):
        problem = f"parameters {sorted(own)} (expected exactly gate_up_proj [E, 2I, H] and down_proj [E, H, I])"
    elif getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        problem = "transposed or biased experts (GPT-OSS style)"
    elif gate_up.dim() != 3 or down.dim() != 3:
        problem = f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not both 3-D"
    else:
        experts, two_inter, hidden = gate_up.shape
        if tuple(down.shape) != (experts, hidden, two_inter // 2) or two_inter % 2:
            problem = (
                f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} do not fit [E, 2I, H] / [E, H, I]"
            )
        elif not callable(getattr(module, "act_fn", None)):
            problem = "no act_fn (the activation between gate and down)"
    if problem is not None and not strict:
        return None
    if problem is not None:
        raise ModelLayoutError(
            f"{name}: a fused-experts layout shardcal does not know: {problem}; exclude it from the recipe "
            "(targets.exclude) to leave it unquantized"
        )
    experts, two_inter, hidden = gate_up.shape
    return int(experts), int(hidden), int(two_inter // 2)


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


def weight_slice(module: nn.Module, expert: int, proj: str) -> torch.Tensor:
    """Expert ``expert``'s ``proj`` weight ``[out, in]``, a view of the fused parameter (gathered when sharded)."""
    inter = module.down_proj.shape[-1]
    if proj == "gate_proj":
        return module.gate_up_proj[expert, :inter]
    if proj == "up_proj":
        return module.gate_up_proj[expert, inter:]
    return module.down_proj[expert]


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
    shape = fused_experts_shape(module, name)
    if shape is None:
        return []
    if expert_projections(module):
        return [f"{name}.{e}.{p}" for e, p, _ in iter_projections(module)]
    experts, hidden, inter = shape
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


def _routing(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = args[0] if args else kwargs["hidden_states"]
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    return hidden, index


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
            f"{type(module).__name__}: fused experts called without top_k_index; cannot tell the routed tokens"
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
                gate = tokens @ weight_slice(module, e, "gate_proj").T.to(tokens.dtype)
                up = tokens @ weight_slice(module, e, "up_proj").T.to(tokens.dtype)
                down[0](module.act_fn(gate) * up)


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
        w.copy_(fake_quantize(w, wq.amax, wq.spec, wq.layout, wq.amin).to(w.dtype))
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
