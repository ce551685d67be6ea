"""Quality checks of a causal LM: perplexity on token blocks, and greedy generation for a quick look."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DataError
from ..runtime.distributed import all_reduce_, dp_group, world


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter that is not on the meta device (the CPU without one)."""
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def logits_of(output: Any) -> torch.Tensor:
    """Our models return logits; HF-style models return an object with ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)  # transformers' multimodal configs
    return get_text() if callable(get_text) else config


def check_token_ids(model: nn.Module, input_ids: torch.Tensor) -> None:
    """What calibration checks, for evaluation too: token ids ``[N, L]`` (integers, at least two per row) inside
    the model's vocabulary, rows no longer than its ``max_position_embeddings`` (when its config says).
    :class:`DataError` naming the problem otherwise."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise DataError(
            f"perplexity needs token ids of shape [num_samples, seq_len], got {getattr(input_ids, 'shape', type(input_ids))}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise DataError(f"perplexity needs integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise DataError(
            f"perplexity needs at least one sequence of two or more tokens, got shape {list(input_ids.shape)}"
        )
    config = _text_config(model)
    vocab, positions = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        raise DataError(f"token id {low if low < 0 else high} is outside the model's vocabulary [0, {vocab})")
    if isinstance(positions, int) and input_ids.shape[1] > positions:
        raise DataError(
            f"sequences of {input_ids.shape[1]} tokens exceed the model's max_position_embeddings={positions} "
            "(use shorter sequences: --seq-len)"
        )


def token_nll(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 4) -> tuple[float, int]:
    """``(summed negative log-likelihood, number of predictions)`` over every next-token prediction in ``input_ids``."""
    check_token_ids(model, input_ids)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = device_of(model)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start : start + batch_size].to(device=device, dtype=torch.long)
            nll, n = batch_nll(logits_of(model(batch)), batch)
            total, count = total + nll, count + n
    return total, count


def batch_nll(logits: torch.Tensor, batch: torch.Tensor) -> tuple[float, int]:
    """``(summed negative log-likelihood, predictions)`` of one batch ``[rows, L]`` from the model's logits of every
    position: each position's prediction of the token after it (float32 sums, as every perplexity here adds them)."""
    logits, targets = logits[:, :-1], batch[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    return float(nll), targets.numel()


def perplexity(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean negative log-likelihood of every next-token prediction) over ``input_ids`` [N, L]; no gradients."""
    total, count = token_nll(model, input_ids, batch_size)
    return math.exp(total / count)


def generate_greedy(
    model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 16, stop_at_eos: bool = True
) -> str:
    """The greedy continuation of ``prompt`` (only the new text), recomputing the whole sequence each step."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise DataError("generate_greedy needs a non-empty prompt")
    device = device_of(model)
    sequence = torch.tensor([ids], dtype=torch.long, device=device)
    new: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(logits_of(model(sequence))[0, -1].argmax())
            if stop_at_eos and next_id == eos:
                break
            new.append(next_id)
            sequence = torch.cat([sequence, torch.tensor([[next_id]], device=device)], dim=1)
    return tokenizer.decode(new)


def distributed_perplexity(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 4) -> float:
    """Perplexity of a (possibly FSDP2-sharded) model with the rows split over ranks; collective.

    Every rank scores its own rows and the sums are all-reduced. A sharded forward is a collective, so every
    rank runs the same number of forwards: a rank that runs out of rows repeats a dummy one and ignores it.
    """
    rank, world_size = world()
    if world_size == 1:
        return perplexity(model, input_ids, batch_size=batch_size)
    check_token_ids(model, input_ids)  # the same data on every rank: every rank refuses alike
    per_rank = -(-input_ids.shape[0] // world_size)
    mine = input_ids[rank * per_rank : (rank + 1) * per_rank]
    forwards = -(-per_rank // batch_size)
    total, count = 0.0, 0
    for i in range(forwards):
        batch = mine[i * batch_size : (i + 1) * batch_size]
        if batch.shape[0] == 0:
            with torch.no_grad():
                model(input_ids[:1].to(device_of(model)))  # keep the collectives matched
            continue
        nll, n = token_nll(model, batch, batch_size=batch_size)
        total, count = total + nll, count + n
    sums = all_reduce_(torch.tensor([total, float(count)], dtype=torch.float64), "sum", dp_group())
    return math.exp(float(sums[0]) / float(sums[1]))
