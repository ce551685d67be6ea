"""Hadamard rotations: orthonormal Hadamard matrices, block-diagonal ones for sizes that are not powers of two,
randomized signs from a seed, and applying them to the last dimension of a tensor block by block (by matrix, by
the fast Walsh-Hadamard transform that folds a recipe's ``[rotation]`` into weights, or by two small matrix
products, which rotate activations on every call).

A rotation ``Q`` here is always orthonormal (``Q @ Q.T = I``), built in float64 and deterministic: the same size,
block and seed give the same bits on every rank and every machine (the signs come from a CPU ``torch.Generator``),
so a rotation folded into sharded weights is the same at any world size. A size that is not a power of two (SmolLM2's
576 = 9 x 64) gets a block-diagonal Hadamard of the largest power-of-two block that divides it.
"""

from __future__ import annotations

import torch


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def largest_power_of_two_block(n: int, limit: int | None = None) -> int:
    """The largest power of two dividing ``n`` (at most ``limit`` when given): the block of a block Hadamard."""
    if n <= 0:
        raise ValueError(f"rotation size must be positive, got {n}")
    block = n & -n
    if limit is not None:
        if not is_power_of_two(limit):
            raise ValueError(f"rotation block limit must be a power of two, got {limit}")
        block = min(block, limit)
    return block


def sylvester_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unnormalized Sylvester Hadamard matrix of size ``n`` (a power of two): entries ``±1``,
    ``H_2k = [[H_k, H_k], [H_k, -H_k]]`` (what compressed-tensors and vLLM store for a ``hadamard`` transform)."""
    if not is_power_of_two(n):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h.to(dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two): entries ``±1/sqrt(n)``."""
    return (sylvester_matrix(n) / n**0.5).to(dtype)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """``n`` float64 values ``±1`` drawn from a CPU generator seeded with ``seed`` (the same on every machine)."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64)
    return (bits * 2 - 1).to(torch.float64)


def block_hadamard(n: int, block: int | None = None, seed: int | None = None) -> torch.Tensor:
    """The ``[n, n]`` float64 rotation ``diag(s) @ blockdiag(H_b, ..., H_b)``: Hadamard blocks of size ``block``
    (default: the largest power of two dividing ``n``), preceded by random signs ``s`` when ``seed`` is given
    (a randomized Hadamard, as in QuaRot). Orthonormal; ``x @ Q`` rotates row vectors ``x``."""
    block = largest_power_of_two_block(n) if block is None else block
    if not is_power_of_two(block) or n % block:
        raise ValueError(f"rotation block {block} must be a power of two dividing the size {n}")
    q = torch.block_diag(*[hadamard_matrix(block)] * (n // block))
    if seed is not None:
        q = random_signs(n, seed)[:, None] * q
    return q


def rotate_last_dim(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``x @ q`` over the last dimension, computed in float64 and returned in ``x``'s dtype."""
    if x.shape[-1] != q.shape[0]:
        raise ValueError(
            f"cannot rotate a last dimension of {x.shape[-1]} with a [{q.shape[0]}, {q.shape[1]}] rotation"
        )
    return (x.to(torch.float64) @ q).to(x.dtype)


def hadamard_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x @ blockdiag(H_block, ..., H_block)`` over the last dimension (orthonormal Sylvester blocks), by the fast
    Walsh-Hadamard transform: ``log2(block)`` rounds of elementwise sums and differences, then one scaling.

    Only elementwise arithmetic: every element is computed by the same operations in the same order whatever the
    tensor's other dimensions, its sharding or the CPU's vector width, so a rotated row has the same bits on every
    rank and machine. Sylvester blocks are symmetric and orthonormal: applying this twice gives ``x`` back (up to
    rounding). The result has ``x``'s dtype."""
    if not is_power_of_two(block) or x.shape[-1] % block:
        raise ValueError(f"rotation block {block} must be a power of two dividing the last dimension {x.shape[-1]}")
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block, block).clone()
    spare = torch.empty_like(y)
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        out = spare.view(pairs.shape)
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 0, :])
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 1, :])
        y, spare = spare, y
        h *= 2
    return y.mul_(1.0 / block**0.5).reshape(shape)


