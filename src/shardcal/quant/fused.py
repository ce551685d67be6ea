"""Which Linears vLLM fuses into one layer, and which of their quantizer ranges it therefore needs to be one.

vLLM loads sibling Linears of a checkpoint into one fused layer (its models' ``packed_modules_mapping``): q / k / v
into ``qkv_proj``, gate / up into ``gate_up_proj`` (also each MoE expert's, ``w1`` / ``w3`` into ``w13``), and
DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``. A fused layer computes with one scale
where the checkpoint stores one per Linear (the sources in vLLM's code: docs/reference/vllm-conventions.md):

- nvfp4 weights: one ``weight_global_scale`` (vLLM takes the largest of the stored ones for all, or expert ``w1``'s
  for ``w13``, without recomputing the block scales, which were computed with each Linear's own);
- fp8 per-tensor weights: one ``weight_scale`` (vLLM requantizes every member to the largest);
- static input scales (int8 / fp8 ``input_scale``, nvfp4 ``input_global_scale``): one per fused layer (the largest
  ``input_scale``; the largest ``input_global_scale``, i.e. the smallest range).

So a fused group's quantizers must share one calibrated range for vLLM to compute what shardcal computes:
:func:`share_ranges` sets every member's amax to the group's elementwise maximum (exact, so every rank that holds
the same amax values gets the same bits). Per-channel and per-group scales (int8 / fp8 per channel, int4 groups) are
stored per output row: vLLM concatenates them, nothing is shared. The calibration runner, the algorithms that
choose weight ranges (GPTQ, SmoothQuant's and AWQ's searches), the export's check and the reload's warning all
ask this module which Linears form a group (:func:`fused_layer`) and which ranges it shares
(:func:`shares_range`). Static input ranges need no sharing step: a fused layer's members read one input, so their
observers record the same range (the export checks that they do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from .quantizer import TensorQuantizer
from .session import iter_quantizers
from .spec import QuantizerSpec

#: vLLM's fused layers: the fused layer's name -> the sibling Linears (last name component) it holds, in vLLM's order
#: (``packed_modules_mapping`` of its Llama-style, Mixtral, Qwen-MoE and DeepSeek models; FusedMoE's ``w13`` per expert).
FUSED_LAYERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
_FUSED_INTO = {member: fused for fused, members in FUSED_LAYERS.items() for member in members}
#: The quantizer roles whose ranges a fused layer may share.
ROLES = ("weight", "input")


def fused_layer(name: str) -> str | None:
    """The name of the layer vLLM fuses the Linear ``name`` into (``model.layers.0.self_attn.q_proj`` ->
    ``model.layers.0.self_attn.qkv_proj``), or None for a Linear vLLM loads on its own."""
    parent, _, leaf = name.rpartition(".")
    fused = _FUSED_INTO.get(leaf)
    if fused is None:
        return None
    return f"{parent}.{fused}" if parent else fused


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """``names`` grouped by the layer vLLM fuses them into: every group of two or more, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        fused = fused_layer(name)
        if fused is not None:
            groups.setdefault(fused, []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def shares_range(spec: QuantizerSpec, role: str) -> bool:
    """Whether vLLM computes a fused layer's ``role`` (``"weight"`` / ``"input"``) quantizers of this ``spec`` with
    one range: static inputs (one ``input_scale`` / ``input_global_scale``), nvfp4 weights (one global scale), fp8
    per-tensor weights (requantized to one scale). int8 per-tensor weight scales are expanded per channel by vLLM,
    per-channel and per-group scales are per row: those keep their own."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if spec.dynamic:
        return False
    if role == "input":
        return True
    return spec.format == "nvfp4" or (spec.format == "fp8_e4m3" and spec.granularity == "tensor")


def range_groups(specs: Mapping[str, QuantizerSpec], role: str) -> list[list[str]]:
    """The fused groups among ``specs`` (a spec per Linear name) whose ``role`` range vLLM needs shared: members
    with one spec that :func:`shares_range`. (Members with different specs cannot form one vLLM layer at all: the
    export refuses them, :func:`mixed_schemes`.)"""
    out = []
    for group in fused_groups(specs):
        first = specs[group[0]]
        if all(specs[n] == first for n in group) and shares_range(first, role):
            out.append(group)
    return out


def shared_amax(
    amax: Mapping[str, torch.Tensor], specs: Mapping[str, QuantizerSpec], role: str
) -> dict[str, torch.Tensor]:
    """``amax`` (per Linear name) with each :func:`range_groups` group's values replaced by the group's elementwise
    maximum — the ranges vLLM computes with (what a search over candidate weights must score)."""
    out = dict(amax)
    for group in range_groups({n: specs[n] for n in amax}, role):
        top = torch.stack([amax[n].float() for n in group]).amax(dim=0)
        out.update({n: top.to(amax[n].dtype) for n in group})
    return out


def share_range(quantizers: Sequence[TensorQuantizer]) -> None:
    """Set every quantizer's amax to the elementwise maximum of theirs (one fused layer's; symmetric, calibrated)."""
    top = torch.stack([q.amax.detach().float() for q in quantizers]).amax(dim=0)
    for q in quantizers:
        q.set_amax(top.to(q.amax.device))


def share_ranges(quantizers: Mapping[str, TensorQuantizer], role: str) -> list[list[str]]:
    """:func:`share_range` for every :func:`range_groups` group of ``quantizers`` (keyed by their Linear's name) whose
    members are all calibrated; return the groups."""
    usable = {n: q for n, q in quantizers.items() if q is not None and q.calibrated and q.amax is not None}
    groups = range_groups({n: q.spec for n, q in usable.items()}, role)
    for group in groups:
        share_range([usable[n] for n in group])
    return groups


def role_quantizers(module: nn.Module, prefix: str, role: str) -> dict[str, TensorQuantizer]:
    """The ``role`` quantizers under ``module`` keyed by their Linear's name (``QuantLinear`` s and fused experts'
    per-expert projections alike: ``<prefix>.mlp.experts.3.gate_proj``)."""
    suffix = f".{role}_quantizer"
    return {n[: -len(suffix)]: q for n, q in iter_quantizers(module, prefix) if n.endswith(suffix)}


def share_fused_ranges(module: nn.Module, prefix: str = "", role: str = "weight") -> list[list[str]]:
    """:func:`share_ranges` over every ``role`` quantizer under ``module`` (a decoder layer: a fused layer never spans
    two); return the groups. What :func:`shardcal.calibrate` does after calibrating a layer's weights; call it on a
    model whose quantizers were calibrated by hand before exporting it."""
    return share_ranges(role_quantizers(module, prefix, role), role)


def unshared_ranges(quantizers: Mapping[str, TensorQuantizer | None], role: str) -> list[list[str]]:
    """The :func:`range_groups` groups of calibrated ``quantizers`` whose amax values differ (vLLM would compute
    them with one range: not what these quantizers compute)."""
    usable = {n: q for n, q in quantizers.items() if q is not None and q.calibrated and q.amax is not None}
    return [
        group
        for group in range_groups({n: q.spec for n, q in usable.items()}, role)
        if not all(torch.equal(usable[group[0]].amax, usable[n].amax) for n in group[1:])
    ]


def mixed_schemes(schemes: Mapping[str, object]) -> list[list[str]]:
    """The fused groups among the Linears of a model (name -> its quantization scheme, None when not quantized)
    whose members differ: vLLM loads a fused layer with one scheme (the first member's) and refuses one that is
    partly ignored."""
    return [group for group in fused_groups(schemes) if any(schemes[n] != schemes[group[0]] for n in group[1:])]
