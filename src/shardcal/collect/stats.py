"""Per-target statistics of a collection, accumulated by hooks and merged exactly across ranks.

A :class:`TargetObserver` sees every tensor its target yields while the step runs (a hook calls
:meth:`TargetObserver.observe`), drops padded positions (:func:`shardcal.quant.tokens.real_positions`) and keeps, per
channel (the last dimension):

* ``absmax`` (float32): the running max of ``|x|`` — merged with an all-reduce MAX, exact;
* the token count, ``sum x`` and ``sum x**2`` (each call's sums in float32 — torch's cascade summation, float64
  for a float64 model — added to an :class:`~shardcal.algorithms.stats.ExactSum`): merged with an all-reduce SUM,
  exact in any order, so the mean and mean of squares are bit-identical at every world size;
* with ``histogram``, counts of ``|x|`` in ``bins`` equal bins over ``[0, range]``, ``range`` being the merged
  absmax's largest channel — the percentile observer's two passes: pass 0 agrees on the range, pass 1 counts
  (integer counts, merged with SUM). Pass 1 runs on the rows kept from pass 0 when they fit in memory, else on a
  second run of the layer.

Three collectives per layer: flags (MAX: which targets ran, their channel counts, problems), absmax (MAX), and counts,
sums and histograms (one SUM). Every rank takes them, also one with no batches (it learns each target's channel
count from the flags).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..algorithms.stats import ExactSum
from ..quant.tokens import real_positions
from ..runtime.distributed import all_reduce_many_
from .report import TargetStats, top_channels
from .targets import Target, is_tensor

#: Problems a hook can find, as codes merged with MAX across ranks (0: none).
NOT_A_TENSOR, CHANNELS_DIFFER, NOT_PER_TOKEN, SEVERAL_CALLS = 1, 2, 3, 4


#: Elements per ``torch.histc`` call: its float32 counts stay exact below 2**24.
HISTC_CHUNK = 2**24


def histogram_counts(a: torch.Tensor, rng: torch.Tensor, bins: int) -> torch.Tensor:
    """Counts (float64 ``[bins]``, integers) of ``a`` (``|x|`` in float32; left unchanged) in ``bins`` equal bins
    over ``[0, rng]``, as the percentile observer counts them: ``clamp(floor(a / rng * bins), 0, bins - 1)`` in
    float32 (everything in bin 0 when ``rng`` is 0).

    On the CPU with a power-of-two ``bins`` this is ``torch.histc`` (one pass): it computes ``floor(a * bins / rng)``,
    and scaling by a power of two is exact, so ``a * bins / rng`` and ``a / rng * bins`` are the same float (the tests
    compare with the formula)."""
    out = torch.zeros(bins, dtype=torch.float64, device=a.device)
    flat = a.reshape(-1)
    rng = rng.to(device=a.device, dtype=torch.float32).reshape(())
    top = float(rng)
    if not top > 0:
        out[0] = flat.numel()
        return out
    if a.device.type == "cpu" and bins & (bins - 1) == 0:
        for s in range(0, flat.numel(), HISTC_CHUNK):
            out += torch.histc(flat[s : s + HISTC_CHUNK], bins, 0.0, top).to(torch.float64)
        return out
    index = (flat / rng).mul_(bins).floor_().clamp_(0, bins - 1).long()
    return out.add_(torch.bincount(index, minlength=bins).to(torch.float64))


class TargetObserver:
    """Statistics of one target over this rank's batches (see the module docstring).

    ``keep``: keep every call's real rows (on ``keep_device``) for the histogram pass and for saving them, until
    :meth:`drop_kept`. ``per_token``: the tensor must be one row per token of the batch (``[B, L, C]`` or
    ``[B * L, C]``), called once per batch, as saving raw activations needs.
    """

    def __init__(self, target: Target, stats: Sequence[str], bins: int, device: torch.device):
        self.target = target
        self.stats = tuple(stats)
        self.bins = bins
        self.device = device
        self.channels = 0
        self.problem = 0
        self.calls = 0
        self.keep = False
        self.keep_device = device
        self.per_token = False
        self.kept: dict[int, list[torch.Tensor]] = {}  # batch -> its calls' real rows
        self.kept_bytes = 0
        self.unsquared: list[torch.Tensor] = []  # kept |x| whose sum of squares is still to be added
        self.batch = -1
        self.batch_shape: tuple[int, ...] = ()
        self.batch_calls = 0
        self.absmax = torch.zeros(0, dtype=torch.float32, device=device)
        self.count = ExactSum((1,), device)
        self.sums: dict[str, ExactSum] = {}  # "mean": sum of x, "meansq": sum of x**2
        self.hist: torch.Tensor | None = None

    # ------------------------------------------------------------------ observing
    def start_batch(self, batch: int, shape: tuple[int, ...]) -> None:
        """The next calls belong to (this rank's) batch ``batch`` of token shape ``shape`` (``[B, L]``)."""
        self.batch, self.batch_shape, self.batch_calls = batch, tuple(shape), 0

    def observe(self, value: Any) -> None:
        """Pass 0: record one call's tensor."""
        self.calls += 1
        self.batch_calls += 1
        if not is_tensor(value):
            self.problem = max(self.problem, NOT_A_TENSOR)
            return
        x = value.detach()
        if not self.channels:
            self._allocate(int(x.shape[-1]))
        if x.shape[-1] != self.channels:
            self.problem = max(self.problem, CHANNELS_DIFFER)
            return
        if self.per_token:
            self._check_per_token(tuple(x.shape[:-1]))
        rows = real_positions(x).reshape(-1, self.channels)
        self.count.add(torch.tensor([float(rows.shape[0])], dtype=torch.float64))
        wide = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
        a = wide.abs()  # a new tensor: kept as is for the histogram
        if rows.shape[0]:
            self.absmax = torch.maximum(self.absmax, a.amax(dim=0).float().to(self.device))
            if "mean" in self.sums:  # per call in float32 (torch's cascade sum), then exactly in fixed point
                self.sums["mean"].add(wide.sum(dim=0))
        if self.keep:  # signed rows to save them (a copy: the forward may change its tensors in place), or |x|
            kept = rows.to(self.keep_device, copy=True) if self.per_token else a.float().to(self.keep_device)
            self.kept.setdefault(self.batch, []).append(kept)
            self.kept_bytes += kept.numel() * kept.element_size()
            if kept is a:  # sum x**2 follows from the kept |x| after the histogram (the same float operations)
                self.unsquared.append(a)
                return
        self.add_squares(a)

    def add_squares(self, a: torch.Tensor) -> None:
        """Add one call's ``sum x**2`` per channel, from its ``|x|`` (``a``, squared in place)."""
        if "meansq" in self.sums and a.shape[0]:
            self.sums["meansq"].add(a.square_().sum(dim=0))

    def _check_per_token(self, leading: tuple[int, ...]) -> None:
        flat = (self.batch_shape[0] * self.batch_shape[1],) if len(self.batch_shape) == 2 else None
        if leading != self.batch_shape and leading != flat:
            self.problem = max(self.problem, NOT_PER_TOKEN)
        elif self.batch_calls > 1:
            self.problem = max(self.problem, SEVERAL_CALLS)

    def _allocate(self, channels: int) -> None:
        self.channels = channels
        self.absmax = torch.zeros(channels, dtype=torch.float32, device=self.device)
        self.sums = {s: ExactSum((channels,), self.device) for s in ("mean", "meansq") if s in self.stats}

    def drop_kept(self) -> None:
        self.kept, self.kept_bytes = {}, 0

    # ------------------------------------------------------------------ after pass 0
    def shape_flags(self) -> list[float]:
        """``[ran, channels, problem]`` of this rank, to merge with MAX."""
        return [float(self.calls > 0), float(self.channels), float(self.problem)]

    def adopt(self, channels: int) -> None:
        """Take the channel count the ranks agreed on (a rank that saw no call allocates its zero statistics)."""
        if not self.channels:
            self._allocate(channels)

    def histogram_range(self) -> torch.Tensor:
        return self.absmax.max().reshape(1) if self.absmax.numel() else torch.zeros(1, device=self.device)

    def start_histogram(self) -> None:
        """Pass 1 begins: zero counts (also on a rank without batches: it merges them too)."""
        self.hist = torch.zeros(self.bins, dtype=torch.float64, device=self.device)

    def count_histogram(self, a: torch.Tensor) -> None:
        """Pass 1: add ``a`` (``|x|`` in float32 of one call's real rows) to the histogram over the merged range."""
        if a.numel():
            self.hist += histogram_counts(a.to(self.device), self.histogram_range(), self.bins).to(self.hist.device)

    def count_kept(self) -> None:
        """Pass 1 on the rows kept from pass 0: ``|x|``, whose squares are added here, or the signed rows once they are
        saved (made ``|x|`` in place)."""
        for batch in sorted(self.kept):
            for kept in self.kept[batch]:
                if self.per_token:  # signed rows, already saved: |x| in place when they are float32
                    kept = kept.abs_() if kept.dtype == torch.float32 else kept.abs().float()
                self.count_histogram(kept)
        self.square_kept()

    def square_kept(self) -> None:
        """Add the squares of the kept ``|x|`` whose squares the hooks left for later."""
        for a in self.unsquared:
            self.add_squares(a)
        self.unsquared = []

    def drop_unsquared(self) -> None:
        """Forget the kept rows (too many to keep) after adding the squares still owed, as the hooks do from now on."""
        self.square_kept()
        self.drop_kept()

    def observe_histogram(self, value: Any) -> None:
        """Pass 1 on a second run of the layer: one call's tensor."""
        if is_tensor(value):
            self.count_histogram(real_positions(value.detach()).reshape(-1, self.channels).abs().float())

    # ------------------------------------------------------------------ result
    def result(self, top_k: int) -> TargetStats:
        """The merged statistics (call after every merge)."""
        tokens = int(self.count.value().item())
        n = max(tokens, 1)
        mean = self.sums["mean"].value() / n if "mean" in self.sums else None
        meansq = self.sums["meansq"].value() / n if "meansq" in self.sums else None
        hist = self.hist.round().to(torch.int64) if self.hist is not None else None
        absmax = self.absmax.cpu()
        return TargetStats(
            name=self.target.name,
            pattern=self.target.pattern,
            layer=self.target.layer,
            channels=self.channels,
            tokens=tokens,
            absmax=absmax,
            mean=None if mean is None else mean.cpu(),
            meansq=None if meansq is None else meansq.cpu(),
            histogram=None if hist is None else hist.cpu(),
            top_channels=top_channels(absmax, top_k),
        )


def merge_flags(observers: Sequence[TargetObserver], group: Any) -> torch.Tensor:
    """``[targets, 3]``: whether any rank saw a call, the channel count, the worst problem (one all-reduce MAX)."""
    flags = torch.tensor([o.shape_flags() for o in observers], dtype=torch.float64).reshape(len(observers), 3)
    all_reduce_many_([flags], "max", group, dtype=torch.float64)
    return flags


def merge_maxima(observers: Sequence[TargetObserver], group: Any) -> None:
    """Pass 0's absmax over ``group`` (one all-reduce MAX): the histogram's range."""
    all_reduce_many_([o.absmax for o in observers], "max", group, dtype=torch.float32)


def merge_sums(observers: Sequence[TargetObserver], group: Any) -> None:
    """Counts, sums (their fixed-point limbs) and histogram counts over ``group``: one all-reduce SUM in float64 of
    integer-valued numbers below 2**53, exact in any order."""
    for o in observers:
        o.square_kept()
    tensors = [t for o in observers for s in (o.count, *o.sums.values()) for t in s.limbs()]
    tensors += [o.hist for o in observers if o.hist is not None]
    all_reduce_many_(tensors, "sum", group, dtype=torch.float64)
