"""Shared machinery of the layer-wise algorithms: input statistics, exact cross-rank sums, parameter checks.

* :class:`InputStats` runs a gathered decoder layer over this rank's cached batches with forward hooks on chosen
  modules (their inputs, or a norm's output) and records per capture point what an algorithm asks for: the
  per-channel ``max |x|``, the Gram matrix ``X^T X`` (GPTQ's Hessian), ``sum |x|``, the token count, and token
  samples. Points fed the very same tensor (q/k/v, gate/up) share its per-batch work and one Gram sum (see
  :meth:`InputStats.same_gram`). Padding tokens are never counted (the step declares the batch's token mask, :mod:`shardcal.quant.tokens`;
  an MoE expert's routed tokens are masked too). Hooks are removed afterwards and every quantizer of the layer is
  disabled during the pass (an algorithm sees the full-precision function).
* Merging is exact, so a result does not depend on how the batches are split over ranks: maxima with one
  all-reduce MAX; sums with :class:`ExactSum`, a fixed-point accumulator in two float64 limbs whose partial sums
  are exact in any order (one all-reduce SUM for all of them). Every rank calls :meth:`InputStats.merge`, also a
  rank with no batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layerwise.moe import ExpertTokenMasks
from ..quant.linear import rotated_input
from ..quant.session import quantizer_mode
from ..quant.tokens import real_positions
from ..runtime.distributed import all_reduce_many_


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run loops of small-tensor kernels on ``n`` threads (None: unchanged). OpenMP's per-kernel overhead dominates
    tiny kernels, much more so on a busy machine."""
    before = torch.get_num_threads()
    if n is not None and n < before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def static_max(spec: Any) -> bool:
    """Whether an input spec is static and symmetric with a ``max`` observer: what a maximum over the inputs it
    will see gives exactly (per tensor: see :func:`static_max_input`)."""
    return spec is not None and not spec.dynamic and spec.observer == "max" and spec.symmetric


def static_max_input(module: nn.Module) -> bool:
    """Whether ``module``'s input quantizer is a static per-tensor symmetric ``max`` one (:func:`static_max`): the
    maximum of the recorded inputs is its amax."""
    q = getattr(module, "input_quantizer", None)
    return q is not None and static_max(q.spec) and q.layout.num_slots == 1


# ----------------------------------------------------------------------------------------------- exact sums

#: Fraction bits of :class:`ExactSum`'s low limb: values are kept to 2**-36 (absolute), and up to 2**17 summands
#: (batches) stay exact.
FRAC_BITS = 36
_FRAC = float(2**FRAC_BITS)


