"""Granularity: which elements share one amax (and so one scale), resolved against a tensor's shape.

A :class:`Layout` is a spec's granularity applied to an *observed shape*: the full shape of a weight
(``(out, in)``), or the trailing shape an activation always has (``(in_features,)``; leading batch/token dims
vary). It fixes the shape of the calibrated amax, which is also the shape of the exported scale:

============  ===========================  =====================================================
granularity   amax shape (weight [o, i])   amax shape (activation [..., h])
============  ===========================  =====================================================
tensor        ``[1]``                      ``[1]``
channel       ``[o, 1]`` (axis 0)          ``[h]`` (axis -1)
group (g)     ``[o, i / g]``               ``[h / g]`` (one amax per group, over all tokens);
                                           dynamic: ``[..., h / g, 1]``, per token, at run time
token         —                            ``[..., 1]``: one per token, taken at run time (dynamic)
block (r, c)  ``[ceil(o / r), ceil(i / c)]``  —
============  ===========================  =====================================================

``arrange`` reshapes a tensor so that the amax broadcasts against it (group: the last dim is split into
``[n_groups, g]``); ``reduce`` folds a per-element statistic of an arranged tensor down to the amax shape, so
observers accumulate exactly what the quantizer will use. nvfp4 calibrates one amax per tensor (its global scale);
its 16-element blocks are handled inside the format. A block layout arranges a weight ``[..., o, i]`` as
``[..., ceil(o / r), r, ceil(i / c), c]``, zero-padded where ``o`` or ``i`` is not a multiple (a zero changes no block's
amax and quantizes to zero exactly; ``restore`` drops the padding), as compressed-tensors pads FP8 block weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .reuse import LastResult, reusable
from .spec import QuantizerSpec

_LAST_AMAX = LastResult()  # the last amax_of, for the next observer of the same tensor


def _sum64(t: torch.Tensor, dim: tuple[int, ...], keepdim: bool = False) -> torch.Tensor:
    """Sums accumulate in float64 (error sums merged across ranks then pick the same candidate). ``double()``
    first is what ``torch.sum(dtype=torch.float64)`` does on a CPU tensor, and faster spelled out."""
    return t.double().sum(dim=dim, keepdim=keepdim)


class Layout:
    """``spec``'s calibrated granularity against ``observed_shape`` (see the module docstring).

    ``observed_shape`` may be None for per-tensor granularity; channel and group need the dims they use.
    Raises :class:`ValueError` naming ``name`` when the shape does not fit (a group size that does not divide
    the last dim, an axis out of range).
    """

    def __init__(self, spec: QuantizerSpec, observed_shape: Sequence[int] | None = None, name: str = "tensor"):
        self.spec = spec
        self.name = name
        self.kind = spec.calibrated_granularity
        shape = tuple(int(d) for d in observed_shape) if observed_shape is not None else None
        self.observed_shape = shape
        self.group_size: int | None = None
        self.block: tuple[int, int] | None = None
        if spec.format == "nvfp4" and shape is not None and shape[-1] % spec.group_size:
            raise ValueError(
                f"{name}: nvfp4 blocks of {spec.group_size} do not divide the last dimension {shape[-1]} (shape {list(shape)})"
            )
        if self.kind == "token":  # dynamic only: the amax follows the tensor (``[..., 1]``), nothing is calibrated
            self.amax_shape: tuple[int, ...] = (1,)
            self.bshape: tuple[int, ...] = (1,)
        elif self.kind == "block":
            if shape is None or len(shape) < 2:
                raise ValueError(f"{name}: block granularity needs a weight's shape (at least 2 dims), got {shape}")
            r, c = spec.block_size
            self.block = (r, c)
            self.amax_shape = shape[:-2] + (-(-shape[-2] // r), -(-shape[-1] // c))
            self.bshape = shape[:-2] + (self.amax_shape[-2], 1, self.amax_shape[-1], 1)
        elif self.kind == "tensor":
            self.amax_shape = (1,)
            self.bshape = (1,)
        elif self.kind == "channel":
            if shape is None:
                raise ValueError(f"{name}: per-channel granularity needs the tensor's shape")
            axis = spec.axis
            if not -len(shape) <= axis < len(shape):
                raise ValueError(f"{name}: channel axis {axis} is out of range for shape {list(shape)}")
            axis = axis - len(shape) if axis >= 0 else axis  # counted from the end: leading dims may vary
            self.amax_shape = (shape[axis],) + (1,) * (-axis - 1)
            self.bshape = self.amax_shape
        else:  # group
            if shape is None:
                raise ValueError(f"{name}: per-group granularity needs the tensor's shape")
            g = spec.group_size
            if shape[-1] % g:
                raise ValueError(
                    f"{name}: group_size {g} does not divide the last dimension {shape[-1]} (shape {list(shape)})"
                )
            self.group_size = g
            self.amax_shape = shape[:-1] + (shape[-1] // g,)
            self.bshape = self.amax_shape + (1,)
            if spec.dynamic:  # per token: the amax follows the tensor (``[..., groups, 1]``)
                self.kind = "token_group"
                self.amax_shape, self.bshape = (1,), (1,)

    @property
    def num_slots(self) -> int:
        """How many amax values (scales) there are."""
        return math.prod(self.amax_shape)

    def check(self, x: torch.Tensor) -> None:
        """Raise ValueError naming the quantizer when ``x`` does not have the trailing shape this layout expects."""
        shape = self.observed_shape
        if shape is None or (self.kind == "tensor" and self.spec.format != "nvfp4"):
            return
        if self.kind in ("token", "token_group"):
            ok = x.ndim >= 1 and x.shape[-1] == shape[-1]
        elif self.kind == "block":
            ok = tuple(x.shape[x.ndim - len(shape) :]) == shape
        elif self.kind == "tensor":  # nvfp4: only the block dim matters
            ok = x.ndim >= 1 and x.shape[-1] % self.spec.group_size == 0
        else:
            n = len(self.bshape) - (1 if self.kind == "group" else 0)
            ok = x.ndim >= n and tuple(x.shape[x.ndim - n :]) == shape[len(shape) - n :]
        if not ok:
            raise ValueError(
                f"{self.name}: got a tensor of shape {list(x.shape)}, expected trailing shape {list(shape)}"
            )

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` viewed so that an amax reshaped with :meth:`broadcast` broadcasts against it (a block layout: a
        zero-padded copy where the last two dims are not multiples of the block)."""
        if self.block is not None:
            (r, c), (nr, nc) = self.block, self.amax_shape[-2:]
            pad_rows, pad_cols = nr * r - x.shape[-2], nc * c - x.shape[-1]
            if pad_rows or pad_cols:
                x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
            return x.reshape(x.shape[:-2] + (nr, r, nc, c))
        if self.group_size is None:
            return x
        return x.unflatten(-1, (x.shape[-1] // self.group_size, self.group_size))

    def restore(self, a: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`arrange`."""
        if self.block is not None:
            rows, cols = self.observed_shape[-2:]
            a = a.reshape(a.shape[:-4] + (a.shape[-4] * a.shape[-3], a.shape[-2] * a.shape[-1]))
            return a if a.shape[-2:] == (rows, cols) else a[..., :rows, :cols]
        return a if self.group_size is None else a.flatten(-2)

    def broadcast(self, amax: torch.Tensor) -> torch.Tensor:
        """The amax (of :attr:`amax_shape`) reshaped to broadcast against an arranged tensor (per token: as it is,
        ``[..., 1]`` or ``[..., groups, 1]`` from :meth:`amax_of`)."""
        return amax if self.kind in ("token", "token_group") else amax.reshape(self.bshape)

    def reduce(self, a: torch.Tensor, op: str = "amax") -> torch.Tensor:
        """Fold a per-element statistic of an arranged tensor to :attr:`amax_shape` (``op``: ``amax``, ``amin``, or
        ``sum`` accumulated in float64)."""
        fn: Callable[..., torch.Tensor] = {"amax": torch.amax, "amin": torch.amin}.get(op, _sum64)
        b = self.bshape
        lead = a.ndim - len(b)
        if lead < 0:
            raise ValueError(
                f"{self.name}: a tensor of shape {list(a.shape)} has too few dims for amax shape {list(b)}"
            )
        if lead:
            a = fn(a, dim=tuple(range(lead)))
        dims = tuple(i for i, (s, t) in enumerate(zip(b, a.shape)) if s == 1 and t != 1)
        if dims:
            a = fn(a, dim=dims, keepdim=True)
        elif op == "sum":
            a = a.double()
        return a.reshape(self.amax_shape)

    def slot_index(self, a: torch.Tensor) -> torch.Tensor:
        """For each element of an arranged tensor, the flat index of the amax it belongs to (int64)."""
        idx = torch.arange(self.num_slots, device=a.device, dtype=torch.int64).reshape(self.bshape)
        return idx.expand(a.shape)

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """The exact amax of ``x`` (float32, :attr:`amax_shape`; per token ``[..., 1]``): what a max observer
        records, and the dynamic amax. The q / k / v observers of one input share one computation."""
        key = (self.kind, self.amax_shape, self.group_size)
        keep = reusable(x)
        amax = _LAST_AMAX.get(x, key) if keep else None
        if amax is None:
            amax = self._amax_of(x)
            if keep:
                _LAST_AMAX.put(x, key, amax)
        return amax

    def _amax_of(self, x: torch.Tensor) -> torch.Tensor:
        # A contiguous tensor with no |x| temporary (max |x| is max(max x, -min x)): per tensor in one aminmax
        # pass, per token, channel or group by amax and amin (aminmax along a dim is several times slower; abs_
        # makes an all -0.0 slot's amax +0.0, as |x| does); on a strided view (keys and values after a transpose)
        # or a block layout (padded: a copy anyway) abs then amax.
        x = x.detach()
        one_pass = x.is_contiguous() and x.numel() > 0
        if self.kind == "token" and one_pass:
            return torch.maximum(x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True).neg_()).float()
        if self.kind == "token":
            return x.abs().amax(dim=-1, keepdim=True).float()
        if self.kind == "token_group":
            return self.arrange(x).abs().amax(dim=-1, keepdim=True).float()
        if self.kind == "tensor" and one_pass:
            lo, hi = torch.aminmax(x)
            return torch.maximum(lo.abs(), hi.abs()).reshape(1).float()
        if one_pass and self.block is None:
            a = self.arrange(x)
            # neg, not neg_: with nothing to fold, reduce gives a view of x
            return torch.maximum(self.reduce(a, "amax"), self.reduce(a, "amin").neg()).abs_().float()
        return self.reduce(self.arrange(x).abs(), "amax").float()

    def range_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(max, min)`` of ``x`` per slot (float32, :attr:`amax_shape`), widened to include 0: the range an
        asymmetric max observer records."""
        a = self.arrange(x.detach())
        hi = torch.clamp(self.reduce(a, "amax").float(), min=0.0)
        lo = torch.clamp(-self.reduce(-a, "amax").float(), max=0.0)
        return hi, lo
