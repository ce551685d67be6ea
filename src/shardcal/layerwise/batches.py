"""Calibration data in, fixed batches out — the same batches whatever the world size.

Users hand over what they have: an int tensor ``[N, L]`` of token ids, a list of such tensors, or dicts with
``input_ids`` (and ``attention_mask``). Batches are formed globally first and then dealt to ranks whole, so a
batch is computed identically on any world size — that is what makes the statistics bit-exact across world
sizes. A rank may get no batch at all (fewer batches than ranks); it still takes part in every collective.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DataError


@dataclass
class Batch:
    """One batch of token ids ``[B, L]`` with an optional padding mask (1 = real token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        if self.attention_mask is None:
            return self.input_ids.numel()
        return int(self.attention_mask.sum())


def _as_rows(item: Any, where: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Rows (ids [L], mask [L] or None) of one user item."""
    mask = None
    if isinstance(item, dict):
        if "input_ids" not in item:
            raise DataError(f"{where}: a dict item needs an 'input_ids' entry (got keys {sorted(item)})")
        ids, mask = item["input_ids"], item.get("attention_mask")
    else:
        ids = item
    ids = _as_int_tensor(ids, f"{where} input_ids")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise DataError(f"{where}: input_ids must be [batch, seq] or [seq], got shape {list(ids.shape)}")
    if mask is not None:
        mask = _as_int_tensor(mask, f"{where} attention_mask")
        if mask.dim() == 1:
            mask = mask[None]
        if mask.shape != ids.shape:
            raise DataError(
                f"{where}: attention_mask shape {list(mask.shape)} differs from input_ids shape {list(ids.shape)}"
            )
    return [(ids[i], None if mask is None else mask[i]) for i in range(ids.shape[0])]


def _as_int_tensor(value: Any, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{where}: not a rectangular array of token ids ({exc})") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise DataError(f"{where}: token ids must be integers, got dtype {str(value.dtype).removeprefix('torch.')}")
    return value.long()


def model_batches(model: Any, data: Any, batch_size: int) -> list[Batch]:
    """:func:`make_batches` checked against the model: its config's ``vocab_size`` and ``max_position_embeddings``
    (either left unchecked when the model has no such config field)."""
    config = getattr(model, "config", None)
    return make_batches(
        data,
        batch_size,
        vocab_size=getattr(config, "vocab_size", None),
        max_positions=getattr(config, "max_position_embeddings", None),
    )


def make_batches(
    data: Any, batch_size: int, vocab_size: int | None = None, max_positions: int | None = None
) -> list[Batch]:
    """Normalise user data into global batches of ``batch_size`` rows (the last may be smaller).

    Rows of different lengths are right-padded with an attention mask. Errors (:class:`DataError`) name what
    is wrong: empty data, non-integer ids, ids outside ``[0, vocab_size)``, sequences longer than
    ``max_positions``.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    items: Sequence[Any] = [data] if isinstance(data, (torch.Tensor, dict)) else list(_iterable(data))
    rows: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for i, item in enumerate(items):
        rows.extend(_as_rows(item, f"calibration data item {i}"))
    rows = [(ids, mask) for ids, mask in rows if ids.numel() > 0]
    if not rows:
        raise DataError("calibration data is empty (no token ids)")
    for i, (ids, _) in enumerate(rows):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            raise DataError(
                f"calibration data row {i}: token id {bad} is outside the model's vocabulary [0, {vocab_size})"
            )
        if max_positions is not None and ids.numel() > max_positions:
            raise DataError(
                f"calibration data row {i}: {ids.numel()} tokens exceed the model's max_position_embeddings={max_positions}"
            )
    return [_stack(rows[s : s + batch_size]) for s in range(0, len(rows), batch_size)]


def _iterable(data: Any) -> Iterable[Any]:
    try:
        return iter(data)
    except TypeError:
        raise DataError(
            f"calibration data must be a tensor, a dict or a list of them, got {type(data).__name__}"
        ) from None


def _stack(rows: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Batch:
    length = max(ids.numel() for ids, _ in rows)
    if all(ids.numel() == length and mask is None for ids, mask in rows):
        return Batch(torch.stack([ids for ids, _ in rows]))
    ids_out = torch.zeros(len(rows), length, dtype=torch.long)
    mask_out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        ids_out[i, : ids.numel()] = ids
        mask_out[i, : ids.numel()] = 1 if mask is None else mask
    return Batch(ids_out, None if bool(mask_out.all()) else mask_out)


def rank_batch_indices(num_batches: int, rank: int, world_size: int) -> list[int]:
    """Global batch indices this rank owns: contiguous blocks, the first ``num_batches % world`` ranks get one more."""
    base, extra = divmod(num_batches, world_size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def leading_rows(batches: Sequence[Batch], tokens: int) -> dict[int, int]:
    """The first sequences of the data, in global order, that hold at least ``tokens`` real tokens (whole sequences;
    all of them when the data hold fewer): ``{batch index: rows from its start}``, empty when ``tokens`` is 0."""
    return leading_rows_of(
        (  # lazily: the batches after the sample are never counted
            batch.attention_mask.sum(dim=1).tolist()
            if batch.attention_mask is not None
            else [batch.input_ids.shape[1]] * batch.input_ids.shape[0]
            for batch in batches
        ),
        tokens,
    )


def leading_rows_of(row_tokens: Iterable[Sequence[int]], tokens: int) -> dict[int, int]:
    """:func:`leading_rows` from the real tokens of each row of each batch, in order (``row_tokens[b][r]``)."""
    out: dict[int, int] = {}
    held = 0
    for b, per_row in enumerate(row_tokens):
        if held >= tokens:
            break
        rows = 0
        while rows < len(per_row) and held < tokens:
            held += int(per_row[rows])
            rows += 1
        out[b] = rows
    return out


def warn_idle_ranks(num_batches: int, batch_size: int, world_size: int, stacklevel: int = 1) -> None:
    """One warning when some ranks get no batch (they only take part in the gathers); ``stacklevel`` as
    ``warnings.warn``'s, counted from the caller."""
    idle = [r for r in range(world_size) if not rank_batch_indices(num_batches, r, world_size)]
    if idle:
        warnings.warn(
            f"{num_batches} batch(es) of up to {batch_size} sequences for {world_size} ranks: rank(s) "
            f"{', '.join(map(str, idle))} get none and only take part in the gathers (a smaller batch size, or more "
            "samples, gives every rank work)",
            stacklevel=stacklevel + 1,
        )


def data_fingerprint(batches: Sequence[Batch]) -> str:
    """SHA-256 over all batches' ids and masks: a resumed run must see the same data."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(str(list(batch.input_ids.shape)).encode())
        digest.update(batch.input_ids.to(torch.int64).contiguous().numpy().tobytes())
        if batch.attention_mask is not None:
            digest.update(batch.attention_mask.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()