class ExactSum:
    """A sum of float64 tensors that is bit-identical whatever the order (and so the rank split) of the terms.

    Each term ``x`` is split, deterministically, into an integer part ``floor(x)`` and a fraction rounded to a
    multiple of 2**-36; both limbs hold integer-valued float64 numbers, whose sums are exact in any order as long
    as they stay below 2**53 (``|sum| < 9e15``, fewer than 2**17 terms). The value is exact to 2**-37 per term.
    """

    def __init__(self, shape: Sequence[int], device: torch.device | str | None = None):
        self.hi = torch.zeros(tuple(shape), dtype=torch.float64, device=device)
        self.lo = torch.zeros(tuple(shape), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = x.to(device=self.hi.device, dtype=torch.float64, copy=True)
        hi = torch.floor(x)
        self.hi += hi
        self.lo += x.sub_(hi).mul_(_FRAC).round_()

    def value(self) -> torch.Tensor:
        return self.hi + self.lo / _FRAC

    def copy(self) -> ExactSum:
        out = ExactSum((0,))
        out.hi, out.lo = self.hi.clone(), self.lo.clone()
        return out

    def limbs(self) -> list[torch.Tensor]:
        return [self.hi, self.lo]


def merge_exact(sums: Sequence[ExactSum], group: Any) -> None:
    """All-reduce (SUM) every limb of ``sums`` in one collective; exact, so identical at any world size."""
    all_reduce_many_([t for s in sums for t in s.limbs()], "sum", group, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------- input statistics


@dataclass
class PointStats:
    """Statistics of the tensor seen at one capture point (a Linear's input or a norm's output), over all ranks."""

    dim: int
    max: torch.Tensor | None = None  # [dim] float32, max |x| per channel
    gram: ExactSum | None = None  # [dim, dim]: sum over tokens of x x^T
    abssum: ExactSum | None = None  # [dim]: sum over tokens of |x|
    count: ExactSum | None = None  # [1]: tokens seen
    samples: list[torch.Tensor] | None = None  # this rank's: per batch, up to ``sample_tokens`` evenly spaced rows
    rows: list[torch.Tensor] = field(default_factory=list)  # this rank's: per batch, every real token's row
    _last: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        return int(self.count.value().item()) if self.count is not None else 0

    def hessian(self) -> torch.Tensor:
        """``X^T X`` summed over every rank's tokens (float64)."""
        return self.gram.value()

    def mean_abs(self) -> torch.Tensor:
        """Per-channel mean ``|x|`` over every rank's tokens (float64; zeros when no token was seen)."""
        n = max(self.tokens, 1)
        return self.abssum.value() / n


@dataclass
class _BatchInput:
    """One tensor a hook got in this batch, shared by every point fed it (q/k/v, gate/up): its real-token rows, and
    what the points record of it, each computed once."""

    x: torch.Tensor  # the object the hook got (the cache key's owner)
    rows: torch.Tensor  # [real tokens, channels] float32
    _absmax: torch.Tensor | None = None
    _abssum: torch.Tensor | None = None
    _gram: torch.Tensor | None = None

    def absmax(self) -> torch.Tensor:
        if self._absmax is None:
            self._absmax = self.rows.abs().amax(dim=0)
        return self._absmax

    def abssum(self) -> torch.Tensor:
        if self._abssum is None:
            self._abssum = self.rows.abs().sum(dim=0, dtype=torch.float64)
        return self._abssum

    def gram(self) -> torch.Tensor:
        if self._gram is None:
            self._gram = self.rows.T @ self.rows  # float32 per batch, as GPTQ implementations do; summed exactly
        return self._gram


class InputStats:
    """Per-capture-point statistics of one decoder layer's inputs; see the module docstring.

    ``points``: key -> ``(module, where)``, ``where`` being ``"input"`` (the first positional argument of the
    module's forward, e.g. a Linear's input) or ``"output"`` (its result, e.g. a norm's). ``kinds``: a subset of
    ``{"max", "gram", "abssum", "samples"}`` (the count is always kept; ``samples`` keeps, per batch, up to
    ``sample_tokens`` evenly spaced token rows, the same rows whatever the rank split, and is not merged). The input
    of a Linear that rotates its inputs is recorded rotated (what its weight sees), or as it comes with
    ``rotated=False`` (what a smoothing scale applies to). Use::

        stats = InputStats(points, {"gram"}); stats.collect(step); stats.merge(group); stats[key].hessian()
    """

    def __init__(
        self,
        points: Mapping[str, tuple[nn.Module, str]],
        kinds: set[str],
        sample_tokens: int = 128,
        rotated: bool = True,
        keep_rows: Sequence[str] = (),
    ):
        self.points = dict(points)
        #: Points whose every real-token row (float32, per batch, on the step's cache device) is kept in
        #: ``stats[key].rows`` (not merged).
        self.keep_rows = set(keep_rows)
        self._rows_device: torch.device | str = "cpu"
        #: Whether a rotating Linear's input is recorded as its weight sees it (``x H``) or as it comes (``x``).
        self.rotated = rotated
        self.kinds = set(kinds)
        self.sample_tokens = sample_tokens
        self.stats: dict[str, PointStats] = {}
        self._cache: dict[int, _BatchInput] = {}
        self._rotated: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        #: This batch's input entry per gram point, and the points that have shared one Gram sum with an earlier
        #: point so far (the same input tensor in every batch: q/k/v, gate/up) -> that point.
        self._gram_inputs: dict[str, list[_BatchInput]] = {}
        self._gram_shared: dict[str, str] = {}

    def __getitem__(self, key: str) -> PointStats:
        return self.stats[key]

    def __contains__(self, key: str) -> bool:
        return key in self.stats

    def _dims(self) -> dict[str, int]:
        dims = {}
        for key, (module, where) in self.points.items():
            if isinstance(module, nn.Linear):
                dims[key] = module.in_features if where == "input" else module.out_features
            elif getattr(module, "weight", None) is not None and where == "output":
                dims[key] = int(module.weight.shape[-1])
            else:
                raise TypeError(f"capture point {key!r}: cannot tell the channel count of a {type(module).__name__}")
        return dims

    def _init(self, device: torch.device) -> None:
        for key, dim in self._dims().items():
            s = PointStats(dim)
            s.count = ExactSum((1,), device)
            if "max" in self.kinds:
                s.max = torch.zeros(dim, dtype=torch.float32, device=device)
            if "gram" in self.kinds:
                s.gram = ExactSum((dim, dim), device)
            if "abssum" in self.kinds:
                s.abssum = ExactSum((dim,), device)
            if "samples" in self.kinds:
                s.samples = []
            self.stats[key] = s

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[tokens, channels]`` without padding tokens (the batch's mask, declared by the step)."""
        return real_positions(x).reshape(-1, x.shape[-1])

    def _record(self, key: str, x: torch.Tensor) -> None:
        s = self.stats[key]
        # q/k/v (gate/up, a norm and its consumers) see the very same tensor object: work on it once per batch
        # (keyed on the object the hook got: detach() makes a new one at every call)
        entry = self._cache.get(id(x))
        if entry is None or entry.x is not x:
            entry = _BatchInput(x, self._rows(x.detach()).float())
            self._cache[id(x)] = entry
        rows = entry.rows
        s.count.add(torch.tensor([float(rows.shape[0])], dtype=torch.float64))
        if rows.shape[0] == 0:
            return
        if s.max is not None:
            s.max = torch.maximum(s.max, entry.absmax().to(s.max.device))
        if s.abssum is not None:
            s.abssum.add(entry.abssum())
        if key in self.keep_rows:  # beside the activation cache (on the host when it is offloaded)
            kept = rows.to(self._rows_device)
            s.rows.append(kept if kept.data_ptr() != x.data_ptr() else kept.clone())
        if s.samples is not None:
            n = rows.shape[0]
            k = min(n, self.sample_tokens)
            index = torch.linspace(0, n - 1, k, device=rows.device).round().long()
            s.samples.append(rows[index].clone())
        if s.gram is not None:
            self._gram_inputs.setdefault(key, []).append(entry)  # summed at the end of the batch (_add_grams)

    def _add_grams(self, first: bool) -> None:
        """Add this batch's ``X^T X`` to the Gram sums: one product and one sum per distinct input tensor. Points
        that saw the same tensor as an earlier point in the first batch share that point's sum (one object) for as
        long as they keep seeing its tensor; one that stops gets a copy of the sum so far."""
        calls, self._gram_inputs = self._gram_inputs, {}

        def seen(key: str) -> list[int]:
            return [id(entry) for entry in calls.get(key, [])]

        if first:
            owner: dict[tuple[int, ...], str] = {}
            for key in calls:
                leader = owner.setdefault(tuple(seen(key)), key)
                if leader != key:
                    self.stats[key].gram = self.stats[leader].gram
                    self._gram_shared[key] = leader
        for key, leader in list(self._gram_shared.items()):
            if seen(key) != seen(leader):
                self.stats[key].gram = self.stats[leader].gram.copy()
                del self._gram_shared[key]
        for key, entries in calls.items():
            if key in self._gram_shared:
                continue
            for entry in entries:  # each call of the module
                self.stats[key].gram.add(entry.gram())

    def same_gram(self) -> list[list[str]]:
        """The points grouped by equal merged Gram sums (q/k/v, gate/up: one input), in the order of the points.
        Found from the values, so every rank finds the same groups whichever batches it saw. Call after
        :meth:`merge`."""
        groups: list[list[str]] = []
        for key, s in self.stats.items():
            if s.gram is None:
                continue
            for g in groups:
                first = self.stats[g[0]].gram
                if first is s.gram or (
                    first.hi.shape == s.gram.hi.shape
                    and torch.equal(first.hi.diagonal(), s.gram.hi.diagonal())  # cheap first: most differ there
                    and all(torch.equal(a, b) for a, b in zip(first.limbs(), s.gram.limbs()))
                ):
                    g.append(key)
                    break
            else:
                groups.append([key])
        return groups

    def _record_input(self, key: str, module: nn.Module, x: torch.Tensor) -> None:
        """A Linear's input as its weight sees it: rotated when the Linear rotates its inputs (once per tensor and
        block, shared by q/k/v)."""
        block = getattr(module, "input_rotation", None)
        if block is not None and self.rotated:
            entry = self._rotated.get((id(x), block))
            if entry is None or entry[0] is not x:
                entry = (x, rotated_input(module, x.detach()))
                self._rotated[(id(x), block)] = entry
            x = entry[1]
        self._record(key, x)

    def collect(self, step: Any, keep_outputs: bool = False) -> InputStats:
        """Run ``step.layer`` over this rank's cached batches (quantizers disabled) and record the statistics; with
        ``keep_outputs`` the layer's outputs are kept as ``step.outputs`` (its full-precision outputs, the next
        layer's inputs under ``propagate="fp"`` unless the caller changes the layer's function)."""
        self._init(step.device)
        self._rows_device = step.cache_device
        outputs = []
        with ExitStack() as stack:
            stack.enter_context(quantizer_mode(step.layer, "disabled"))
            stack.enter_context(ExpertTokenMasks(step.layer))
            for key, (module, where) in self.points.items():
                if where == "input":
                    hook = module.register_forward_pre_hook(
                        lambda m, args, key=key: self._record_input(key, m, args[0])
                    )
                else:
                    hook = module.register_forward_hook(lambda m, args, out, key=key: self._record(key, out))
                stack.callback(hook.remove)
            for i in range(len(step.inputs)):
                out = step.forward(i)  # declares the batch's token mask (shardcal.quant.tokens)
                self._add_grams(first=i == 0)
                self._cache, self._rotated = {}, {}
                if keep_outputs:
                    outputs.append(out.to(step.cache_device))
        if keep_outputs:
            step.outputs = outputs
        return self

    def merge(self, group: Any) -> InputStats:
        """Merge over ``group`` (collective; every rank calls it, in the same order of points): exact."""
        all_reduce_many_([s.max for s in self.stats.values() if s.max is not None], "max", group, dtype=torch.float32)
        sums = [e for s in self.stats.values() for e in (s.count, s.gram, s.abssum) if e is not None]
        merge_exact(sums, group)  # a shared Gram sum in each of its points' slots: the same collective on every rank
        return self
