"""How far a model's next-token distributions are from a source model's: per-token KL divergence, top-1 agreement.

Perplexity on a few thousand tokens moves by tenths with nothing changed; the KL divergence of each next-token
distribution from the source model's, over the full vocabulary, separates quantization schemes with far fewer tokens
(llama.cpp's ``--kl-divergence`` practice). For every position that predicts a token (as perplexity scores them):
``KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))`` with ``P`` the source's distribution and ``Q`` the model's, and
whether both put their largest probability on the same token. The source's log-probabilities come from a
:class:`~.baseline.SourceBaseline` (computed once, cached).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .perplexity import batch_nll, check_token_ids, device_of, logits_of

#: The quantile of the per-token KL reported beside its mean (the tail a few bad tokens make).
KL_QUANTILE = 0.99


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """A model against its source on the same tokens: ``tokens`` scored, the mean per-token KL divergence (nats) and
    its standard error (the spread over tokens, ``std / sqrt(tokens)``), the 99th percentile, and the fraction of
    tokens whose most likely next token is the source's (top-1 agreement)."""

    tokens: int
    mean_kl: float
    kl_standard_error: float
    p99_kl: float
    top1_agreement: float
    #: The standard error of the model's mean negative log-likelihood over the same tokens (its perplexity is
    #: ``exp`` of that mean: a relative spread of about this much).
    nll_standard_error: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "tokens": self.tokens,
            "mean_kl": self.mean_kl,
            "kl_standard_error": self.kl_standard_error,
            "p99_kl": self.p99_kl,
            "top1_agreement": self.top1_agreement,
            "nll_standard_error": self.nll_standard_error,
        }


@dataclass(frozen=True, kw_only=True)
class ScoredBatch:
    """One batch through the model: its summed negative log-likelihood and number of predictions (as
    :func:`~.perplexity.perplexity` adds them), and the log-probabilities (float32) of every next token at every
    position that predicts one, ``[rows, L - 1, vocab]``."""

    nll: float
    predictions: int
    logprobs: torch.Tensor

    def token_nll(self, rows: torch.Tensor) -> torch.Tensor:
        """Each prediction's negative log-likelihood (float64, flat), for this batch's token ids ``rows``."""
        targets = rows[:, 1:].to(torch.long).unsqueeze(-1)
        return -self.logprobs.gather(-1, targets).reshape(-1).double()


def scored_batches(model: nn.Module, input_ids: torch.Tensor, batch_size: int) -> Iterator[ScoredBatch]:
    """Per batch of ``batch_size`` rows of ``input_ids`` [N, L], in order, a :class:`ScoredBatch`. No gradients."""
    check_token_ids(model, input_ids)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = device_of(model)
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start : start + batch_size].to(device=device, dtype=torch.long)
            logits = logits_of(model(batch))
            nll, n = batch_nll(logits, batch)
            logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).cpu()
            yield ScoredBatch(nll=nll, predictions=n, logprobs=logprobs)


def token_divergence(
    source: torch.Tensor, model: torch.Tensor, source_top1: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: ``KL(source || model)`` (float64) and whether the two most likely tokens agree, from two
    log-probability tensors ``[..., vocab]`` of the same positions (the source's may be stored in half precision;
    ``source_top1``: its most likely tokens, taken before that rounding, which could break a near tie)."""
    if source.shape != model.shape:
        raise ValueError(f"the source's log-probabilities are {list(source.shape)}, the model's {list(model.shape)}")
    p_log = torch.log_softmax(source.float(), dim=-1)  # normalized again: half-precision rounding leaves no bias
    kl = (p_log.exp() * (p_log - model.float())).sum(-1)
    top1 = p_log.argmax(-1) if source_top1 is None else source_top1.reshape(p_log.shape[:-1])
    agree = top1 == model.argmax(-1)
    return kl.reshape(-1).double(), agree.reshape(-1)


def summarize(kl: torch.Tensor, agree: torch.Tensor, nll_standard_error: float = 0.0) -> Divergence:
    """The :class:`Divergence` of per-token KL values and top-1 agreements (flat, one per scored token)."""
    n = int(kl.numel())
    if n == 0:
        raise ValueError("no token to compare")
    std = float(kl.std()) if n > 1 else 0.0
    ordered = kl.sort().values
    p99 = float(ordered[min(n - 1, math.ceil(KL_QUANTILE * n) - 1)])  # the nearest-rank percentile
    return Divergence(
        tokens=n,
        mean_kl=float(kl.mean()),
        kl_standard_error=std / math.sqrt(n),
        p99_kl=p99,
        top1_agreement=float(agree.double().mean()),
        nll_standard_error=nll_standard_error,
    )
