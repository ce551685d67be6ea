"""Observers: how a quantizer's amax is calibrated from data, with an exact merge across data-parallel ranks.

An observer accumulates statistics over one or more *passes* over the same data. After each pass every rank
merges its statistics with the other ranks' (an all-reduce; :mod:`shardcal.quant.session` batches the
all-reduces of many quantizers into one per reduce op). Each observer is built so that observing data split
over ranks and merging gives the same amax as observing all of it in one process:

- ``max`` (1 pass): the running amax of ``|x|`` per amax slot, merged with MAX. Bit-exact.
- ``percentile`` (2 passes; ``percentile`` = 99.99, ``bins`` = 2048): pass 0 is ``max`` (the histogram range,
  agreed across ranks with MAX); pass 1 counts ``|x|`` into ``bins`` equal bins over ``[0, range]`` per slot,
  merged with SUM (integer counts, exact); the amax is the upper edge of the bin holding the given percentile.
- ``mse`` (2 passes; ``grid`` = 100, ``max_shrink`` = 0.2, ``norm`` = 2.0): pass 0 is ``max``; pass 1 scores the
  candidates ``amax * (1 - i / grid)`` for ``i = 0 .. max_shrink * grid`` by the quantization error
  ``sum |x - fake_quant(x)|^norm`` per slot (float64 sums, merged with SUM; int formats score in code units,
  see :meth:`MseObserver._code_errors`); the best candidate wins (the larger one on a tie).

An asymmetric spec (int weights) calibrates a range: pass 0 also records the running ``min(x, 0)`` per slot (kept
as ``max(-x, 0)``, merged with MAX, so bit-exact), ``max`` records ``max(x, 0)`` instead of ``max |x|``, and ``mse``
shrinks both ends by the same fraction.

Every observer also counts the elements it saw in pass 0 (merged with SUM): an MoE expert that no rank routed a
token to reports 0, and its amax stays 0.

Observer state lives on the device given at construction (the quantizer's); statistics are reduced on the
data's device first, so only amax-sized tensors move.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import ClassVar

import torch

from .formats import FORMATS, qdq_arranged, qparams
from .granularity import Layout
from .merge import Stat
from .spec import OBSERVER_KINDS, QuantizerSpec


class Observer:
    """Base class: pass 0 records the running amax and the number of elements seen."""

    name: ClassVar[str] = ""
    num_passes: ClassVar[int] = 1

    def __init__(self, spec: QuantizerSpec, layout: Layout, device: torch.device | str | None = None):
        self.spec = spec
        self.layout = layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.params = dict(spec.observer_params)  # checked and completed with defaults by the spec
        self.reset()

    def reset(self) -> None:
        """Forget everything observed."""
        self.amax = torch.zeros(self.layout.amax_shape, dtype=torch.float32, device=self.device)
        #: Asymmetric only: the running ``max(-x, 0)`` per slot (``-amin``), merged with MAX like the amax.
        self.neg_amin = None if self.spec.symmetric else torch.zeros_like(self.amax)
        self.count = torch.zeros((), dtype=torch.float64, device=self.device)

    @property
    def num_observed(self) -> int:
        """Elements seen in pass 0 (after the merge: over all ranks)."""
        return int(self.count.item())

    def observe(self, x: torch.Tensor, pass_idx: int) -> None:
        """Record ``x`` (any leading dims; the trailing ones the layout expects) in pass ``pass_idx``."""
        if x.numel() == 0:
            return
        if pass_idx == 0:
            if self.neg_amin is None:
                self.amax = torch.maximum(self.amax, self.layout.amax_of(x).to(self.device))
            else:
                hi, lo = self.layout.range_of(x)
                self.amax = torch.maximum(self.amax, hi.to(self.device))
                self.neg_amin = torch.maximum(self.neg_amin, (-lo).to(self.device))
            self.count += x.numel()
        else:
            self._observe_pass(x.detach(), pass_idx)

    def _observe_pass(self, x: torch.Tensor, pass_idx: int) -> None:
        raise AssertionError(f"{self.name} observer has no pass {pass_idx}")

    def stats(self, pass_idx: int) -> list[Stat]:
        """The tensors to all-reduce after pass ``pass_idx`` (merged in place)."""
        if pass_idx == 0:
            ranges = [("max", self.amax)] + ([] if self.neg_amin is None else [("max", self.neg_amin)])
            return ranges + [("sum", self.count)]
        return self._pass_stats(pass_idx)

    def _pass_stats(self, pass_idx: int) -> list[Stat]:
        raise AssertionError(f"{self.name} observer has no pass {pass_idx}")

    def after_merge(self, pass_idx: int) -> None:
        """Called on every rank once pass ``pass_idx``'s statistics are merged (or kept local)."""

    def compute_amax(self) -> torch.Tensor:
        """The calibrated amax (float32, the layout's amax shape), after the last pass."""
        return self.amax.clone()

    def compute_amin(self) -> torch.Tensor | None:
        """The calibrated amin of an asymmetric spec (float32, <= 0), after the last pass; None when symmetric."""
        return None if self.neg_amin is None else -self.neg_amin


