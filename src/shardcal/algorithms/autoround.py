"""AutoRound: each weight's rounding and clipping tuned by signed gradient descent on the decoder layer's output
(SignRound, Cheng et al., 2023: arXiv 2309.05516).

Per gathered decoder layer, for every QuantLinear with an integer weight quantizer (int4 / int8, symmetric or
asymmetric, per channel or per group):

* the parameters: a rounding offset ``V`` per weight element in ``[-0.5, 0.5]`` (start 0: round to nearest) and,
  with ``clip``, a factor per scale in ``[min_clip, 1]`` on the calibrated amax (and one on the amin, asymmetric;
  start 1: the recipe observer's range);
* the weight the layer computes with: ``clamp(round(W / s + V), lo, hi) * s``, ``s`` from the clipped range, rounding
  through a straight-through estimator;
* the loss: the squared error of the layer's output against a target (real tokens only, every other quantizer off),
  one forward and backward of the whole layer per batch: with ``target = "layer"`` the layer's own full-precision
  output on the same cached inputs; with ``target = "fp"`` the full-precision model's output of this layer (its
  output on the full-precision stream, which the runner then carries beside the quantized one, as auto-round does),
  so that each layer also makes up for the error of the layers quantized before it;
* the step: ``iters`` steps of ``p -= lr_t * sign(grad)`` with ``lr_t`` decaying linearly from ``lr`` (default
  ``1 / iters``) to 0, each on ``batches_per_iter`` batches drawn without replacement from a seeded permutation of
  the run's global batch numbers (epoch after epoch);
* the guard (``guard``): the tuned parameters are kept only if their error summed over every batch the layer was
  tuned on is below the starting parameters' (two forwards per batch, no backward, through the layer's own forward
  with the weights written in); otherwise the layer keeps its start, so no layer ends worse than round to nearest
  on its tuning data. The second pass runs the layer as it is left: with the tuned parameters kept, its outputs are
  handed over as the next layer's inputs (:meth:`LayerStep.keep_final_outputs`), a pass the runner then saves.

Exact across ranks: each drawn batch's gradient is computed by the rank that holds it (the same shapes at every
world size), scaled by a power of two common to all ranks (from the all-reduced maximum) and rounded to an
integer-valued float64 (:data:`FIXED_BITS` bits), so the all-reduced sum — and its sign — is the same bits at any
world size and in any order (each step's loss and the guard's sums too, so every rank makes the same choice). Every
rank applies the same update, so weights and scales stay identical without a
broadcast. The result is the quantizer's own fake quantization of the tuned weight with the tuned amax (export keeps
the recipe's layout); the runner writes the weights back into the shards and checkpoints them (resumable like GPTQ).

Recipe: ``[algorithm] name = "autoround"``, ``iters`` (64), ``lr`` (0: ``1 / iters``), ``batches_per_iter`` (1),
``clip`` (true), ``min_clip`` (0.5), ``seed`` (0), ``target`` ("layer"), ``guard`` (true), ``propagate`` ("qdq").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import RecipeError
from ..layerwise.options import PROPAGATE_MODES
from ..layerwise.steps import LayerStep
from ..quant.formats import FORMATS, qparams
from ..quant.linear import QuantLinear
from ..quant.quantizer import QuantMode, TensorQuantizer
from ..quant.session import quantizer_mode, quantizers_in_mode
from ..runtime.distributed import all_reduce_, all_reduce_many_
from ..runtime.params import boolean, integer, number, one_of
from .base import KEEPS_FINAL, AlgorithmStep, LayerAlgorithm
from .memory import AlgorithmMemory, LayerPlanContext

#: Bits of the fixed-point gradient: the largest |gradient| of a tensor becomes about 2**FIXED_BITS, so sums of up
#: to 2**(52 - FIXED_BITS) batches stay exact integers in float64.
FIXED_BITS = 40
#: Bytes per weight element while a layer is tuned (measured): the float32 weight copy, V, the clip factors' share,
#: the tuned weight and its autograd temporaries, V's gradient, the float64 fixed-point gradient and its sum.
TUNE_BYTES_PER_WEIGHT = 44


class _RoundSTE(torch.autograd.Function):
    """``round(x)`` forward, the identity backward (the straight-through estimator) in one operation each way: the
    same values as ``x + (round(x) - x).detach()`` (both subtraction and sum are exact), without its temporaries."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` forward, the identity backward (the straight-through estimator)."""
    return _RoundSTE.apply(x)


