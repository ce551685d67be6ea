"""The worker pool itself: ranks answer, a failing rank's traceback reaches the test."""

import pytest
import torch
import torch.distributed as dist

from _dist import run_on_ranks


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")


def test_ranks_answer():
    assert run_on_ranks(1, _sum_of_ranks) == [0.0]
    assert run_on_ranks(2, _sum_of_ranks) == [1.0, 1.0]


def test_failing_rank_reported_and_pool_reusable():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_on_ranks(2, _fail_on_rank_one)
    assert run_on_ranks(2, _sum_of_ranks) == [1.0, 1.0]
