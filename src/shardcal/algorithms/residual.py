"""A rotation of the residual stream, folded into the weights (QuaRot / SpinQuant's R1): no online transform.

A pre-norm decoder (Llama, Mistral, Qwen2/3, their MoE variants) only reads its residual stream ``h`` through RMS
norms, and RMS normalisation without its weight commutes with any orthogonal ``Q``: ``rms(h Q) = rms(h)``. So, with
every norm's weight ``g`` first folded into the Linears that read it (``W diag(g)``, the norm left with unit
weight), the model computes the same function on the rotated stream ``h Q`` when

* the embeddings are ``E Q`` (every row rotated),
* every Linear reading a norm's output is ``W diag(g) Q`` (q/k/v, gate/up, an MoE router and its experts' gate/up),
* every Linear writing into the stream is ``Q^T W`` (and its bias ``b Q``): o_proj, down_proj, every expert's down,
* the LM head is ``W diag(g_final) Q``; tied embeddings are untied first (the head and the embeddings differ now).

An outlier channel of the stream is then spread over all channels, so the activations the quantized Linears read
(and their weights' columns) have no channel standing out: what per-tensor int8 inputs and 4-bit formats need.
Unlike ``[rotation]``'s online input rotations nothing is left to compute at run time, so vLLM runs the export at any
tensor-parallel size. ``Q`` is the whole-width Hadamard (:class:`~shardcal.quant.hadamard.FullHadamard`: a Paley
factor times a Sylvester one for widths that are not powers of two, SmolLM2's 576 = 36 · 16), with random signs from
a seed for ``random-hadamard``.

Layouts are checked before anything changes (a :class:`~shardcal.errors.ModelLayoutError` naming the module):
each decoder layer must read the stream through exactly two norms whose consumers are known (the SmoothQuant
pairs of :mod:`.mappings`), hold no other norm of the stream's width (Gemma's post-attention norms normalise a
sub-block's output before it is added: no folded rotation preserves that) and no fused 3-D experts; every other
Linear with the stream's width of outputs is taken to write into it (o_proj, down_proj). Afterwards the model's logits on a probe sequence are compared
with those before (:class:`~shardcal.errors.NumericsError` when they moved by more than float rounding).

FSDP2-sharded models: each decoder layer is gathered in turn, rotated whole and written back into the shards; the
embeddings and the head are rotated row by row, each rank its own rows (what FSDP2 shards), with the final norm's
whole weight gathered with the root first. Tied embeddings cannot be untied once sharded: load with ``untie_word_embeddings=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ModelLayoutError, NumericsError
from ..layerwise.steps import compute_device
from ..quant.hadamard import FullHadamard
from ..sharding.fsdp2 import fsdp2_root_unsharded, layer_unsharded, sync_unsharded_to_shards
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from .mappings import layer_smoothings, norm_offset

#: The largest change of the probe's logits, relative to their largest magnitude, that counts as float rounding.
PROBE_RTOL = 1e-3
#: The probe's length: the first tokens of the data's first sequence (logits of the whole vocabulary for each).
PROBE_TOKENS = 32


def residual_rotation(model: nn.Module, kind: str, seed: int = 0) -> FullHadamard:
    """The rotation a recipe's ``[rotation] residual = kind`` gives ``model``'s stream (``hadamard`` or
    ``random-hadamard``, signs drawn from ``seed``)."""
    width = _stream_width(model)
    try:
        return FullHadamard(width, seed if kind == "random-hadamard" else None)
    except ValueError as exc:
        raise ModelLayoutError(f"residual rotation: hidden size {width}: {exc}") from None


def _stream_width(model: nn.Module) -> int:
    embed = root_modules(model)[0]
    return int(embed.weight.shape[-1])


def root_modules(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(embeddings, final norm, LM head)`` of a causal LM: ``get_input_embeddings()`` / ``get_output_embeddings()``
    (else ``embed_tokens`` beside the decoder layers and ``lm_head``) and the ``norm`` beside the decoder layers."""
    layers = require_decoder_layers(model)
    prefix = decoder_layer_prefix(model, layers)
    parent = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
    embed = _call_or_none(model, "get_input_embeddings") or getattr(parent, "embed_tokens", None)
    head = _call_or_none(model, "get_output_embeddings") or getattr(model, "lm_head", None)
    norm = next((getattr(parent, n) for n in ("norm", "final_layernorm", "ln_f") if hasattr(parent, n)), None)
    for what, module in (("input embeddings", embed), ("final norm", norm), ("LM head", head)):
        if not isinstance(module, nn.Module) or getattr(module, "weight", None) is None:
            raise ModelLayoutError(
                f"residual rotation: {type(model).__name__} has no {what} it can find (embed_tokens, norm and lm_head "
                f"beside {prefix})"
            )
    return embed, norm, head