class _TunedWeight:
    """One Linear's tuned parameters and the weight they give (differentiable, and final)."""

    def __init__(self, name: str, module: QuantLinear, clip: bool):
        q = module.weight_quantizer
        self.name, self.module, self.quantizer = name, module, q
        self.weight = module.weight.detach().to(torch.float32, copy=True)  # finish() overwrites the Linear's
        self.layout, self.fmt = q.layout, q.spec.format
        self.amax = q.amax.detach().float().to(self.weight.device, copy=True)
        self.amin = None if q.amin is None else q.amin.detach().float().to(self.weight.device, copy=True)
        self.v = torch.zeros_like(self.weight, requires_grad=True)
        self.params = [self.v]
        self.hi = self.lo = None
        if clip:
            self.hi = torch.ones_like(self.amax, requires_grad=True)
            self.params.append(self.hi)
            if self.amin is not None:
                self.lo = torch.ones_like(self.amin, requires_grad=True)
                self.params.append(self.lo)

    def _range(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        amax = self.amax if self.hi is None else self.amax * self.hi
        if self.amin is None:
            return amax, None
        return amax, self.amin if self.lo is None else self.amin * self.lo

    def quantized(self) -> torch.Tensor:
        """The fake-quantized weight under the current parameters, differentiable in them."""
        f, lay = FORMATS[self.fmt], self.layout
        amax, amin = self._range()
        a, v = lay.arrange(self.weight), lay.arrange(self.v)
        if amin is None:
            scale = torch.clamp(lay.broadcast(amax), min=torch.finfo(torch.float32).tiny) / f.qmax
            codes = torch.clamp(_round_ste(a / scale + v), f.qmin, f.qmax)
        else:
            hi, lo = torch.clamp(lay.broadcast(amax), min=0.0), torch.clamp(lay.broadcast(amin), max=0.0)
            scale = torch.clamp((hi - lo) / (f.qmax - f.qmin), min=torch.finfo(torch.float32).tiny)
            zp = torch.clamp(f.qmin - _round_ste(lo / scale), f.qmin, f.qmax)
            codes = torch.clamp(_round_ste(a / scale + v), f.qmin - zp, f.qmax - zp)
        return lay.restore(codes * scale)

    @torch.no_grad()
    def finish(self) -> None:
        """Store the tuned amax in the quantizer and the tuned weight in the Linear: exactly what the quantizer's
        fake quantization of it gives (the scales come from the stored amax, as in ``formats.fake_quantize``)."""
        amax, amin = self._range()
        q = self.quantizer
        q.set_amax(amax.to(q.amax.device), None if amin is None else amin.to(q.amax.device))
        f, lay = FORMATS[self.fmt], self.layout
        amin_b = None if q.amin is None else lay.broadcast(q.amin.float().to(self.weight.device))
        scale, zp = qparams(lay.broadcast(q.amax.float().to(self.weight.device)), amin_b, self.fmt)
        a, v = lay.arrange(self.weight), lay.arrange(self.v.detach())
        lo, hi = (f.qmin, f.qmax) if zp is None else (f.qmin - zp, f.qmax - zp)
        codes = torch.clamp(torch.round(a / scale + v), lo, hi)
        self.module.weight.copy_(lay.restore(codes * scale).to(self.module.weight.dtype))

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the starting parameters: round to nearest in the recipe observer's range."""
        self.v.zero_()
        for p in self.params[1:]:
            p.fill_(1.0)

    @torch.no_grad()
    def step(self, signs: list[torch.Tensor], lr: float, min_clip: float) -> None:
        for p, s in zip(self.params, signs):
            p.sub_(s.to(device=p.device, dtype=p.dtype), alpha=lr)
        self.v.clamp_(-0.5, 0.5)
        for p in self.params[1:]:
            p.clamp_(min_clip, 1.0)


def check_quantizer(q: TensorQuantizer, name: str) -> None:
    """AutoRound tunes static integer weight quantizers that were calibrated (per tensor, channel or group)."""
    if FORMATS[q.spec.format].kind != "int":
        raise RecipeError(f"{name}: autoround supports int4 and int8 weights, not {q.spec.format!r}")
    if q.spec.dynamic or not q.calibrated or q.amax is None:
        raise RecipeError(f"{name}: autoround needs a calibrated static weight quantizer")


def batch_schedule(num_batches: int, iters: int, per_iter: int, seed: int, layer: int) -> list[list[int]]:
    """The global batch numbers each step uses: a seeded permutation of all batches, drawn ``per_iter`` at a time,
    a new permutation each epoch; the same at every world size."""
    if num_batches == 0:
        return [[] for _ in range(iters)]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    order: list[int] = []
    out = []
    for _ in range(iters):
        chosen = []
        for _ in range(min(per_iter, num_batches)):
            if not order:
                order = torch.randperm(num_batches, generator=gen).tolist()
            chosen.append(order.pop(0))
        out.append(chosen)
    return out


def _fixed_point_sum(per_batch: list[list[torch.Tensor]], shapes: list[torch.Size], group: Any) -> list[torch.Tensor]:
    """The sum over every rank's batches of each gradient (float64), exact to ``2**-FIXED_BITS`` of its largest
    term and the same bits in any order: each term is scaled by a power of two common to all ranks (from the
    all-reduced maximum) and rounded to an integer before summing (collective: two all-reduces, also for a rank
    with no batch)."""
    maxima = torch.zeros(len(shapes), dtype=torch.float64)
    for grads in per_batch:
        for k, g in enumerate(grads):
            maxima[k] = max(float(maxima[k]), float(g.abs().max()))
    all_reduce_(maxima, "max", group)
    sums = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    exponents = [_fixed_point_exponent(top) for top in maxima.tolist()]
    for k, exponent in enumerate(exponents):
        scale = torch.tensor(exponent, dtype=torch.int32)  # the largest term becomes < 2**FIXED_BITS
        for grads in per_batch:
            sums[k] += torch.ldexp(grads[k].double().cpu(), scale).round_()
    all_reduce_many_(sums, "sum", group, dtype=torch.float64)
    return [torch.ldexp(s, torch.tensor(-e, dtype=torch.int32)) for s, e in zip(sums, exponents)]


def _fixed_point_exponent(top: float) -> int:
    """The power of two that scales terms whose largest magnitude is ``top`` to just under ``2**FIXED_BITS`` (0 for
    a zero or non-finite ``top``)."""
    return 0 if top == 0.0 or not math.isfinite(top) else FIXED_BITS - math.frexp(top)[1]


def _fixed_point_signs(gradient: torch.Tensor) -> torch.Tensor:
    """The signs of ``gradient`` in :func:`_fixed_point_sum`'s units for one term (0 where it rounds to 0), computed
    in the gradient's own dtype: scaling by a power of two and rounding are exact there too."""
    low, high = torch.aminmax(gradient)
    exponent = _fixed_point_exponent(max(-float(low), float(high)))
    return torch.sign(gradient.mul(2.0**exponent).round_())


def _one_batch_signs(
    per_batch: list[list[torch.Tensor]], shapes: list[torch.Size], group: Any
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A step on one batch: the signs of its gradients as :func:`_fixed_point_sum` would give them and its loss,
    computed by the rank holding the batch and summed with the other ranks' zeros (exact: one all-reduce of signs,
    one of the loss; ``per_batch`` has the batch's ``[*gradients, loss]`` or is empty)."""
    if per_batch:
        *grads, err = per_batch[0]
        signs = [_fixed_point_signs(g.float()) for g in grads]
        loss = err.double().cpu()
    else:
        signs = [torch.zeros(s) for s in shapes]
        loss = torch.zeros(1, dtype=torch.float64)
    all_reduce_many_(signs, "sum", group, dtype=torch.float32)
    all_reduce_(loss, "sum", group)
    return signs, loss


class AutoRound(LayerAlgorithm):
    """See the module docstring."""

    name = "autoround"
    schema = {
        "iters": (64, integer(1)),
        "lr": (0.0, number(0.0, 1.0)),
        "batches_per_iter": (1, integer(1)),
        "clip": (True, boolean),
        "min_clip": (0.5, number(0.0, 1.0, lo_open=True)),
        "seed": (0, integer(0)),
        "target": ("layer", one_of("layer", "fp")),
        "guard": (True, boolean),
        "propagate": ("qdq", one_of(*PROPAGATE_MODES)),
    }
    changes_weights = True
    default_propagate = "qdq"

    def __init__(self, params: Mapping[str, Any] | None = None):
        super().__init__(params)
        self._losses: dict[str, dict[str, float]] = {}

    @property
    def reference_stream(self) -> bool:
        """``target = "fp"`` reads the full-precision stream's outputs."""
        return self.params["target"] == "fp"

    @classmethod
    def planned_memory(cls, context: LayerPlanContext, params: Mapping[str, Any]) -> AlgorithmMemory:
        """The full-precision outputs of this rank's batches (the targets, one more activation cache), the tuned
        state of every quantized weight of the layer (:data:`TUNE_BYTES_PER_WEIGHT` per element), and the
        autograd graph of ``batches_per_iter`` batches' forward (the saved activations: about three times a
        forward's largest intermediates)."""
        weights = sum(lin.in_features * lin.out_features for lin in context.linears if lin.weight is not None)
        if not weights:
            return AlgorithmMemory(cls.name)
        targets = context.local_tokens * context.hidden_size * 4
        graph = 3 * params.get("batches_per_iter", 1) * context.batch_forward
        return AlgorithmMemory(cls.name, solve=targets + TUNE_BYTES_PER_WEIGHT * weights + graph)

    def plan_step(self, step: LayerStep, recipe: Any) -> AlgorithmStep:
        """Its tuning steps over the data, when the layer has a quantized weight; with ``guard``, the guard's last pass
        leaves the layer's final outputs — unless the tuning made the layer worse and the start is kept."""
        if not self._linears(step):
            return AlgorithmStep()
        guard = bool(self.params["guard"])
        return AlgorithmStep(passes=True, keeps=KEEPS_FINAL if guard else None, may_keep_none=guard)

    @staticmethod
    def _linears(step: LayerStep) -> list[tuple[str, QuantLinear]]:
        return [
            (n, m)
            for n, m in step.layer.named_modules(prefix=step.name)
            if isinstance(m, QuantLinear) and m.weight_quantizer is not None
        ]

    def after_weight_calibration(self, step: LayerStep, recipe: Any, group: Any) -> None:
        linears = self._linears(step)
        for n, m in linears:
            check_quantizer(m.weight_quantizer, n)
        tuned = [_TunedWeight(n, m, self.params["clip"]) for n, m in linears]
        if not tuned:
            return
        names = _parameter_names(step, tuned)
        count = torch.tensor([float(len(step.inputs))], dtype=torch.float64)
        all_reduce_(count, "sum", group)
        iters, per_iter = self.params["iters"], self.params["batches_per_iter"]
        lr = self.params["lr"] or 1.0 / iters
        schedule = batch_schedule(int(count), iters, per_iter, self.params["seed"], step.index)
        local = {number: i for i, number in enumerate(step.batch_numbers or range(len(step.inputs)))}
        params = [p for t in tuned for p in t.params]
        shapes = [p.shape for p in params]
        losses: list[float] = []
        one = torch.Size([1])
        with quantizer_mode(step.layer, QuantMode.DISABLED):
            wanted = sorted({local[b] for chosen in schedule for b in chosen if b in local})
            if self.reference_stream:
                targets = {i: step.reference_outputs[i] for i in wanted}
            else:
                targets = {i: step.forward(i).to(step.cache_device) for i in wanted}
            start, _ = (
                _guard_pass(step, tuned, targets, wanted, keep_outputs=False) if self.params["guard"] else ({}, None)
            )
            for t, chosen in enumerate(schedule):
                per_batch = []
                for i in (local[b] for b in chosen if b in local):
                    out = step.forward_with(i, {names[k]: w.quantized() for k, w in enumerate(tuned)})
                    err = _masked_error(out, targets[i].to(out.device), step.inputs[i].token_mask)
                    per_batch.append([*torch.autograd.grad(err, params), err.detach().reshape(1)])
                if len(chosen) == 1:
                    signs, loss = _one_batch_signs(per_batch, shapes, group)
                else:
                    *sums, loss = _fixed_point_sum(per_batch, [*shapes, one], group)
                    signs = [torch.sign(s) for s in sums]
                losses.append(float(loss))
                rate = lr * (1.0 - t / iters)
                offset = 0
                for w in tuned:
                    w.step(signs[offset : offset + len(w.params)], rate, self.params["min_clip"])
                    offset += len(w.params)
            self._losses[step.name] = {"first": losses[0], "last": losses[-1]}
            outputs = None
            if self.params["guard"]:
                final, outputs = _guard_pass(step, tuned, targets, wanted, keep_outputs=True)
                before, after = _fixed_point_sum([[start[i], final[i]] for i in wanted], [one, one], group)
                ratio = float(after) / float(before) if float(before) > 0 else 1.0
                self._losses[step.name]["tuned_ratio"] = ratio
                if ratio >= 1.0:  # tuning made the layer worse on its own data: keep the start
                    for w in tuned:
                        w.reset()
                    outputs = None
        for w in tuned:
            w.finish()
        if outputs is not None:  # the guard's pass ran the layer as it is left: the runner need not run it again
            step.keep_final_outputs(outputs)

    def layer_report(self, step: Any) -> dict[str, Any]:
        """The summed squared output error of the first and the last step's batches (before each step's update),
        and with ``guard`` ``tuned_ratio``: the tuned parameters' error over the starting ones' on every batch the
        layer was tuned on (at or above 1: the start was kept)."""
        if step.name not in self._losses:
            return {}
        return {"autoround_loss": dict(self._losses[step.name])}


def _parameter_names(step: LayerStep, tuned: list[_TunedWeight]) -> list[str]:
    """Each tuned Linear's weight name relative to the layer (what ``step.forward_with`` replaces)."""
    prefix = f"{step.name}."
    return [f"{t.name[len(prefix) :]}.weight" if t.name.startswith(prefix) else "weight" for t in tuned]


def _guard_pass(
    step: LayerStep, tuned: list[_TunedWeight], targets: dict[int, torch.Tensor], wanted: list[int], keep_outputs: bool
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor] | None]:
    """Each wanted batch's error (shape [1], float32) under the current parameters, through the layer's own forward
    with the weights they give written in (:meth:`_TunedWeight.finish`) and only its weight quantizers on — the
    function the layer computes when it is left so — and with ``keep_outputs`` every cached batch's output."""
    for w in tuned:
        w.finish()
    errors, outputs = {}, []
    with quantizers_in_mode([w.quantizer for w in tuned], QuantMode.QUANTIZE):
        for i in range(len(step.inputs)) if keep_outputs else wanted:
            got = step.forward(i)
            if i in targets:
                errors[i] = _masked_error(got, targets[i].to(got.device), step.inputs[i].token_mask).reshape(1)
            if keep_outputs:
                outputs.append(got.to(step.cache_device))
    return errors, outputs if keep_outputs else None


def _masked_error(out: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The summed squared error over real tokens (float32; ``mask`` [B, L], None: every position)."""
    diff = (out.float() - target.float()).pow(2)
    if mask is not None:
        diff = diff * mask.to(diff.device, diff.dtype).unsqueeze(-1)
    return diff.sum()
