"""One result kept per purpose for the tensor it was computed from: the q / k / v (gate / up) projections of a
decoder layer read one input tensor, and their input quantizers, with one spec and one range, compute the same
fake quantization (and their observers the same amax) three times over. A :class:`LastResult` keeps the last
result with a weak reference to its input and the key it was computed under; the same tensor, unchanged since
(its ``_version``), under an equal key gets the kept result back, as long as nobody changed that result in place.
The entry goes when its input is freed: the weak reference's callback is the keeping dict's own ``pop`` (C code), so
no Python code runs then and a Ctrl-C cannot land inside a callback, where Python would drop it with a traceback.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


class LastResult:
    """The last ``(input, key) -> result`` of one computation (see the module docstring). Keys are sequences of
    plain values and small tensors (compared by value; a tensor key is copied when kept)."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = 0
        self._key: tuple[Any, ...] = ()
        self._kept: dict[weakref.ref, torch.Tensor] = {}  # at most one entry: the result for ``self._ref``
        self._result_version = 0

    def get(self, x: torch.Tensor, key: Sequence[Any]) -> torch.Tensor | None:
        """The kept result for ``x`` under ``key``, or None."""
        ref = self._ref
        result = self._kept.get(ref) if ref is not None else None
        if result is None or ref() is not x or x._version != self._version:
            return None
        if result._version != self._result_version or len(key) != len(self._key):
            return None
        return result if all(_same(a, b) for a, b in zip(key, self._key)) else None

    def put(self, x: torch.Tensor, key: Sequence[Any], result: torch.Tensor) -> None:
        """Keep ``result`` as computed from ``x`` under ``key`` (replacing the previous entry)."""
        self._kept.clear()
        # the previous reference goes with its entry (so its callback can no longer fire); this one's callback
        # removes this entry when x is freed
        self._ref = weakref.ref(x, self._kept.pop)
        self._kept[self._ref] = result
        self._version = x._version
        self._key = tuple(k.detach().clone() if isinstance(k, torch.Tensor) else k for k in key)
        self._result_version = result._version


def reusable(x: torch.Tensor) -> bool:
    """Whether a result computed from ``x`` may be kept: not a parameter (a weight is quantized once per call of
    its own module), and not under autograd."""
    return not isinstance(x, torch.nn.Parameter) and not (torch.is_grad_enabled() and x.requires_grad)