def _call_or_none(model: nn.Module, method: str) -> Any:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError):
        return None


def untie_word_embeddings(model: nn.Module) -> bool:
    """Give an unsharded model's LM head a weight of its own, equal to the embeddings it shared (and set the config's
    ``tie_word_embeddings`` to false, so an export stores and reloads both); return whether it was tied."""
    embed, _, head = root_modules(model)
    if head.weight is not embed.weight:
        return False
    if isinstance(embed.weight, DTensor):
        raise ModelLayoutError(
            f"{type(model).__name__}: the LM head shares the embeddings and the model is sharded already; a residual "
            "rotation needs them apart: load it with load_pretrained(..., untie_word_embeddings=True), or call "
            "shardcal.algorithms.residual.untie_word_embeddings(model) before fsdp2_wrap"
        )
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False
    raw = getattr(config, "raw", None)
    if isinstance(raw, dict):
        raw["tie_word_embeddings"] = False
    return True


def check_residual_layout(model: nn.Module) -> None:
    """Everything a residual rotation needs of ``model``, checked without changing it (see the module docstring)."""
    embed, norm, head = root_modules(model)
    width = int(embed.weight.shape[-1])
    _check_norm(norm, "the final norm")
    if int(head.weight.shape[-1]) != width:
        raise ModelLayoutError(f"residual rotation: the LM head reads {head.weight.shape[-1]} channels, not {width}")
    layers = require_decoder_layers(model)
    prefix = decoder_layer_prefix(model, layers)
    for i, layer in enumerate(layers):
        _layer_plan(layer, f"{prefix}.{i}", width)


def _check_norm(norm: nn.Module, what: str) -> None:
    if norm_offset(norm) is None or getattr(norm, "bias", None) is not None:
        raise ModelLayoutError(
            f"residual rotation: {what} ({type(norm).__name__}) is not a bias-free RMS norm `(c + w) * x / rms(x)`"
        )


def _layer_plan(layer: nn.Module, name: str, width: int) -> tuple[list[Any], list[nn.Linear]]:
    """``(norm -> consumers pairs, writers)`` of one decoder layer, or a ModelLayoutError saying what stands in the
    way."""
    if any(p.dim() == 3 for p in layer.parameters()):
        raise ModelLayoutError(f"residual rotation: {name} holds fused 3-D expert weights; they are not rotated here")
    pairs = layer_smoothings(layer, ("attn_in", "mlp_in"), prefix=name, rotated_consumers=True)
    if sorted(p.kind for p in pairs) != ["attn_in", "mlp_in"]:
        raise ModelLayoutError(
            f"residual rotation: {name} does not read its stream through an input norm feeding q/k/v and a norm "
            "feeding the MLP (input_layernorm, post_attention_layernorm or pre_feedforward_layernorm)"
        )
    sources = {id(p.source) for p in pairs}
    consumers = {id(c) for p in pairs for c in p.consumers}
    names = {id(m): n for n, m in layer.named_modules(prefix=name)}
    for p in pairs:
        _check_norm(p.source, p.key)
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        if id(module) in sources or isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 1 and weight.shape[0] == width:
            raise ModelLayoutError(
                f"residual rotation: {names[id(module)]} normalises a {width}-wide tensor besides the layer's input "
                "norms (a norm on a sub-block's output, as Gemma's): a rotation folded into the weights cannot keep it"
            )
    writers = []
    for module in layer.modules():
        if not isinstance(module, nn.Linear) or id(module) in consumers:
            continue
        if module.out_features == width:
            writers.append(module)
    if not writers:
        raise ModelLayoutError(f"residual rotation: {name} has no Linear writing {width} channels into the stream")
    return pairs, writers


