"""``TensorQuantizer``: fake quantization of one tensor (a weight, a layer's input or output), calibrated by an
observer, with its amax kept as a buffer so that a state dict carries it (an asymmetric quantizer: ``amax`` and
``amin``, its range's two ends).

Modes (``quantizer.mode``):

- ``"collect"``: pass-through; the observer records what flows through (in the current calibration pass).
- ``"quantize"``: fake quantization with the calibrated amax (or, for a dynamic spec, the tensor's own amax).
  Asking an uncalibrated quantizer to quantize raises :class:`NotCalibratedError`. A new quantizer starts here,
  so forgetting to calibrate fails loudly instead of silently running unquantized.
- ``"disabled"``: pass-through, nothing recorded.

Calibration protocol (what the runner does; :mod:`shardcal.quant.session` does it for many quantizers at once
with one all-reduce per reduce op)::

    q.start_calibration()                 # reset the observer, mode "collect"
    for p in range(q.num_passes):         # max: 1 pass; percentile, mse: 2 (range, then histogram / scores)
        q.begin_pass(p)
        ...run this rank's data through...
        q.end_pass(group)                 # collective over ``group`` (None: no merge); every rank calls it,
                                          # also one that saw no data
    q.finish_calibration()                # amax buffer set, mode "quantize"

``q.calibrate_from(weight)`` runs all of it on one tensor (weights: each rank holds the full weight, no merge).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
from torch import nn

from ..errors import ShardcalError
from .formats import encode, fake_quantize, scales_from_amax
from .granularity import Layout
from .merge import merge_stats
from .observers import OBSERVERS, Observer, make_observer
from .reuse import LastResult, reusable
from .spec import QuantizerSpec
from .tokens import real_positions


class NotCalibratedError(ShardcalError, RuntimeError):
    """A quantizer was asked to quantize (or export) before it was calibrated."""


class QuantMode(str, Enum):
    COLLECT = "collect"
    QUANTIZE = "quantize"
    DISABLED = "disabled"


_LAST_RESULT = LastResult()  # an activation quantizer's last fake quantization


class TensorQuantizer(nn.Module):
    """Fake-quantizes tensors as ``spec`` says; see the module docstring.

    ``observed_shape``: the full shape of a weight, or the trailing shape of an activation (``(in_features,)``);
    it fixes the amax shape (needed for per-channel and per-group). ``device``: where the amax buffer and the
    observer's statistics live. ``name`` appears in error messages (``quantize_modules`` sets the module path).
    """

    def __init__(
        self,
        spec: QuantizerSpec,
        observed_shape: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        name: str = "quantizer",
    ):
        super().__init__()
        self.spec = spec
        self.name = name
        self.layout = Layout(spec, observed_shape, name)
        self._mode = QuantMode.QUANTIZE
        if spec.dynamic:
            self.register_buffer("amax", None)
        else:
            self.register_buffer(
                "amax", torch.full(self.layout.amax_shape, float("nan"), dtype=torch.float32, device=device)
            )
        #: Asymmetric specs only: the range's lower end per slot (<= 0); ``amax`` is then its upper end.
        self.amin: torch.Tensor | None
        if spec.symmetric:
            self.amin = None
        else:
            self.register_buffer("amin", torch.full_like(self.amax, float("nan")))
        self._calibrated = spec.dynamic
        self._observer: Observer | None = None
        self._pass: int | None = None
        self._passes_done = 0
        #: Elements observed in pass 0 over all merged ranks, set by :meth:`finish_calibration` (None before).
        self.num_observed: int | None = None

    # ------------------------------------------------------------------------------------------- state

    @property
    def mode(self) -> QuantMode:
        return self._mode

    @mode.setter
    def mode(self, value: QuantMode | str) -> None:
        self._mode = QuantMode(value)

    @property
    def calibrated(self) -> bool:
        return self._calibrated

    @property
    def num_passes(self) -> int:
        """Calibration passes over the data this quantizer needs (0 for a dynamic spec)."""
        return 0 if self.spec.dynamic else OBSERVERS[self.spec.observer].num_passes

    def set_amax(self, amax: torch.Tensor, amin: torch.Tensor | None = None) -> None:
        """Set the calibrated amax directly (shape: the layout's amax shape, or anything that reshapes to it); an
        asymmetric quantizer needs ``amin`` too (a symmetric one refuses it)."""
        if self.amax is None:
            raise ValueError(f"{self.name}: a dynamic quantizer has no amax to set")
        if (amin is None) != (self.amin is None):
            need = "needs an amin with its amax" if self.amin is not None else "takes no amin (it is symmetric)"
            kind = "an asymmetric" if self.amin is not None else "a symmetric"
            raise ValueError(f"{self.name}: {kind} quantizer {need}")
        with torch.no_grad():
            self.amax.copy_(torch.as_tensor(amax, dtype=torch.float32).reshape(self.amax.shape))
            if amin is not None:
                self.amin.copy_(torch.as_tensor(amin, dtype=torch.float32).reshape(self.amin.shape))
        self._calibrated = True

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.amax is not None and prefix + "amax" in state_dict:
            ranges = [self.amax] + ([] if self.amin is None else [self.amin])
            self._calibrated = not any(bool(torch.isnan(t).any()) for t in ranges)

    def extra_repr(self) -> str:
        s = self.spec
        gran = (
            s.granularity
            + (f"(axis={s.axis})" if s.axis is not None else "")
            + (f"(group_size={s.group_size})" if s.group_size else "")
        )
        return (
            f"{s.format}, {gran}, observer={s.observer}{', dynamic' if s.dynamic else ''}, "
            f"mode={self._mode.value}, calibrated={self._calibrated}"
        )

    # ------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self._mode
        if mode is QuantMode.DISABLED:
            return x
        if mode is QuantMode.COLLECT:
            if self._pass is not None:
                self.layout.check(x)
                self._observer.observe(real_positions(x), self._pass)  # padding never counts
            return x
        if x.numel() == 0:
            return x
        self.layout.check(x)
        if not self.spec.dynamic:
            self._require_calibrated("quantize")
        key = (self.spec, None, None) if self.spec.dynamic else (self.spec, self.amax, self.amin)
        keep = reusable(x)
        out = _LAST_RESULT.get(x, key) if keep else None
        if out is None:
            amax = self.layout.amax_of(x) if self.spec.dynamic else self.amax
            out = fake_quantize(x, amax, self.spec, self.layout, self.amin)
            if keep:
                _LAST_RESULT.put(x, key, out)
        return out

    def _require_calibrated(self, what: str) -> None:
        if not self._calibrated:
            raise NotCalibratedError(
                f"{self.name}: asked to {what} before it was calibrated "
                "(run calibration, load a state dict with its amax, or set mode 'disabled')"
            )

    # ------------------------------------------------------------------------------------------- calibration

    def start_calibration(self) -> None:
        """Reset the observer and switch to ``collect`` mode, ready for pass 0."""
        self._mode = QuantMode.COLLECT
        self._passes_done = 0
        if self.spec.dynamic:
            self._observer, self._pass = None, None
            return
        self._observer = make_observer(self.spec, self.layout, self.amax.device)
        self._pass = 0

    def begin_pass(self, pass_idx: int) -> None:
        """Start recording pass ``pass_idx``; a pass past this quantizer's ``num_passes`` leaves it idle."""
        if pass_idx >= self.num_passes:
            self._pass = None
            return
        if self._observer is None:
            raise RuntimeError(f"{self.name}: begin_pass before start_calibration")
        if pass_idx != self._passes_done:
            raise RuntimeError(f"{self.name}: begin_pass({pass_idx}) but the next pass is {self._passes_done}")
        self._pass = pass_idx

    def pending_stats(self) -> list[tuple[str, torch.Tensor]]:
        """The statistics of the pass in progress that must be merged across ranks (empty when idle)."""
        return [] if self._pass is None else self._observer.stats(self._pass)

    def complete_pass(self) -> None:
        """Finish the pass in progress once its statistics are merged (see :meth:`end_pass`)."""
        if self._pass is None:
            return
        self._observer.after_merge(self._pass)
        self._passes_done += 1
        self._pass = None

    def end_pass(self, group: Any = None) -> None:
        """Merge this pass's statistics over ``group`` (None: keep them local). Collective when ``group`` is set."""
        merge_stats(self.pending_stats(), group)
        self.complete_pass()

    def finish_calibration(self) -> None:
        """Compute the amax from the merged statistics, store it, and switch to ``quantize`` mode."""
        if not self.spec.dynamic:
            if self._observer is None:
                raise RuntimeError(f"{self.name}: finish_calibration before start_calibration")
            if self._passes_done < self.num_passes:
                raise RuntimeError(
                    f"{self.name}: calibration incomplete ({self._passes_done} of {self.num_passes} passes ended)"
                )
            with torch.no_grad():
                self.amax.copy_(self._observer.compute_amax().to(self.amax.device))
                if self.amin is not None:
                    self.amin.copy_(self._observer.compute_amin().to(self.amin.device))
            self.num_observed = self._observer.num_observed
            self._calibrated = True
        self._observer, self._pass = None, None
        self._mode = QuantMode.QUANTIZE

    def calibrate_from(self, tensor: torch.Tensor, group: Any = None) -> torch.Tensor | None:
        """Run every pass on ``tensor`` (a full weight; a DTensor is gathered first) and return the amax (an
        asymmetric quantizer's amin is in :attr:`amin`)."""
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        self.layout.check(tensor)
        self.start_calibration()
        for p in range(self.num_passes):
            self.begin_pass(p)
            self._observer.observe(tensor, p)
            self.end_pass(group)
        self.finish_calibration()
        return self.amax

    # ------------------------------------------------------------------------------------------- export

    def encode(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The real quantized encoding of ``tensor`` (a weight) with the calibrated amax (see ``formats.encode``)."""
        self._require_calibrated("encode")
        amax = self.layout.amax_of(tensor) if self.spec.dynamic else self.amax
        return encode(tensor, amax, self.spec, self.layout, self.amin)

    def export_scales(self) -> dict[str, torch.Tensor]:
        """Static activation scales for export: ``{"scale"}`` (int/fp8) or ``{"global_scale"}`` (nvfp4)."""
        if self.spec.dynamic:
            return {}
        self._require_calibrated("export its scales")
        return scales_from_amax(self.amax, self.spec)
