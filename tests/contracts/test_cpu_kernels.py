"""The AVX2 leg of CI (`make test-avx2`) really runs AVX2 kernels: a capability cap that torch ignored would let the
numerically sensitive tests pass on this machine's own kernels only (docs/design/testing.md)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.numerics


def test_a_forced_kernel_capability_is_the_one_torch_runs():
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced is None:
        pytest.skip("no ATEN_CPU_CAPABILITY set: torch picks the machine's best kernels")
    assert torch.backends.cpu.get_cpu_capability() == forced.upper()
