"""Resuming a layer-by-layer run from its checkpoint: where it starts, and the first layer's inputs rebuilt.

Both runners (:func:`shardcal.calibrate`, :func:`shardcal.collect_activations`) resume the same way: the checkpoint
says how many layers are done and holds the next layer's input hidden states of this rank's batches; what else a
layer is called with (rotary tables, masks, a foreign model's recorded arguments) is computed again from the data,
which is cheap and collective like a normal start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from .batches import Batch
from .inputs import CachedInputs
from .layer_checkpoint import LayerCheckpoint
from .steps import compute_device, embed_batches


class Resumed(Protocol):
    """What a loaded checkpoint tells a runner about where to go on (both kinds' resume states have these)."""

    completed_layers: int
    activations: list[torch.Tensor]  # the next layer's input hidden states of this rank's batches, in order
    committed_at: float


def resume_point(
    model: nn.Module,
    local_batches: Sequence[Batch],
    resumed: Resumed | None,
    stop: int,
    checkpoint: LayerCheckpoint,
    offload: bool | None,
) -> tuple[int, list[CachedInputs] | None]:
    """``(first layer to run, its inputs)``: ``(0, None)`` for a fresh run; after a resume the layers the checkpoint
    completed and, when that is before ``stop`` (the layers the run steps through), their successor's inputs
    (:func:`restore_inputs`, collective), else None."""
    if resumed is None:
        return 0, None
    start = resumed.completed_layers
    if start >= stop:
        return start, None
    return start, restore_inputs(model, local_batches, resumed.activations, checkpoint, offload)


def restore_inputs(
    model: nn.Module,
    local_batches: Sequence[Batch],
    activations: list[torch.Tensor],
    checkpoint: LayerCheckpoint,
    offload: bool | None,
) -> list[CachedInputs]:
    """The resume layer's inputs: the stored hidden states with freshly computed layer arguments. Collective
    (embedding, as at a normal start); ``offload`` as ``layer_steps``' ``offload_activations``."""
    device = compute_device(model)
    cache_device = torch.device("cpu") if (offload if offload is not None else device.type != "cpu") else device
    if len(activations) != len(local_batches):
        raise checkpoint.error(
            f"{checkpoint.dir}: the {checkpoint.kind} checkpoint holds the inputs of {len(activations)} batches for "
            f"this rank, the data gives {len(local_batches)}; it is incomplete"
        )
    inputs = embed_batches(model, local_batches, device, cache_device)
    for x, stored in zip(inputs, activations):
        x.hidden_states = stored.to(cache_device)
    return inputs


def announce_resume(resumed: Resumed, directory: str | Path, total: int) -> None:
    """One line on stderr: after which of ``total`` layers the run resumes, from where, committed when."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(resumed.committed_at))
    print(
        f"resuming after layer {resumed.completed_layers} of {total} from {directory} (committed {when})",
        file=sys.stderr,
    )
