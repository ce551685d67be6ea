"""Hadamard rotations against hand-written matrices and the defining properties."""

import pytest
import torch

from shardcal.quant.hadamard import (
    block_hadamard,
    hadamard_matrix,
    largest_power_of_two_block,
    random_signs,
    rotate_last_dim,
)


def test_hadamard_of_four_is_the_written_matrix():
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    assert torch.equal(hadamard_matrix(4), expected)


@pytest.mark.parametrize("n", [1, 2, 16, 64, 256])
def test_hadamard_is_orthonormal_with_equal_magnitudes(n):
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_non_power_of_two_sizes_use_blocks():
    assert largest_power_of_two_block(576) == 64
    assert largest_power_of_two_block(640) == 128
    assert largest_power_of_two_block(576, limit=16) == 16
    q = block_hadamard(576)
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q[:64, :64], hadamard_matrix(64))
    assert torch.count_nonzero(q[:64, 64:]) == 0
    with pytest.raises(ValueError, match="power-of-two size, got 576"):
        hadamard_matrix(576)
    with pytest.raises(ValueError, match="dividing the size 576"):
        block_hadamard(576, block=128)


def test_randomized_hadamard_is_seeded_and_orthonormal():
    a, b, c = block_hadamard(128, seed=7), block_hadamard(128, seed=7), block_hadamard(128, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a @ a.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    signs = random_signs(128, 7)
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(a, signs[:, None] * hadamard_matrix(128))


def test_rotation_spreads_an_outlier_channel_and_preserves_norms():
    x = torch.zeros(3, 64)
    x[:, 5] = 100.0
    y = rotate_last_dim(x, hadamard_matrix(64))
    assert torch.allclose(y.abs(), torch.full_like(y, 100.0 / 8))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    with pytest.raises(ValueError, match="last dimension of 64"):
        rotate_last_dim(x, hadamard_matrix(32))


@pytest.mark.parametrize("block", [2, 16, 64])
def test_fast_transform_equals_compressed_tensors_hadamard_blocks(block):
    """``hadamard_blocks`` is ``x`` times the block diagonal of compressed-tensors' deterministic Hadamard matrix
    (divided by sqrt(block), as its transforms do), and undoes itself."""
    ct_hadamard = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    from shardcal.quant.hadamard import hadamard_blocks

    h = ct_hadamard.deterministic_hadamard_matrix(block, torch.float64, torch.device("cpu")) / block**0.5
    x = torch.randn(3, 5, 4 * block, dtype=torch.float64, generator=torch.Generator().manual_seed(block))
    expected = x @ torch.block_diag(*[h] * 4)
    assert torch.allclose(hadamard_blocks(x, block), expected, atol=1e-12)
    assert torch.allclose(hadamard_blocks(hadamard_blocks(x, block), block), x, atol=1e-12)


def test_fast_transform_rows_do_not_depend_on_the_other_rows():
    """Row by row, a slice of rows, or all rows at once: the same bits (FSDP2 shards a weight's rows)."""
    from shardcal.quant.hadamard import hadamard_blocks

    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0))
    whole = hadamard_blocks(x, 128)
    assert torch.equal(torch.cat([hadamard_blocks(x[i : i + 1], 128) for i in range(7)]), whole)
    assert torch.equal(hadamard_blocks(x[3:], 128), whole[3:])


def test_fast_transform_refuses_blocks_that_do_not_fit():
    from shardcal.quant.hadamard import hadamard_blocks

    with pytest.raises(ValueError, match="rotation block 48 must be a power of two dividing"):
        hadamard_blocks(torch.zeros(2, 96), 48)
    with pytest.raises(ValueError, match="dividing the last dimension 96"):
        hadamard_blocks(torch.zeros(2, 96), 64)


@pytest.mark.parametrize("block", [2, 8, 32, 128, 512])
def test_factored_product_equals_the_block_diagonal_matrix(block):
    """``hadamard_blocks_by_factors`` (two small products, what rotates activations) is ``x`` times the dense block
    diagonal of orthonormal Sylvester blocks, in float64 and in float32, for any leading shape."""
    from shardcal.quant.hadamard import hadamard_blocks_by_factors

    x = torch.randn(2, 3, 3 * block, dtype=torch.float64, generator=torch.Generator().manual_seed(block))
    expected = x @ torch.block_diag(*[hadamard_matrix(block)] * 3)
    assert torch.allclose(hadamard_blocks_by_factors(x, block), expected, atol=1e-12)
    got32 = hadamard_blocks_by_factors(x.float(), block)
    assert got32.dtype == torch.float32 and got32.shape == x.shape
    assert torch.allclose(got32.double(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="dividing the last dimension"):
        hadamard_blocks_by_factors(torch.zeros(2, 3 * block + 1), block)


def test_linears_sharing_an_input_rotate_it_once():
    """q / k / v read one tensor: its rotation is computed once and given to each (and again for a changed tensor)."""
    from shardcal.quant.linear import QuantLinear, rotate_inputs, rotated_input

    a, b = (QuantLinear.from_linear(torch.nn.Linear(64, 8)) for _ in range(2))
    rotate_inputs(a, 32)
    rotate_inputs(b, 32)
    x = torch.randn(5, 64)
    first = rotated_input(a, x)
    assert rotated_input(b, x) is first
    assert torch.allclose(first, x @ torch.block_diag(*[hadamard_matrix(32).float()] * 2), atol=1e-6)
    x.mul_(2.0)  # changed in place: computed again
    assert torch.allclose(rotated_input(b, x), 2.0 * first, atol=1e-6)
