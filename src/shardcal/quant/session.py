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

from torch import nn

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
    saved = [(q, q.mode) for _, q in iter_quantizers(module)]
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
