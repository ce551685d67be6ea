"""MoE calibration: every expert observes every token (all-experts mode), and a fallback for unrouted experts.

Routing sends each token to its top-k experts, so with little calibration data some experts see few or no tokens.
:class:`AllExpertsObserve` lets every expert's quantizers observe all tokens of the block (the layer's output is
unchanged); :func:`fallback_unobserved` gives quantizers that still saw nothing their sibling experts' range.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..quant.experts import expert_projections, routed_experts
from ..quant.quantizer import QuantMode, TensorQuantizer
from ..quant.session import iter_quantizers
from ..quant.tokens import active_mask, expert_tokens
from ..runtime.distributed import all_reduce_many_


def moe_blocks(layer: nn.Module) -> list[nn.Module]:
    """Sparse MoE blocks: modules with a ModuleList ``experts`` and a ``route`` method (ours), by duck typing."""
    return [
        m for m in layer.modules() if isinstance(getattr(m, "experts", None), nn.ModuleList) and hasattr(m, "route")
    ]


def in_moe_blocks(layer: nn.Module) -> set[int]:
    """The ids of every module inside ``layer``'s sparse MoE blocks (:func:`moe_blocks`): what sees only the tokens
    routed to it."""
    return {id(m) for block in moe_blocks(layer) for m in block.modules()}


class AllExpertsObserve:
    """While active, each expert's quantizers observe all tokens of the batch; the layer output is unchanged.

    A forward pre-hook on each MoE block runs every expert on all of the block's tokens (outputs discarded)
    with its quantizers collecting, then silences the experts' quantizers for the routed computation, so that
    no token is counted twice; a forward hook turns them back on. A block none of whose experts' quantizers
    collects is left to its routed computation alone. Hooks, not patched forwards: removed on exit.
    """

    def __init__(self, layer: nn.Module):
        self.blocks = moe_blocks(layer)
        #: fused experts (transformers' 3-D parameters): their own pre-hook observes; a flag says "all tokens"
        self.fused = [h for m in layer.modules() for h in expert_projections(m)]
        self.handles: list[Any] = []
        self.silenced: dict[int, list[TensorQuantizer]] = {}  # block id -> quantizers it turned off

    def __enter__(self) -> AllExpertsObserve:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._before))
            self.handles.append(block.register_forward_hook(self._after))
        for holder in self.fused:
            holder.observe_all_tokens = True
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for holder in self.fused:
            holder.observe_all_tokens = False

    @staticmethod
    def _expert_quantizers(block: nn.Module) -> list[TensorQuantizer]:
        return [q for _, q in iter_quantizers(block.experts) if q.mode is QuantMode.COLLECT]

    def _before(self, block: nn.Module, args: tuple) -> None:
        silenced = self._expert_quantizers(block)
        if not silenced:  # none of the experts observes (weights only, dynamic inputs): nothing to run them for
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        with torch.no_grad():
            for expert in block.experts:
                expert(x)
        for q in silenced:
            q.mode = QuantMode.DISABLED
        self.silenced[id(block)] = silenced

    def _after(self, block: nn.Module, args: tuple, output: Any) -> None:
        for q in self.silenced.pop(id(block), []):
            q.mode = QuantMode.COLLECT


class ExpertTokenMasks:
    """While active, the observers of shardcal's MoE experts see only the real tokens routed to them.

    An expert runs on ``x[routed tokens]``, a subset of the block's tokens, so the batch's padding mask does not line
    up with its input. A forward pre-hook on each block recomputes the routing (``block.route``, what the block's
    forward does) and pre/post hooks on each expert declare, for the duration of its call, which of its rows are
    real tokens (:func:`shardcal.quant.tokens.expert_tokens`). Nothing is done for a batch without padding.
    """

    def __init__(self, layer: nn.Module):
        self.blocks = moe_blocks(layer)
        self.handles: list[Any] = []
        self.real: dict[int, torch.Tensor] = {}  # expert id -> which of its routed tokens are real
        self.open: dict[int, Any] = {}

    def __enter__(self) -> ExpertTokenMasks:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._route))
            for expert in block.experts:
                self.handles.append(expert.register_forward_pre_hook(self._enter_expert))
                self.handles.append(expert.register_forward_hook(self._exit_expert))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.real, self.open = [], {}, {}

    @torch.no_grad()
    def _route(self, block: nn.Module, args: tuple) -> None:
        mask = active_mask()
        self.real = {}
        if mask is None:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        _, experts = block.route(x)
        for e, expert in enumerate(block.experts):
            token, _ = torch.where(experts == e)
            self.real[id(expert)] = mask.to(token.device)[token]

    def _enter_expert(self, expert: nn.Module, args: tuple) -> None:
        real = self.real.get(id(expert))
        if real is not None and args and args[0].shape[0] == real.numel():  # the routed call, not all-experts'
            scope = expert_tokens(real)
            scope.__enter__()
            self.open[id(expert)] = scope

    def _exit_expert(self, expert: nn.Module, args: tuple, output: Any) -> None:
        scope = self.open.pop(id(expert), None)
        if scope is not None:
            scope.__exit__(None, None, None)


class RoutingCounts:
    """While active, counts the real tokens routed to each expert of every MoE block of a layer (this rank's).

    shardcal's blocks: a forward pre-hook recomputes the routing (``block.route``); fused experts: a pre-hook reads
    the expert indices they are called with (``top_k_index``). Padding never counts. :meth:`merged` sums the counts over ranks.
    """

    def __init__(self, layer: nn.Module, prefix: str):
        names = {id(m): n for n, m in layer.named_modules(prefix=prefix)}
        self.blocks = [(names[id(b)], b, len(b.experts)) for b in moe_blocks(layer)]
        self.fused = [(names[id(m)], m, len(expert_projections(m))) for m in layer.modules() if expert_projections(m)]
        self.counts = {name: torch.zeros(n, dtype=torch.int64) for name, _, n in [*self.blocks, *self.fused]}
        self.handles: list[Any] = []

    def __enter__(self) -> RoutingCounts:
        for name, block, _ in self.blocks:
            self.handles.append(block.register_forward_pre_hook(lambda m, args, name=name: self._route(name, m, args)))
        for name, experts, _ in self.fused:
            self.handles.append(
                experts.register_forward_pre_hook(
                    lambda m, args, kwargs, name=name: self._fused(name, args, kwargs), with_kwargs=True
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _add(self, name: str, index: torch.Tensor) -> None:
        index = index.reshape(-1, index.shape[-1])
        real = active_mask()
        if real is not None:
            index = index[real.to(index.device)]
        n = self.counts[name].numel()
        self.counts[name] += torch.bincount(index.reshape(-1).cpu().long(), minlength=n)[:n]

    @torch.no_grad()
    def _route(self, name: str, block: nn.Module, args: tuple) -> None:
        _, experts = block.route(args[0].reshape(-1, args[0].shape[-1]))
        self._add(name, experts)

    def _fused(self, name: str, args: tuple, kwargs: dict) -> None:
        index = routed_experts(args, kwargs)  # top_k_index, or GPT-OSS's router_indices
        if isinstance(index, torch.Tensor):
            self._add(name, index)

    def merged(self, group: Any) -> dict[str, list[int]]:
        """Per block, the tokens routed to each expert over every rank (collective when ``group`` is set)."""
        names = list(self.counts)
        all_reduce_many_([self.counts[n] for n in names], "sum", group, dtype=torch.int64)
        return {n: [int(c) for c in self.counts[n]] for n in names}


def fallback_unobserved(layer: nn.Module) -> list[str]:
    """Give activation quantizers that saw no data (unrouted experts) the max amax of their sibling experts.

    Every expert of a block reads the same normalised hidden states, so its siblings' input range is the best
    estimate available; for ``down_proj`` inputs the siblings' range is used likewise. Returns the names fixed.
    """
    fixed = []
    containers = [block.experts for block in moe_blocks(layer)]
    containers += [m for m in layer.modules() if expert_projections(m)]  # fused experts: children "0".."E-1"
    for experts in containers:
        by_role: dict[str, list[TensorQuantizer]] = {}
        for name, q in iter_quantizers(experts):
            role = name.split(".", 1)[1]  # "<expert>.<linear>.<quantizer>" -> "<linear>.<quantizer>"
            by_role.setdefault(role, []).append(q)
        for quantizers in by_role.values():
            seen = [q for q in quantizers if q.num_observed]
            for q in quantizers:
                if q.num_observed == 0 and q.amax is not None:
                    if seen:
                        amax = torch.stack([s.amax for s in seen]).amax(dim=0)
                    else:  # no expert saw data; cannot happen with >= 1 token (each is routed to top-k experts)
                        amax = torch.ones_like(q.amax)
                    q.set_amax(amax)
                    fixed.append(q.name)
    if fixed:
        warnings.warn(
            f"{len(fixed)} MoE expert quantizer(s) saw no calibration tokens and use the max amax of their sibling "
            f"experts: {', '.join(fixed[:4])}{', ...' if len(fixed) > 4 else ''}",
            stacklevel=3,
        )
    return fixed
