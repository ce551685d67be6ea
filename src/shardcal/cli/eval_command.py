"""``shardcal eval``: perplexity of a model on held-out text or a data file, beside the model it was made from (its
perplexity cached), and with ``--kl`` the KL divergence of its next-token distributions from that model's."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from .commands import command, data_arguments, load_data, model_impl_argument

if TYPE_CHECKING:  # annotations only: the command imports torch when it runs, not when --help does
    import torch

    from ..data.baseline import SourceBaseline
    from ..data.divergence import Divergence


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (also a shardcal export)"
    )
    data_arguments(parser, num_samples=8, seq_len=None, batch_size=4, packing=False)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--kl",
        action="store_true",
        help="also the KL divergence of every next-token distribution from the source model's (mean, p99, top-1 "
        "agreement): a finer judge than perplexity (needs the source: an export's own, or --source)",
    )
    parser.add_argument(
        "--source",
        metavar="DIR",
        help="the model to compare with (default: for a shardcal export, the model it was made from, when still there)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the source model (its perplexity, computed when it is still there, else read from the cache)",
    )
    parser.add_argument(
        "--baseline-cache",
        metavar="DIR",
        help="where the source model's results are cached (default $SHARDCAL_CACHE or ~/.cache/shardcal)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="compute the source model's side again, and keep nothing of it"
    )
    model_impl_argument(parser)


@command(
    "eval",
    help="perplexity of a model on held-out text or a data file (and KL to its source)",
    arguments=_eval_arguments,
)
def _eval(args: argparse.Namespace) -> int:
    from ..export.metadata import export_source
    from ..loading.foreign import raw_config, text_field

    model_dir = Path(args.model_dir)
    if args.no_baseline and (args.kl or args.source):
        raise UsageError(f"--no-baseline skips the source model, which {'--kl' if args.kl else '--source'} needs")
    origin = Path(args.source) if args.source else None if args.no_baseline else export_source(model_dir)
    if origin is not None and not (origin / "config.json").is_file():
        raise UsageError(f"--source {origin}: not a model directory (no config.json)")
    if args.kl and origin is None:
        raise UsageError(
            f"--kl compares {model_dir} with the model it was made from, which its manifest does not name (or which "
            "is gone): pass --source DIR"
        )
    ids, source = load_data(args, model_dir, text_field(raw_config(model_dir), "vocab_size"), split="eval")
    with tempfile.TemporaryDirectory(prefix="shardcal-eval-") as scratch:
        baseline = None
        if origin is not None:
            baseline = _baseline(origin, ids, args, Path(scratch) if args.no_cache else _cache_dir(args))
        start = time.perf_counter()
        value, divergence = _evaluate(model_dir, ids, args, baseline if args.kl else None)
        seconds = time.perf_counter() - start
    if args.json:
        result = {"model_dir": str(model_dir), "perplexity": value, "num_samples": ids.shape[0],
                  "seq_len": ids.shape[1], "data": source, "seconds": round(seconds, 3)}  # fmt: skip
        if baseline is not None:
            result.update(source_model_dir=str(origin), source_perplexity=baseline.perplexity, cached=baseline.cached)
        if divergence is not None:
            result.update(kl=divergence.to_dict())
        print(json.dumps(result))
        return 0
    print(f"perplexity {value:.4f}  ({ids.shape[0]} x {ids.shape[1]} tokens of {source}; {seconds:.1f} s)")
    if baseline is not None:
        where = "; cached" if baseline.cached else ""
        print(
            f"source model {origin}: perplexity {baseline.perplexity:.4f} (the export: "
            f"{value / baseline.perplexity - 1:+.1%}{where})"
        )
    if divergence is not None:
        d = divergence
        print(
            f"KL divergence from the source: mean {d.mean_kl:.5f} +- {d.kl_standard_error:.5f} nats, p99 "
            f"{d.p99_kl:.4f}; top-1 agreement {d.top1_agreement:.2%} ({d.tokens} tokens)"
        )
    return 0


def _cache_dir(args: argparse.Namespace) -> Path:
    from ..io.gguf.importer import default_cache_dir

    return Path(args.baseline_cache) if args.baseline_cache else default_cache_dir()


def _baseline(origin: Path, ids: torch.Tensor, args: argparse.Namespace, cache: Path) -> SourceBaseline:
    """The source model's perplexity (and, with ``--kl``, log-probabilities) on ``ids``: cached, or computed now."""
    from ..data.baseline import source_baseline
    from ..loading.foreign import choose_impl

    impl = choose_impl(origin, args.model_impl)
    return source_baseline(origin, ids, lambda: _load(origin, impl), cache_dir=cache, batch_size=args.batch_size,
                           impl=impl, logprobs=args.kl)  # fmt: skip


def _load(model_dir: Path, impl: str) -> torch.nn.Module:
    """The model (or export) in ``model_dir``, loaded by ``impl``'s class."""
    from ..loading.foreign import load_transformers_plain
    from ..loading.plain import from_pretrained

    return from_pretrained(model_dir) if impl == "shardcal" else load_transformers_plain(model_dir)


def _evaluate(
    model_dir: Path,
    ids: torch.Tensor,
    args: argparse.Namespace,
    baseline: SourceBaseline | None,
) -> tuple[float, Divergence | None]:
    """Perplexity of the model (or export) in ``model_dir`` on ``ids``, loaded by the class ``--model-impl`` picks;
    with a ``baseline`` holding log-probabilities, the KL divergence from it too (one forward per batch)."""
    import math

    import torch

    from ..data.divergence import scored_batches, summarize, token_divergence
    from ..data.perplexity import perplexity
    from ..loading.foreign import choose_impl

    model = _load(model_dir, choose_impl(model_dir, args.model_impl))
    if baseline is None:
        return perplexity(model, ids, batch_size=args.batch_size), None
    total, count, kls, agrees, nll = 0.0, 0, [], [], []
    for i, scored in enumerate(scored_batches(model, ids, args.batch_size)):
        total, count = total + scored.nll, count + scored.predictions
        source, source_top1 = baseline.logprobs(i)
        kl, agree = token_divergence(source, scored.logprobs, source_top1)
        kls.append(kl)
        agrees.append(agree)
        nll.append(scored.token_nll(ids[i * args.batch_size : (i + 1) * args.batch_size]))
    tokens = torch.cat(nll)
    spread = float(tokens.std()) / math.sqrt(tokens.numel()) if tokens.numel() > 1 else 0.0
    return math.exp(total / count), summarize(torch.cat(kls), torch.cat(agrees), nll_standard_error=spread)
