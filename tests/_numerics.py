"""Tolerances for comparisons whose two sides compute in different shapes or orders.

Bit-identity is claimed only where both sides run the same kernels on the same shapes in the same order (1 vs 2
ranks of the same batches, a resume). Where the shapes differ — rows padded with another token (an MoE routes the
pad positions to other experts, so each expert's matmul has other rows), rows batched otherwise, other CPU
kernels (AVX2 vs AVX-512) — float32 results differ in their last bits, and a tolerance stands in for equality.

* ``FLOAT_RTOL`` (1e-5, ~80 float32 ulps): a tiny model's two layers reorder a few sums of <= 64 products each.
  Measured: at most 6.3e-7 (5 ulps) over the padding tests, with AVX-512 and with forced AVX2 kernels. A padded
  position that counts moves an amax by the pad token's 300x, far beyond it.
* GPTQ rounds each weight to a code after error feedback, so a last-bit change of its Hessian can move a weight
  that lies near a rounding tie to the neighbouring code, and the changed error fed to the rest of its row can
  push a few more past theirs. Such a flip moves the next layer's inputs, its amax and its SmoothQuant scales by up
  to ~5e-4, and that layer's GPTQ then lands on other codes near its ties. Measured on the padding tests (1, 2
  and 4 threads; AVX-512 and AVX2): at most 1.05 % of a weight's elements off, by at most 1.18 of the coarsest
  step; amax and SQNR within 9e-4. Hence ``ROUNDING_RTOL`` for everything continuous downstream of GPTQ and
  :func:`assert_close_but_for_rounding_flips` for its weights (at most 5 % of elements, two steps each). A
  counted pad position changes the smoothing scales and amax by its 300x, far outside either.
"""

from __future__ import annotations

import torch

FLOAT_RTOL = 1e-5
ROUNDING_RTOL = 2e-3
#: At most this fraction of a rounded tensor's elements may sit a code or two off (1.05 % seen).
MAX_FLIP_FRACTION = 5e-2
MAX_FLIP_STEPS = 2


def assert_close_but_for_rounding_flips(
    actual: torch.Tensor, expected: torch.Tensor, *, qmax: int, rtol: float = ROUNDING_RTOL, msg: str = ""
) -> None:
    """``actual`` equals ``expected`` within ``rtol``, except at most ``MAX_FLIP_FRACTION`` of the elements, each of
    which may differ by ``MAX_FLIP_STEPS`` quantization steps at most (a step is at most ``max |expected| / qmax``,
    the coarsest step of a format whose largest code is ``qmax``)."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs()
    off = diff > rtol * expected.double().abs() + 1e-12
    step = float(expected.abs().max()) / qmax
    assert int(off.sum()) <= MAX_FLIP_FRACTION * expected.numel(), (msg, int(off.sum()), expected.numel())
    assert bool((diff[off] <= MAX_FLIP_STEPS * step).all()), (msg, float(diff.max()), step)
