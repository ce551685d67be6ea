"""Which positions of an observed activation are real tokens: statistics never count padding.

A batch of rows of different lengths is right-padded; the padded positions run through the model like any other
and their activations are meaningless. While a layer runs on a batch, the runner declares the batch's token mask
(``[B, L]``, 1 = real token) with :func:`real_tokens_of`; every observer then keeps only the real positions of what
it sees:

* an activation ``[B, L, ...]`` (a Linear's input in a dense layer) takes ``x[mask]``;
* a flattened one ``[B * L, ...]`` (the tokens of an MoE block in all-experts mode) takes the flattened mask;
* tokens routed to one expert (``[n, ...]``, a subset of the block's tokens) take the mask of those tokens, which
  the MoE observation declares for the duration of the expert's call with :func:`expert_tokens`.

A tensor whose leading shape matches none of these is observed whole (nothing of a batch layout to mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_MASK: ContextVar[torch.Tensor | None] = ContextVar("shardcal_token_mask", default=None)
_SUBSET: ContextVar[torch.Tensor | None] = ContextVar("shardcal_token_subset", default=None)


@contextlib.contextmanager
def real_tokens_of(mask: torch.Tensor | None) -> Iterator[None]:
    """Observers below see only positions where ``mask`` ``[B, L]`` is nonzero (None: every position)."""
    token = _MASK.set(None if mask is None else mask.bool())
    try:
        yield
    finally:
        _MASK.reset(token)


def active_mask() -> torch.Tensor | None:
    """The flattened ``[B * L]`` boolean mask of the batch being run (None: no padding declared)."""
    mask = _MASK.get()
    return None if mask is None else mask.reshape(-1)


@contextlib.contextmanager
def expert_tokens(real: torch.Tensor | None) -> Iterator[None]:
    """While an expert runs on routed tokens: ``real`` ``[n]`` says which of its ``n`` tokens are real."""
    token = _SUBSET.set(real)
    try:
        yield
    finally:
        _SUBSET.reset(token)


def real_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its padded positions (as ``[n, ...]``), or ``x`` itself when nothing is to be masked."""
    subset = _SUBSET.get()
    if subset is not None and x.dim() >= 1 and x.shape[0] == subset.numel():
        return x[subset.to(x.device)]
    mask = _MASK.get()
    if mask is None:
        return x
    if x.dim() > mask.dim() and tuple(x.shape[: mask.dim()]) == tuple(mask.shape):
        return x[mask.to(x.device)]
    flat = mask.reshape(-1)
    if x.dim() >= 1 and x.shape[0] == flat.numel():
        return x[flat.to(x.device)]
    return x