class MaxObserver(Observer):
    """Running ``max |x|`` per amax slot; merged with MAX (bit-exact)."""

    name = "max"
    num_passes = OBSERVER_KINDS[name].num_passes


class PercentileObserver(Observer):
    """The given percentile of ``|x|`` per slot, read off a histogram over a range agreed across ranks."""

    name = "percentile"
    num_passes = OBSERVER_KINDS[name].num_passes

    def reset(self) -> None:
        super().reset()
        self.counts: torch.Tensor | None = None

    def after_merge(self, pass_idx: int) -> None:
        if pass_idx == 0:
            bins = self.params["bins"]
            self.counts = torch.zeros(self.layout.num_slots * bins, dtype=torch.float64, device=self.device)

    def _observe_pass(self, x: torch.Tensor, pass_idx: int) -> None:
        bins = self.params["bins"]
        a = self.layout.arrange(x).abs().float()
        rng = self.layout.broadcast(self.amax.to(a.device))
        pos = torch.where(rng > 0, a / rng * bins, torch.zeros_like(a))
        idx = torch.clamp(torch.floor(pos), 0, bins - 1).long()
        flat = (self.layout.slot_index(a) * bins + idx).reshape(-1)
        hist = torch.bincount(flat, minlength=self.layout.num_slots * bins)
        self.counts += hist.to(device=self.device, dtype=torch.float64)

    def _pass_stats(self, pass_idx: int) -> list[Stat]:
        return [("sum", self.counts)]

    def compute_amax(self) -> torch.Tensor:
        bins, p = self.params["bins"], float(self.params["percentile"])
        counts = self.counts.view(self.layout.num_slots, bins)
        total = counts.sum(-1)
        target = torch.clamp(torch.ceil(total * (p / 100.0) - 1e-6), min=1.0)
        idx = (counts.cumsum(-1) < target[:, None]).sum(-1).clamp(max=bins - 1)
        rng = self.amax.reshape(-1).double()
        amax = (idx + 1).double() / bins * rng
        amax = torch.where(total > 0, amax, torch.zeros_like(amax))
        return amax.float().reshape(self.layout.amax_shape)


