"""``shardcal eval``: perplexity of a model on held-out text or a data file (and of the model it was exported from)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .commands import command, data_arguments, load_data, model_impl_argument


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face-format model directory (also a shardcal export)"
    )
    data_arguments(parser, num_samples=8, seq_len=None, batch_size=4)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="for an export, skip the perplexity of the model it was made from (computed when that is still there)",
    )
    model_impl_argument(parser)


@command("eval", help="perplexity of a model on held-out text or a data file", arguments=_eval_arguments)
def _eval(args: argparse.Namespace) -> int:
    from ..export.metadata import export_source
    from ..loading.foreign import raw_config, text_field

    model_dir = Path(args.model_dir)
    ids, source = load_data(args, model_dir, text_field(raw_config(model_dir), "vocab_size"), split="eval")
    start = time.perf_counter()
    value = _perplexity_of(model_dir, ids, args)
    seconds = time.perf_counter() - start
    origin = None if args.no_baseline else export_source(model_dir)
    baseline = _perplexity_of(origin, ids, args) if origin is not None else None
    if args.json:
        result = {"model_dir": str(model_dir), "perplexity": value, "num_samples": ids.shape[0],
                  "seq_len": ids.shape[1], "data": source, "seconds": round(seconds, 3)}  # fmt: skip
        if baseline is not None:
            result.update(source_model_dir=str(origin), source_perplexity=baseline)
        print(json.dumps(result))
        return 0
    print(f"perplexity {value:.4f}  ({ids.shape[0]} x {ids.shape[1]} tokens of {source}; {seconds:.1f} s)")
    if baseline is not None:
        print(f"source model {origin}: perplexity {baseline:.4f} (the export: {value / baseline - 1:+.1%})")
    return 0


def _perplexity_of(model_dir: Path, ids: torch.Tensor, args: argparse.Namespace) -> float:  # noqa: F821
    """Perplexity of the model (or export) in ``model_dir`` on ``ids``, loaded by the class ``--model-impl`` picks."""
    from ..data.perplexity import perplexity
    from ..loading.foreign import choose_impl, load_transformers_plain
    from ..loading.plain import from_pretrained

    impl = choose_impl(model_dir, args.model_impl)
    model = from_pretrained(model_dir) if impl == "shardcal" else load_transformers_plain(model_dir)
    return perplexity(model, ids, batch_size=args.batch_size)