#: ``(size, dtype, device) -> the ±1 Sylvester matrix``: the factors :func:`hadamard_blocks_by_factors` multiplies by.
_FACTORS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _sylvester_factor(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    if key not in _FACTORS:
        _FACTORS[key] = sylvester_matrix(n).to(dtype=dtype, device=device)
    return _FACTORS[key]


def hadamard_blocks_by_factors(x: torch.Tensor, block: int) -> torch.Tensor:
    """The same product as :func:`hadamard_blocks`, ``x @ blockdiag(H_block, ..., H_block)``, computed as two small
    matrix products: Sylvester's ``H_block`` is the Kronecker product ``H_b1 ⊗ H_b2`` (``b1 * b2 = block``), so with
    each block viewed as a ``[b1, b2]`` matrix ``X`` the result is ``H_b1 X H_b2`` (both factors ±1, exact), then
    one scaling. About ``b1 + b2`` multiply-adds per element: several times faster on a CPU than the transform's
    ``log2(block)`` passes over memory, which is why every rotated Linear's input goes through here.

    Equal to :func:`hadamard_blocks` up to float rounding (the sums are taken in another order); a row's bits depend
    on the matrix kernels, so on the shape of ``x`` as any Linear's output does, not only on the row itself."""
    if not is_power_of_two(block) or x.shape[-1] % block:
        raise ValueError(f"rotation block {block} must be a power of two dividing the last dimension {x.shape[-1]}")
    shape = x.shape
    bits = block.bit_length() - 1
    b1, b2 = 1 << (bits // 2), 1 << (bits - bits // 2)
    y = x.reshape(-1, b1, b2) @ _sylvester_factor(b2, x.dtype, x.device)
    if b1 > 1:
        y = _sylvester_factor(b1, x.dtype, x.device) @ y
    return (y * (1.0 / block**0.5)).reshape(shape)


# ----------------------------------------------------------------------------------- any size (residual rotations)


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j - i)``, χ the quadratic character mod the prime ``q`` (0, ±1)."""
    squares = {(k * k) % q for k in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    index = torch.arange(q)
    return chi[(index[None, :] - index[:, None]) % q]


def paley_matrix(m: int) -> torch.Tensor | None:
    """An unnormalized (±1) Hadamard matrix of order ``m`` from Paley's constructions, or None: construction I for
    ``m = q + 1``, ``q`` a prime ``≡ 3 (mod 4)`` (12, 20, 24, 44, 48, 60, ...), construction II for
    ``m = 2 (q + 1)``, ``q`` a prime ``≡ 1 (mod 4)`` (12, 28, 36, 60, 76, ...)."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return s + torch.eye(m, dtype=torch.float64)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def hadamard_factor(n: int) -> torch.Tensor:
    """The unnormalized (±1) Hadamard matrix ``H_m`` with ``n = m · 2^k`` and ``m`` the smallest such order a
    Sylvester or Paley construction gives (``H_n = H_m ⊗ H_{2^k}``): ``[[1.]]`` for a power of two, ``H_36`` for
    576, ``H_20`` for 640. A :class:`ValueError` when no such ``m`` divides ``n`` (e.g. an odd ``n``)."""
    if n <= 0:
        raise ValueError(f"rotation size must be positive, got {n}")
    k = (n & -n).bit_length() - 1
    for j in range(k, -1, -1):  # the largest power of two first: the smallest odd-ish factor m
        m = n >> j
        found = torch.ones(1, 1, dtype=torch.float64) if m == 1 else paley_matrix(m)
        if found is not None:
            return found
    raise ValueError(
        f"no Hadamard matrix of size {n} is built here: it must be m · 2^k with m 1 or a Paley order "
        "(q + 1 for a prime q ≡ 3 mod 4, 2 (q + 1) for a prime q ≡ 1 mod 4)"
    )


class FullHadamard:
    """The orthonormal rotation ``Q = diag(s) (H_m ⊗ H_{2^k}) / sqrt(n)`` of a whole dimension ``n`` (no blocks),
    ``s`` random signs from ``seed`` (None: all ones, the deterministic Hadamard): what QuaRot rotates the residual
    stream with. Applied by its Kronecker factors, in float64: no ``[n, n]`` matrix is built."""

    def __init__(self, n: int, seed: int | None = None):
        self.n = n
        self.seed = seed
        self.factor = hadamard_factor(n)
        self.m = self.factor.shape[0]
        self.p = n // self.m
        self.signs = random_signs(n, seed) if seed is not None else None

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ Q`` over the last dimension (float64)."""
        if x.shape[-1] != self.n:
            raise ValueError(f"cannot rotate a last dimension of {x.shape[-1]} with a rotation of size {self.n}")
        y = x.to(torch.float64)
        if self.signs is not None:
            y = y * self.signs.to(y.device)
        y = y.reshape(-1, self.m, self.p)
        if self.p > 1:
            y = hadamard_blocks(y, self.p)  # orthonormal Sylvester factor on the last axis
        if self.m == 1:
            return y.reshape(x.shape)
        # (H_m ⊗ H_p): H_m^T X H_p on each [m, p] view. The ±1 factor is applied as sums and differences of whole
        # rows in a fixed order (no matrix kernel), so a row's bits do not depend on how many rows there are.
        signs = self.factor.T.tolist()
        parts = y.transpose(0, 1).contiguous()  # [m, rows, p]: each part contiguous
        out = torch.empty_like(parts)
        for c, row in enumerate(signs):
            torch.add(parts[0], parts[1], alpha=row[1] / row[0], out=out[c])  # row[0] = ±1
            for a in range(2, self.m):
                out[c].add_(parts[a], alpha=row[a] * row[0])
            if row[0] < 0:
                out[c].neg_()
        return out.mul_(1.0 / self.m**0.5).transpose(0, 1).reshape(x.shape)

    def left_transposed(self, w: torch.Tensor) -> torch.Tensor:
        """``Q^T @ w`` over the first dimension of a 2-D ``w`` (float64): a Linear's output rows rotated."""
        return self.right(w.T).T

    def matrix(self) -> torch.Tensor:
        """``Q`` itself, ``[n, n]`` float64 (for tests and small sizes)."""
        return self.right(torch.eye(self.n, dtype=torch.float64))