class MseObserver(Observer):
    """The candidate amax (a fraction of the max) with the least quantization error over all data, per slot."""

    name = "mse"
    num_passes = OBSERVER_KINDS[name].num_passes

    def reset(self) -> None:
        super().reset()
        grid, shrink = self.params["grid"], self.params["max_shrink"]
        steps = int(math.floor(shrink * grid + 1e-9))
        self.fractions = torch.tensor([1.0 - i / grid for i in range(steps + 1)], dtype=torch.float32)
        self.errors: torch.Tensor | None = None

    def after_merge(self, pass_idx: int) -> None:
        if pass_idx == 0:
            self.errors = torch.zeros(
                len(self.fractions), self.layout.num_slots, dtype=torch.float64, device=self.device
            )

    def candidates(self) -> torch.Tensor:
        """``[n_candidates, n_slots]`` float32 candidate amax values."""
        return self.amax.reshape(1, -1) * self.fractions.to(self.amax.device).reshape(-1, 1)

    def amin_candidates(self) -> torch.Tensor | None:
        """Asymmetric: the ``[n_candidates, n_slots]`` candidate amin values (the same fractions); else None."""
        if self.neg_amin is None:
            return None
        return -self.neg_amin.reshape(1, -1) * self.fractions.to(self.amax.device).reshape(-1, 1)

    #: About how many elements of a weight are scored against every candidate at a time (a block of whole rows
    #: that stays in the CPU cache while the candidates run over it).
    TILE_ELEMENTS: ClassVar[int] = 1 << 18

    def _observe_pass(self, x: torch.Tensor, pass_idx: int) -> None:
        cands, lows = self.candidates().to(x.device), self.amin_candidates()
        lows = None if lows is None else lows.to(x.device)
        codes = self._code_ranges(cands, lows) if FORMATS[self.spec.format].kind == "int" else None
        for slots, layout, tile, rows in self._tiles(x):
            a = layout.arrange(tile).float()
            if codes is not None:
                sums = self._code_errors(a, layout, [t if isinstance(t, float) else t[:, slots] for t in codes], rows)
            else:
                sums = self._value_errors(a, layout, cands[:, slots], None if lows is None else lows[:, slots], rows)
            self.errors[:, slots] += sums.to(self.device)

    def _value_errors(
        self, a: torch.Tensor, layout: Layout, cands: torch.Tensor, lows: torch.Tensor | None, rows: bool
    ) -> torch.Tensor:
        """``[candidates, slots]`` float64 sums of ``|a - fake_quant(a)|^norm`` (fp8, nvfp4; a tile of whole weight
        rows sums each slot's few elements in float32 first)."""
        norm = float(self.params["norm"])
        sums = torch.empty(len(cands), layout.num_slots, dtype=torch.float64, device=a.device)
        for i, cand in enumerate(cands):
            low = None if lows is None else layout.broadcast(lows[i])
            diff = qdq_arranged(a, layout.broadcast(cand), self.spec.format, low).sub_(a)  # |deq - a| = |a - deq|
            err = diff.square_() if norm == 2.0 else diff.abs_().pow_(norm)
            sums[i] = (err.sum(-1) if rows else layout.reduce(err, "sum")).reshape(-1)
        return sums

    def _code_ranges(self, cands: torch.Tensor, lows: torch.Tensor | None) -> list[torch.Tensor | float]:
        """``[scale, scale / first candidate's scale, lowest code, highest code, scale^norm (float64)]`` of every
        candidate of an int format (``[candidates, slots]`` each; the codes a float when symmetric, else shifted
        by each candidate's zero point, as ``formats`` quantizes them)."""
        f, norm = FORMATS[self.spec.format], float(self.params["norm"])
        scales, zp = qparams(cands, lows, self.spec.format)
        low_codes: torch.Tensor | float = f.qmin if zp is None else f.qmin - zp
        high_codes: torch.Tensor | float = f.qmax if zp is None else f.qmax - zp
        factors = scales.double().square() if norm == 2.0 else scales.double().pow(norm)
        return [scales, scales[:1] / scales, low_codes, high_codes, factors]

    def _code_errors(
        self, a: torch.Tensor, layout: Layout, codes: list[torch.Tensor | float], rows: bool
    ) -> torch.Tensor:
        """``[candidates, slots]`` float64 sums of ``|a - fake_quant(a)|^norm`` for an int format, scored in code
        units: with ``z = a / scale`` and the code ``q = clamp(round(z))``, an element's error is
        ``scale * |q - z|``, so a slot's sum is ``scale^norm * sum |q - z|^norm``. ``z`` is ``a`` over the first
        candidate's scale times the ratio of the scales (one division per tile, not per candidate); a tile of
        whole weight rows sums each slot's few elements in float32."""
        norm = float(self.params["norm"])
        scales, ratios, low_codes, high_codes, factors = codes
        b = layout.broadcast
        scaled = a / b(scales[0])
        z, d = torch.empty_like(a), torch.empty_like(a)
        sums = torch.empty(
            len(ratios), layout.num_slots, device=a.device, dtype=torch.float32 if rows else torch.float64
        )
        for i in range(len(ratios)):
            torch.mul(scaled, b(ratios[i]), out=z)
            lo, hi = (t if isinstance(t, float) else b(t[i]) for t in (low_codes, high_codes))
            torch.round(z, out=d).clamp_(lo, hi).sub_(z)
            if rows:  # norm 2 (see _tiles): the root of the sum of squares in one pass, squared below
                torch.linalg.vector_norm(d, dim=-1, out=sums[i].view(d.shape[:-1]))
            else:
                sums[i] = layout.reduce(d.square_() if norm == 2.0 else d.abs_().pow_(norm), "sum").reshape(-1)
        return (sums.double().square_() if rows else sums).mul_(factors)

    def _tiles(self, x: torch.Tensor) -> Iterator[tuple[slice, Layout, torch.Tensor, bool]]:
        """``(slots, layout, part of x, whole rows)``: a weight whose first dim holds amax slots (per channel /
        group) in blocks of whole rows of about :attr:`TILE_ELEMENTS` (each slot's elements all in one block);
        anything else whole: activations (sums over tokens), and any norm but 2 (a vectorized ``pow`` can round an
        element differently from the scalar one, which handles the tail of a tensor, so the elements' positions
        must stay as they were)."""
        lay = self.layout
        rows = x.shape[0] if x.ndim else 1
        if float(self.params["norm"]) != 2.0 or x.ndim != len(lay.amax_shape) or lay.amax_shape[0] != rows or rows == 1:
            yield slice(None), lay, x, False
            return
        per_row = lay.num_slots // rows
        step = max(1, self.TILE_ELEMENTS // max(1, x[0].numel()))
        for r in range(0, rows, step):
            tile = x[r : r + step]
            yield slice(r * per_row, (r + tile.shape[0]) * per_row), Layout(self.spec, tile.shape, lay.name), tile, True

    def _pass_stats(self, pass_idx: int) -> list[Stat]:
        return [("sum", self.errors)]

    def _best(self, cands: torch.Tensor) -> torch.Tensor:
        best = self.errors.min(dim=0).indices  # the first (largest) candidate on a tie; faster than argmin
        return cands.gather(0, best.reshape(1, -1).to(cands.device)).reshape(self.layout.amax_shape).clone()

    def compute_amax(self) -> torch.Tensor:
        return self._best(self.candidates())

    def compute_amin(self) -> torch.Tensor | None:
        lows = self.amin_candidates()
        return None if lows is None else self._best(lows)


OBSERVERS: dict[str, type[Observer]] = {cls.name: cls for cls in (MaxObserver, PercentileObserver, MseObserver)}


def make_observer(spec: QuantizerSpec, layout: Layout, device: torch.device | str | None = None) -> Observer:
    return OBSERVERS[spec.observer](spec, layout, device)
