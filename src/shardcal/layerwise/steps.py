"""The layer-stepping primitive: embed once, then visit decoder layers one at a time on cached activations.

Calibration, SmoothQuant, GPTQ, AWQ and plain activation analysis are all "do something with layer i and the
inputs it sees, then move on". :func:`layer_steps` does the moving on::

    for step in layer_steps(model, batches):      # embeds once, inside fsdp2_root_unsharded
        my_algorithm(step.layer, step)           # step.layer is unsharded on every rank for the whole step
        # step.forward(i) / step.forward_all() run the layer on this rank's cached batch(es)

The layers' inputs come from the model (:mod:`shardcal.layerwise.inputs`): shardcal's own models embed directly,
any other causal LM runs its own forward up to the decoder layers, which records what each layer is called with.
Between iterations it computes the next layer's inputs — reusing the outputs of the step's own pass over
the data when they are still valid (``propagate="fp"``), or recomputing them with whatever the caller left in
the layer (quantizers on, updated weights: ``propagate="qdq"``; unless the caller's last pass over the data
already computed exactly those and handed them over) — then reshards the layer and drops the old inputs. There is
no forward patching and no mode flag on the layers: the caller sees a plain module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ..errors import NumericsError, UsageError
from ..quant.tokens import real_tokens_of
from ..runtime.distributed import all_gather_floats
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from ..sharding.residency import held_layer, residency_of
from .batches import Batch
from .inputs import CachedInputs, LayerCall, call_layer, layer_inputs
from .options import PROPAGATE_MODES


def embed_batches(
    model: nn.Module, batches: Sequence[Batch], device: torch.device, cache_device: torch.device
) -> list[CachedInputs]:
    """The decoder stack's inputs for each batch (see :mod:`shardcal.layerwise.inputs`). Collective when sharded:
    every rank calls it, even one with no batches."""
    layers = require_decoder_layers(model)
    return layer_inputs(model, layers, decoder_layer_prefix(model, layers), batches, device, cache_device)


@dataclass(kw_only=True)
class LayerStep:
    """One decoder layer, unsharded for the duration of the step, and this rank's cached inputs to it."""

    index: int
    name: str
    layer: nn.Module
    inputs: list[CachedInputs]
    device: torch.device
    cache_device: torch.device
    outputs: list[torch.Tensor] | None = field(default=None, repr=False)
    #: Keyword arguments added to every call of the layer in this step, given the batch's inputs (e.g. the KV-cache
    #: quantizer passed as the layer's cache); None: the model's arguments only.
    call_extras: Callable[[CachedInputs], dict[str, Any]] | None = field(default=None, repr=False)
    #: Per (batch index, rows), the model's arguments for the batch's first rows alone (see :meth:`forward`).
    heads: dict[tuple[int, int], CachedInputs] = field(default_factory=dict, repr=False)
    #: The global number of each cached batch (the same batch has the same number at every world size).
    batch_numbers: list[int] = field(default_factory=list, repr=False)
    #: With ``layer_steps(reference_stream=True)``: per cached batch, the hidden states the full-precision model
    #: gives this layer (the previous layers unquantized and unchanged), on the cache device; else None.
    reference_inputs: list[torch.Tensor] | None = field(default=None, repr=False)
    #: This layer's outputs on :attr:`reference_inputs`, computed before the step is handed out (the layer as it
    #: came, no quantizer inserted yet): the full-precision targets, and the next layer's reference inputs.
    reference_outputs: list[torch.Tensor] | None = field(default=None, repr=False)
    #: Whether :attr:`outputs` are the layer's outputs as the caller leaves it (:meth:`keep_final_outputs`), which
    #: ``propagate="qdq"`` then takes as the next inputs instead of running the layer again.
    outputs_final: bool = field(default=False, repr=False)
    #: Whether the layer's parameters leave memory when the step ends (a streamed model's): nothing runs the layer
    #: after its step; what its weights hold then is read once more, by the export at their release.
    released_after: bool = field(default=False, repr=False)

    def forward(self, i: int, rows: int | None = None) -> torch.Tensor:
        """Run the layer on cached batch ``i`` — or on its first ``rows`` sequences, with the arguments the model
        gives those alone (:attr:`heads`) — with the arguments the model gives this layer, plus
        :attr:`call_extras`; the output (the hidden states) is on the compute device."""
        x = self.inputs[i]
        if rows is not None and rows < x.hidden_states.shape[0]:
            head = self.heads.get((i, rows))
            if head is None:
                raise UsageError(f"{self.name}: the first {rows} rows of batch {i} were not embedded on their own "
                                 f"(layer_steps(head_rows={{{i}: {rows}}}))")  # fmt: skip
            x = head.with_hidden(x.hidden_states[:rows])
        return self._forward_on(x)

    def forward_reference(self, i: int) -> torch.Tensor:
        """Run the layer on cached batch ``i``'s full-precision-stream hidden states (:attr:`reference_inputs`),
        with the same arguments as :meth:`forward`; the output is on the compute device."""
        if self.reference_inputs is None:
            raise UsageError(f"{self.name}: no reference stream (layer_steps(reference_stream=True))")
        return self._forward_on(self.inputs[i].with_hidden(self.reference_inputs[i]))

    def _forward_on(self, x: CachedInputs) -> torch.Tensor:
        """The layer on ``x`` (no autograd), the batch's token mask declared; the output on the compute device."""
        with torch.no_grad(), real_tokens_of(x.token_mask):
            return call_layer(self.layer, self.name, x.hidden_states.to(self.device), self._call(x))

    def _call(self, x: CachedInputs) -> LayerCall:
        """What the layer is called with for batch ``x`` besides the hidden states: the model's arguments and
        :attr:`call_extras`, on the compute device."""
        call = x.call_of(self.index).to(self.device)
        if self.call_extras is None:
            return call
        return LayerCall(call.args, {**call.kwargs, **self.call_extras(x)}, call.hidden_keyword)

    def forward_with(self, i: int, parameters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run the layer's own forward on cached batch ``i`` with autograd on and the named parameters (names
        relative to the layer, e.g. ``"mlp.down_proj.weight"``) replaced by the given tensors, so gradients flow to
        them (``torch.func.functional_call``; the layer's parameters are untouched). The layer is gathered for the
        whole step, so the FSDP2 unit's own hooks are bypassed: no gather, and no gradient reduction."""
        x = self.inputs[i]
        own = _OwnForward(self.layer)
        replaced = {f"layer.{name}": t for name, t in parameters.items()}

        def run(*args: Any, **kwargs: Any) -> Any:
            return functional_call(own, replaced, args, kwargs, strict=False)

        with torch.enable_grad(), real_tokens_of(x.token_mask):
            return call_layer(run, self.name, x.hidden_states.to(self.device), self._call(x))

    def forward_all(self, keep_outputs: bool = True) -> list[torch.Tensor] | None:
        """Run the layer on every cached batch; with ``keep_outputs`` remember the outputs as the next inputs.

        Under ``propagate="fp"`` kept outputs become the next layer's inputs, so a caller that runs its
        observing pass through here gets propagation for free (one pass per layer). Call
        :meth:`invalidate_outputs` after changing the layer's function (e.g. updating weights).
        """
        outs = [self.forward(i).to(self.cache_device) for i in range(len(self.inputs))]
        if keep_outputs:
            self.outputs, self.outputs_final = outs, False
            return outs
        return None

    def keep_final_outputs(self, outputs: list[torch.Tensor]) -> None:
        """Hand over every cached batch's output (on the cache device) of the layer exactly as the caller will
        leave it — what :meth:`forward_all` would compute after the step, e.g. from an algorithm's last pass over
        the data — so that ``propagate="qdq"`` takes them as the next inputs without running the layer again.
        Whoever changes the layer's function afterwards calls :meth:`invalidate_outputs`."""
        if len(outputs) != len(self.inputs):
            raise UsageError(f"{self.name}: {len(outputs)} final outputs for {len(self.inputs)} cached batches")
        self.outputs, self.outputs_final = outputs, True

    def invalidate_outputs(self) -> None:
        self.outputs, self.outputs_final = None, False


class _OwnForward(nn.Module):
    """Calls the wrapped layer's ``forward`` itself, not the module (whose FSDP2 hooks would run)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.forward(*args, **kwargs)


def layer_steps(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    propagate: str = "fp",
    offload_activations: bool | None = None,
    start: int = 0,
    initial_inputs: list[CachedInputs] | None = None,
    device: torch.device | None = None,
    batch_numbers: Sequence[int] | None = None,
    head_rows: dict[int, int] | None = None,
    reference_stream: bool = False,
    initial_reference: list[torch.Tensor] | None = None,
) -> Iterator[LayerStep]:
    """Visit the decoder layers in order, each unsharded once, on this rank's cached activations.

    ``batches`` are this rank's batches (possibly none: the rank still takes part in every gather).
    ``propagate="fp"`` feeds layer i+1 the outputs of layer i's own pass when the caller kept them
    (:meth:`LayerStep.forward_all`), else recomputes them after the caller is done; ``"qdq"`` recomputes
    them after the caller is done, i.e. with the caller's quantizers enabled, unless the caller handed them over
    (:meth:`LayerStep.keep_final_outputs`). ``offload_activations`` keeps the
    cache on CPU while layers run on an accelerator (default: on exactly when the model is on an accelerator).
    ``start``/``initial_inputs`` resume at a layer with inputs restored from a checkpoint. At most two layers'
    worth of activations (inputs and outputs of the current layer) are alive at once. ``batch_numbers``: the
    global numbers of ``batches`` (default ``0, 1, ...``), named when a layer's output holds NaN or inf — which
    stops every rank with a :class:`~shardcal.errors.NumericsError`. ``head_rows``: ``{batch index: rows}`` for
    which each step can run the layer on the batch's first rows alone (``step.forward(i, rows)``: the model's
    arguments for those rows are computed once, here); embedding them is collective, so every rank passes a dict
    (possibly empty) or every rank None when resuming (``initial_inputs``); otherwise they are embedded with the
    batches. ``reference_stream``: also carry the full-precision stream — each step's :attr:`LayerStep.reference_inputs`
    are what the unquantized model gives the layer, and its :attr:`LayerStep.reference_outputs` are computed before
    the step is handed out (one more forward per layer, two more activation caches); a resumed run passes that
    layer's reference hidden states as ``initial_reference``. Each layer is held through the model's residency
    (:mod:`shardcal.sharding.residency`): gathered when resident, read in when streamed.
    """
    if propagate not in PROPAGATE_MODES:
        raise ValueError(f"propagate must be one of {PROPAGATE_MODES}, got {propagate!r}")
    layers = require_decoder_layers(model)
    device = device if device is not None else compute_device(model)
    if offload_activations is None:
        offload_activations = device.type != "cpu"
    cache_device = torch.device("cpu") if offload_activations else device
    prefix = decoder_layer_prefix(model, layers)
    numbers = list(batch_numbers) if batch_numbers is not None else list(range(len(batches)))
    wanted = sorted(head_rows or {})
    heads_of = [first_rows(batches[i], head_rows[i]) for i in wanted] if head_rows else []
    if initial_inputs is None:  # one call: a model whose layers' arguments are recorded groups them once
        embedded = embed_batches(model, [*batches, *heads_of], device, cache_device)
        inputs, embedded = embedded[: len(batches)], embedded[len(batches) :]
    else:
        inputs = initial_inputs
        embedded = embed_batches(model, heads_of, device, cache_device) if head_rows is not None else []
    heads = {(i, head_rows[i]): x.with_hidden(torch.empty(0)) for i, x in zip(wanted, embedded)}  # calls only
    reference = None
    if reference_stream:
        reference = initial_reference if initial_reference is not None else [x.hidden_states for x in inputs]
        if len(reference) != len(inputs):
            raise ValueError(f"initial_reference holds {len(reference)} batches, the inputs {len(inputs)}")
    released = residency_of(model).streamed
    for index in range(start, len(layers)):
        layer = layers[index]
        with held_layer(model, index, layer):
            step = LayerStep(
                index=index, name=f"{prefix}.{index}", layer=layer, inputs=inputs, device=device,
                cache_device=cache_device, heads=heads, batch_numbers=numbers, reference_inputs=reference,
                released_after=released,
            )  # fmt: skip
            if reference is not None:
                step.reference_outputs = [step.forward_reference(i).to(cache_device) for i in range(len(inputs))]
                _check_finite(step.name, step.reference_outputs, numbers)
            yield step
            if step.outputs is None or (propagate == "qdq" and not step.outputs_final):
                step.forward_all(keep_outputs=True)
            outputs = step.outputs
            _check_finite(step.name, outputs, numbers)
            reference = step.reference_outputs
        inputs = [x.with_hidden(out) for out, x in zip(outputs, inputs)]
        del step, outputs


def first_rows(batch: Batch, rows: int) -> Batch:
    """The batch's first ``rows`` sequences, padded as in the batch (its mask kept even where they need none)."""
    mask = None if batch.attention_mask is None else batch.attention_mask[:rows]
    return Batch(batch.input_ids[:rows], mask)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf: a finite sum says so in one reduction (NaN and inf never sum to a finite
    number); only a non-finite sum, which large finite values can also give, needs the element-wise check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_finite(name: str, outputs: list[torch.Tensor], batch_numbers: Sequence[int]) -> None:
    """Stop every rank together, with the same message, when any rank's layer output holds NaN or inf (collective:
    one small all-gather of each rank's first bad batch number, -1 for none)."""
    bad = next((i for i, out in enumerate(outputs) if not _all_finite(out)), None)
    found = all_gather_floats(-1.0 if bad is None else float(batch_numbers[bad]))
    culprits = [(int(n), r) for r, n in enumerate(found) if n >= 0]
    if culprits:
        batch, rank = min(culprits)
        on = f" on rank {rank}" if len(found) > 1 else ""
        raise NumericsError(
            f"{name}: the layer's output holds NaN or infinite values (batch {batch}{on}): corrupt weights, or an "
            "overflow in a low-precision dtype; a calibration checkpoint stays at the previous layer"
        )


def compute_device(model: nn.Module) -> torch.device:
    """Where layers run: the FSDP2 mesh's device when sharded, else the parameters' device."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if mesh.device_type == "cpu":
                return torch.device("cpu")
            return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
        return p.device
    return torch.device("cpu")
