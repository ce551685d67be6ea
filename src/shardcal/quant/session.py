"""Running the calibration pass protocol over many quantizers at once (what the layer runner calls).

::

    qs = [q for _, q in iter_quantizers(layer) if q is not a weight quantizer]
    session = CalibrationSession(qs, group=dp_group)
    for p in session.passes():         # start_calibration, begin_pass(p) ... end_pass, finish_calibration
        run_layer_on_this_ranks_inputs()

or the same with the functions :func:`start_calibration_all`, :func:`begin_pass_all`, :func:`end_pass_all`,
:func:`finish_calibration_all`. :func:`end_pass_all` is a collective over ``group``: every rank calls it with the
same quantizers in the same order (also a rank whose experts saw no tokens), and all quantizers' statistics go
in one all-reduce per reduce op (at most two per pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..runtime.distributed import group_rank_size
from .merge import merge_stats
from .quantizer import QuantMode, TensorQuantizer


def iter_quantizers(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, TensorQuantizer]]:
    """``(name, quantizer)`` for every :class:`TensorQuantizer` under ``module``, in module order."""
    for name, sub in module.named_modules(prefix=prefix):
        if isinstance(sub, TensorQuantizer):
            yield name, sub


def set_quantizer_mode(module: nn.Module, mode: QuantMode | str) -> int:
    """Set every quantizer under ``module`` to ``mode``; return how many there are."""
    n = 0
    for _, q in iter_quantizers(module):
        q.mode = mode
        n += 1
    return n


@contextmanager
def quantizer_mode(module: nn.Module, mode: QuantMode | str) -> Iterator[None]:
    """Temporarily set every quantizer under ``module`` to ``mode`` (e.g. ``"disabled"`` for a full-precision pass)."""
    with quantizers_in_mode([q for _, q in iter_quantizers(module)], mode):
        yield


@contextmanager
def quantizers_in_mode(quantizers: Iterable[TensorQuantizer], mode: QuantMode | str) -> Iterator[None]:
    """Temporarily set each of ``quantizers`` to ``mode``; their own modes come back on exit."""
    saved = [(q, q.mode) for q in quantizers]
    try:
        for q, _ in saved:
            q.mode = mode
        yield
    finally:
        for q, m in saved:
            q.mode = m


def num_passes(quantizers: Iterable[TensorQuantizer]) -> int:
    """Passes over the data the slowest of ``quantizers`` needs."""
    return max((q.num_passes for q in quantizers), default=0)


def start_calibration_all(quantizers: Iterable[TensorQuantizer]) -> None:
    for q in quantizers:
        q.start_calibration()


def begin_pass_all(quantizers: Iterable[TensorQuantizer], pass_idx: int) -> None:
    """Begin pass ``pass_idx``; quantizers that need fewer passes stay idle (pass-through, nothing recorded)."""
    for q in quantizers:
        q.begin_pass(pass_idx)


def end_pass_all(quantizers: Sequence[TensorQuantizer], group: Any = None) -> int:
    """Merge the current pass of all ``quantizers`` over ``group`` (None: no merge) with one all-reduce per
    reduce op; return the number of collectives issued."""
    quantizers = list(quantizers)
    stats = [s for q in quantizers for s in q.pending_stats()]
    issued = merge_stats(stats, group)
    for q in quantizers:
        q.complete_pass()
    return issued


def finish_calibration_all(quantizers: Iterable[TensorQuantizer]) -> None:
    for q in quantizers:
        q.finish_calibration()


def calibrate_weights(pairs: Sequence[tuple[torch.Tensor, TensorQuantizer]], group: Any = None) -> None:
    """``quantizer.calibrate_from(weight)`` for every ``(weight, quantizer)`` pair: full weights, the same on every
    rank of ``group`` (a gathered layer). A search per slot (an observer with two passes: mse, percentile) is done
    once, not once per rank: each such weight is calibrated on one rank (the largest first, each to the rank with
    the least work so far) and the ranges travel in one all-reduce, to which the other ranks add -0.0 (``x + -0.0``
    is ``x`` for every x, -0.0 and NaN included), so every rank gets the bits one rank alone computes. Collective
    over ``group`` when it holds such weights: every rank calls it with the same pairs in the same order."""
    rank, size = group_rank_size(group)
    searched = [i for i, (w, q) in enumerate(pairs) if q.num_passes > 1 and _local(w)]
    owners = dict(zip(searched, _owners([pairs[i][0].numel() for i in searched], size))) if size > 1 else {}
    for i, (weight, quantizer) in enumerate(pairs):
        if owners.get(i, rank) == rank:
            quantizer.calibrate_from(weight)
    if not owners:
        return
    ranges = [_ranges(pairs[i][1], mine=owners[i] == rank) for i in searched]
    flat = torch.cat([r.reshape(-1) for parts in ranges for r in parts])
    merge_stats([("sum", flat)], group)
    offset = 0
    for i, parts in zip(searched, ranges):
        weight, quantizer = pairs[i]
        merged = []
        for r in parts:
            merged.append(flat[offset : offset + r.numel()].view(r.shape))
            offset += r.numel()
        if owners[i] != rank:
            quantizer.set_amax(*merged)
            quantizer.num_observed = weight.numel()
            quantizer.mode = QuantMode.QUANTIZE


def _local(weight: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(weight, DTensor)  # a DTensor is gathered inside calibrate_from, on every rank


def _owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that calibrates each weight: largest first, each to the least loaded rank (the lowest on a tie)."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = min(range(ranks), key=lambda r: load[r])
        load[owners[i]] += sizes[i]
    return owners


def _ranges(quantizer: TensorQuantizer, mine: bool) -> list[torch.Tensor]:
    """The quantizer's amax (and amin) as calibrated here, or -0.0 of their shapes from a rank that did not."""
    parts = [quantizer.amax] + ([] if quantizer.amin is None else [quantizer.amin])
    return [p.detach() if mine else torch.full_like(p, -0.0) for p in parts]


class CalibrationSession:
    """The whole protocol for a fixed list of quantizers: ``for p in session.passes(): run the data``."""

    def __init__(self, quantizers: Iterable[TensorQuantizer], group: Any = None):
        self.quantizers = list(quantizers)
        self.group = group

    @property
    def num_passes(self) -> int:
        return num_passes(self.quantizers)

    def passes(self) -> Iterator[int]:
        """Yield each pass index with the quantizers collecting; merge after each; finish after the last."""
        start_calibration_all(self.quantizers)
        for p in range(self.num_passes):
            begin_pass_all(self.quantizers, p)
            yield p
            end_pass_all(self.quantizers, self.group)
        finish_calibration_all(self.quantizers)