@torch.no_grad()
def _rotate_layer(layer: nn.Module, name: str, rotation: FullHadamard) -> None:
    """Fold the layer's norms into their consumers, rotate consumers' inputs and writers' outputs (gathered)."""
    pairs, writers = _layer_plan(layer, name, rotation.n)
    for pair in pairs:
        norm = pair.source
        gain = norm.weight.detach().to(torch.float64) + pair.offset
        for linear in pair.consumers:
            _set(linear.weight, rotation.right(linear.weight.detach().to(torch.float64) * gain))
        norm.weight.fill_(1.0 - pair.offset)  # c + w = 1
    for linear in writers:
        _set(linear.weight, rotation.left_transposed(linear.weight.detach().to(torch.float64)))
        if linear.bias is not None:
            _set(linear.bias, rotation.right(linear.bias.detach().to(torch.float64)))


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def _rotate_rows_(weight: torch.Tensor, rotation: FullHadamard, gain: torch.Tensor | None = None) -> None:
    """``W <- W diag(gain) Q`` on the rows this rank holds, a bounded number at a time."""
    local = _local(weight)
    gain = None if gain is None else gain.to(local.device)
    rows = max(1, (1 << 20) // max(1, local.shape[-1]))
    for chunk in local.split(rows):
        value = chunk.detach().to(torch.float64)
        chunk.copy_(rotation.right(value if gain is None else value * gain).to(chunk.dtype))


def rotate_residual(model: nn.Module, rotation: FullHadamard, probe: torch.Tensor | None = None) -> None:
    """Rotate ``model``'s residual stream by ``rotation``, folded into its weights (see the module docstring); the
    same function afterwards, to float rounding. Collective for an FSDP2-sharded model (every rank calls it).
    ``probe``: token ids ``[1, L]`` whose logits before and after must agree (:data:`PROBE_RTOL`)."""
    check_residual_layout(model)
    untie_word_embeddings(model)
    before = _logits(model, probe)
    embed, norm, head = root_modules(model)
    layers = require_decoder_layers(model)
    prefix = decoder_layer_prefix(model, layers)
    for i, layer in enumerate(layers):
        with layer_unsharded(layer):
            _rotate_layer(layer, f"{prefix}.{i}", rotation)
            sync_unsharded_to_shards(layer)
    with fsdp2_root_unsharded(model):  # the final norm's whole weight, on every rank
        gain = norm.weight.detach().to(torch.float64).clone() + norm_offset(norm)
    _rotate_rows_(head.weight, rotation, gain)  # each rank its own rows (FSDP2 shards rows)
    _rotate_rows_(embed.weight, rotation)
    with torch.no_grad():
        _local(norm.weight).fill_(1.0 - norm_offset(norm))
    _check_probe(before, _logits(model, probe))


def _logits(model: nn.Module, ids: torch.Tensor | None) -> torch.Tensor | None:
    if ids is None:
        return None
    with torch.no_grad():
        out: Any = model(ids.to(compute_device(model)))
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def _check_probe(before: torch.Tensor | None, after: torch.Tensor | None) -> None:
    if before is None or after is None:
        return
    change, scale = float((after - before).abs().max()), float(before.abs().max())
    if not change <= PROBE_RTOL * scale:
        raise NumericsError(
            f"residual rotation: the model's logits moved by {change:.3g} (largest {scale:.3g}) on the probe "
            "sequence; its layout computes something the rotation does not preserve"
        )
