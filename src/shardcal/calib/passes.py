"""The passes one decoder layer's calibration runs over its cached inputs, decided in one place, as data.

A calibration step runs the gathered layer several times: the algorithm's own passes (SmoothQuant's statistics,
GPTQ's Hessian, AutoRound's steps), the observing passes that calibrate activation quantizers, the SQNR sample
(the layer with its quantizers off, then on, over the SQNR sequences), and the pass that computes the next layer's
inputs. Which of them run, which keeps its outputs, and whose outputs the next layer gets is decided here, by
:func:`plan_layer_passes`, from :class:`LayerFacts` — the recipe's quantizers, the algorithm's flags and the layer's
structure, all known before the first pass — and nowhere else: the runner (:mod:`shardcal.calib.runner`) executes
the plan, the planner counts it, the tests read it.

The rules, in order (each a consequence of what the outputs of a pass are):

* an algorithm that changes the layer's function (GPTQ, AWQ, AutoRound: ``changes_weights`` and not
  ``preserves_function``) needs the layer's full-precision outputs on the SQNR sequences *before* it runs: the SQNR
  compares against the layer as it came;
* outputs the algorithm's passes leave (:attr:`LayerFacts.algorithm_keeps`) stay valid only when they are what the
  layer computes afterwards: full-precision outputs of a function-preserving algorithm (SmoothQuant's folds), or the
  final outputs of the layer as the algorithm leaves it (AutoRound) when nothing else is set after it and the next
  inputs are the quantized ones (``propagate = "qdq"``);
* the observing passes are those the activation observers need (1 for ``max``, 2 for ``percentile`` / ``mse``);
  with none, one pass still runs when the next inputs are the full-precision outputs and no valid outputs exist, and
  an MoE layer runs one to count its routing unless it propagates its quantized outputs with nothing to observe;
  the first observing pass runs in full precision and keeps its outputs;
* the SQNR's full-precision side is the first of: the pre-algorithm pass, the first observing pass, the
  algorithm's valid full-precision outputs, else a pass of its own over the SQNR sequences;
* the next layer's inputs are the kept full-precision outputs under ``propagate = "fp"``, the algorithm's valid
  final outputs under ``"qdq"``, else a last pass over all batches with the quantizers on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.base import KEEPS_FINAL, KEEPS_FULL_PRECISION

#: Pass kinds, in the order a step runs them.
REFERENCE_STREAM = "reference-stream"  # the layer on the full-precision stream (for algorithms that read it)
SQNR_REFERENCE = "sqnr-reference"  # the layer as it came, quantizers off, on the SQNR sequences
ALGORITHM = "algorithm"  # the algorithm's own passes (inside its hooks)
OBSERVE = "observe"  # the layer with its activation observers collecting (the first in full precision)
SQNR_FULL_PRECISION = "sqnr-full-precision"  # the layer in full precision on the SQNR sequences
SQNR = "sqnr"  # the layer with its quantizers on, on the SQNR sequences
PROPAGATE = "propagate"  # the layer with its quantizers on, on every batch: the next layer's inputs


@dataclass(frozen=True, kw_only=True)
class LayerFacts:
    """What decides a layer's passes, known once its quantizers are inserted (before any pass):

    - ``propagate``: ``"fp"`` or ``"qdq"`` (what the next layer's inputs are);
    - ``changes_weights`` / ``preserves_function``: the algorithm's flags;
    - ``reference_stream``: the algorithm reads the full-precision stream (one more pass, before the step);
    - ``algorithm_passes``: whether the algorithm's hooks run the layer over the data at all;
    - ``algorithm_keeps``: what those passes leave as the layer's outputs (:data:`KEEPS_FULL_PRECISION`,
      :data:`KEEPS_FINAL` or None), and ``algorithm_may_keep_none``: whether they may leave none after all (a
      guard that decides on the data: the passes that would use them then run);
    - ``observer_passes``: the passes the activation quantizers that observe need (0: none observes; quantizers
      whose amax an activation report or the algorithm gives do not);
    - ``set_after_algorithm``: whether any quantizer gets its final state after the algorithm's passes (observed,
      derived or fed activation amax, dynamic inputs, the KV cache, fused experts' stored weights);
    - ``moe``: the layer holds MoE blocks (a pass counts their routing).
    """

    propagate: str
    changes_weights: bool = False
    preserves_function: bool = False
    reference_stream: bool = False
    algorithm_passes: bool = False
    algorithm_keeps: str | None = None
    algorithm_may_keep_none: bool = False
    observer_passes: int = 0
    set_after_algorithm: bool = False
    moe: bool = False


@dataclass(frozen=True, kw_only=True)
class LayerPass:
    """One pass: ``kind``; over ``rows`` (``"all"`` batches or the ``"sqnr"`` sequences); with the quantizers
    ``"off"``, ``"observing"`` or ``"on"``; ``keeps``: its outputs are kept (the next inputs, or the SQNR's side);
    ``unless_kept``: it runs only when the algorithm's passes left no outputs (see ``algorithm_may_keep_none``)."""

    kind: str
    rows: str
    quantizers: str
    keeps: bool = False
    unless_kept: bool = False


@dataclass(frozen=True, kw_only=True)
class PassPlan:
    """A layer's passes, in order, and where the next layer's inputs come from (``next_inputs``: the kind of the pass
    whose outputs they are). ``algorithm_outputs_valid``: the outputs the algorithm's passes leave are kept."""

    passes: tuple[LayerPass, ...]
    next_inputs: str
    algorithm_outputs_valid: bool = False

    def count(self, kind: str) -> int:
        """How many passes of ``kind`` run."""
        return sum(p.kind == kind for p in self.passes)

    @property
    def sqnr_reference_first(self) -> bool:
        """The SQNR's full-precision side is computed before the algorithm runs."""
        return self.count(SQNR_REFERENCE) > 0

    @property
    def observing(self) -> int:
        """Observing passes over every batch."""
        return self.count(OBSERVE)

    @property
    def full_precision_side(self) -> str:
        """The kind of pass whose outputs the SQNR compares the quantized layer with."""
        for kind in (SQNR_REFERENCE, OBSERVE, SQNR_FULL_PRECISION):
            if self.count(kind):
                return kind
        return ALGORITHM

    def runs_quantized(self, sqnr_rows: bool) -> bool:
        """Whether a pass runs the layer with its quantizers on: a propagate pass, or the SQNR's quantized side when
        there are SQNR sequences (``sqnr_rows``: this rank holds some)."""
        return any(p.kind == PROPAGATE or (p.kind == SQNR and sqnr_rows) for p in self.passes)

    @property
    def data_passes(self) -> int:
        """Passes over every batch the runner makes itself (the algorithm's own are its business)."""
        return sum(p.rows == "all" and p.kind != ALGORITHM for p in self.passes)

    def describe(self) -> str:
        """``sqnr-reference, algorithm, observe x2, sqnr, propagate -> next inputs: propagate``: for messages."""
        names: list[str] = []
        for p in self.passes:
            if names and names[-1].split(" x")[0] == p.kind:
                head, _, times = names[-1].partition(" x")
                names[-1] = f"{head} x{int(times or 1) + 1}"
            else:
                names.append(p.kind)
        return f"{', '.join(names)} -> next inputs: {self.next_inputs}"


def plan_layer_passes(facts: LayerFacts) -> PassPlan:
    """The passes a layer with ``facts`` runs, in order (see the module docstring for the rules)."""
    if facts.propagate not in ("fp", "qdq"):
        raise ValueError(f"propagate must be 'fp' or 'qdq', got {facts.propagate!r}")
    if facts.algorithm_keeps not in (None, KEEPS_FULL_PRECISION, KEEPS_FINAL):
        raise ValueError(f"algorithm_keeps must be None, {KEEPS_FULL_PRECISION!r} or {KEEPS_FINAL!r}")
    qdq = facts.propagate == "qdq"
    passes: list[LayerPass] = []
    if facts.reference_stream:
        passes.append(LayerPass(kind=REFERENCE_STREAM, rows="all", quantizers="off", keeps=True))
    reference_first = facts.changes_weights and not facts.preserves_function
    if reference_first:
        passes.append(LayerPass(kind=SQNR_REFERENCE, rows="sqnr", quantizers="off", keeps=True))
    if facts.algorithm_passes:
        passes.append(LayerPass(kind=ALGORITHM, rows="all", quantizers="off", keeps=facts.algorithm_keeps is not None))
    valid = (facts.algorithm_keeps == KEEPS_FULL_PRECISION and facts.preserves_function) or (
        facts.algorithm_keeps == KEEPS_FINAL and qdq and not facts.set_after_algorithm
    )
    surely = valid and not facts.algorithm_may_keep_none  # valid outputs the passes below can count on
    observing = _observing_passes(facts, kept=surely)
    for n in range(observing):
        passes.append(LayerPass(kind=OBSERVE, rows="all", quantizers="observing", keeps=n == 0))
    if not reference_first and observing == 0 and not surely:
        passes.append(LayerPass(kind=SQNR_FULL_PRECISION, rows="sqnr", quantizers="off", keeps=True, unless_kept=valid))
    passes.append(LayerPass(kind=SQNR, rows="sqnr", quantizers="on"))
    source = OBSERVE if observing else ALGORITHM if valid else None  # OBSERVE: its first pass's full-precision outputs
    final = source == ALGORITHM and facts.algorithm_keeps == KEEPS_FINAL
    if source is None or (qdq and not final):
        passes.append(LayerPass(kind=PROPAGATE, rows="all", quantizers="on", keeps=True))
        source = PROPAGATE
    elif source == ALGORITHM and facts.algorithm_may_keep_none:
        passes.append(LayerPass(kind=PROPAGATE, rows="all", quantizers="on", keeps=True, unless_kept=True))
    return PassPlan(passes=tuple(passes), next_inputs=source, algorithm_outputs_valid=valid)


def _observing_passes(facts: LayerFacts, kept: bool) -> int:
    """The observing passes: those the observers need; with none, one when the next inputs are full-precision
    outputs nobody kept; an MoE layer one to count its routing unless it propagates quantized outputs with
    nothing to observe."""
    if facts.moe:
        return max(facts.observer_passes, 1) if facts.observer_passes or facts.propagate != "qdq" else 0
    if facts.observer_passes or not (facts.propagate == "qdq" or kept):
        return max(facts.observer_passes, 1)
    return 0
