"""Calibration samples from one or several data sources (``--data chat.jsonl:256 --data wiki.parquet:256``).

A source is a record file (:mod:`.records`: JSONL, parquet, a directory of parquet files) with an optional count.
Each record becomes token ids: text is tokenized (after the tokenizer's leading special tokens, such as BOS), a
conversation is rendered with the model's chat template (:mod:`.chat`) and tokenized as transformers'
``apply_chat_template`` tokenizes it (no special tokens added: the template writes its own), token ids are taken as
they are. Then, by :data:`PACKINGS`:

* ``packed``: the records' ids joined (text with EOS between documents) and cut into blocks of ``seq_len``;
* ``per-sample``: each record one sample, truncated to ``seq_len``; a shorter one is right-padded in its batch and
  masked, so its padding never reaches a statistic;
* ``auto``: per-sample for conversations, packed for text and token ids.

Records are taken in file order, or shuffled with ``seed``; several sources are concatenated in the order given.
"""

from __future__ import annotations

import functools
import random
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DataError
from .chat import ChatTemplate, load_chat_template
from .records import Records, read_records
from .token_data import DEFAULT_SEQ_LEN, check_id_range, leading_special_ids, pack_records

PACKINGS = ("auto", "packed", "per-sample")
_COUNTED = re.compile(r"^(?P<path>.+):(?P<count>\d+)$")


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One ``--data`` source: where it is and how many samples to take from it (None: ``--num-samples``)."""

    path: Path
    count: int | None = None


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How records become samples: the column read, the chat template file overriding the model's, the packing and
    the seed records are shuffled with (None: file order)."""

    column: str | None = None
    chat_template: Path | None = None
    packing: str = "auto"
    seed: int | None = None


def parse_source(spec: str | Path) -> DataSource:
    """``PATH`` or ``PATH:COUNT`` (a path that exists as written is never split)."""
    text = str(spec)
    match = _COUNTED.match(text)
    if match is None or Path(text).exists():
        return DataSource(path=Path(text))
    count = int(match["count"])
    if count < 1:
        raise DataError(f"--data {text}: the count after ':' must be >= 1")
    return DataSource(path=Path(match["path"]), count=count)


def sources_of(data: str | Path | DataSource | Sequence[str | Path | DataSource] | None) -> list[DataSource]:
    """``data`` (None, one source, or several: each a :class:`DataSource`, a path or ``PATH:COUNT``) as sources."""
    if data is None:
        return []
    specs = [data] if isinstance(data, (str, Path, DataSource)) else list(data)
    return [spec if isinstance(spec, DataSource) else parse_source(spec) for spec in specs]


def counts_of(sources: Sequence[DataSource], num_samples: int | None) -> list[int | None]:
    """How many samples each source gives: its own count, or ``num_samples`` when it is the only source."""
    if len(sources) == 1:
        return [sources[0].count if sources[0].count is not None else num_samples]
    for source in sources:
        if source.count is None:
            raise DataError(
                f"--data {source.path}: with several sources, give each its number of samples ({source.path}:256)"
            )
    return [source.count for source in sources]


def is_token_file(path: Path) -> bool:
    """``.safetensors`` and ``.npy``: token ids that are not records (read by :func:`.token_data.load_token_data`)."""
    return path.suffix.lower() in (".safetensors", ".npy")


# ----------------------------------------------------------------------------------------------------- samples


class Tools:
    """The tokenizer and chat template a run needs, built on first use (token-id data need neither)."""

    def __init__(self, tokenizer: Callable[[], Any] | None, template: Callable[[], ChatTemplate] | None) -> None:
        self._tokenizer, self._template = tokenizer, template

    @functools.cached_property
    def tokenizer(self) -> Any:
        return self._tokenizer()

    @functools.cached_property
    def template(self) -> ChatTemplate:
        return self._template()

    @functools.cached_property
    def lead(self) -> list[int]:
        """The tokenizer's leading special tokens (BOS where its template adds one), found once."""
        return leading_special_ids(self.tokenizer)

    def check(self, records: Records) -> None:
        """Refuse records this run has no tokenizer or chat template for, naming them."""
        if records.kind != "input_ids" and self._tokenizer is None:
            raise DataError(f"{records.path}: {records.kind} data need a tokenizer (the model's tokenizer.json)")
        if records.kind == "messages" and self._template is None:
            raise DataError(f"{records.path}: chat messages need the model's chat template (or --chat-template FILE)")


def model_tools(model_dir: Path, chat_template: Path | None = None, tokenizer: Any = None) -> Tools:
    """The tokenizer (``tokenizer.json``) and chat template of ``model_dir``, built when first needed."""

    def build_tokenizer() -> Any:
        from ..io.tokenizer.tokenizer import Tokenizer

        return Tokenizer.from_dir(model_dir)

    return Tools(
        (lambda: tokenizer) if tokenizer is not None else build_tokenizer,
        lambda: load_chat_template(model_dir, chat_template),
    )


def record_ids(records: Records, index: int, tools: Tools) -> list[int]:
    """Token ids of one record: text after the tokenizer's leading special tokens, a conversation rendered with
    the chat template (no special tokens added), token ids as stored."""
    value = records.value(index)
    if records.kind == "input_ids":
        return value
    if records.kind == "text":
        return tools.lead + list(tools.tokenizer.encode(value))
    try:
        text = tools.template.render(value, **records.extras(index))
    except ValueError as exc:
        raise DataError(f"{records.where(index)}: {exc}") from None
    return list(tools.tokenizer.encode(text, add_special_tokens=False))


def source_samples(
    source: DataSource, count: int | None, seq_len: int | None, options: DataOptions, tools: Tools
) -> tuple[list[torch.Tensor], Records]:
    """Up to ``count`` samples (1-D int64 token ids; all of them when None) from one record source."""
    records = read_records(source.path, options.column)
    tools.check(records)
    order = list(range(records.count))
    if options.seed is not None:
        random.Random(options.seed).shuffle(order)
    packing = options.packing
    if packing == "auto":
        packing = "per-sample" if records.kind == "messages" else "packed"
    if packing == "per-sample":
        samples = _one_per_record(records, order, count, seq_len, tools)
    else:
        samples = _packed(records, order, count, seq_len or DEFAULT_SEQ_LEN, tools)
    if not samples:
        raise DataError(f"{source.path}: gives no sample ({_what(records, packing, seq_len)})")
    return samples, records


def _one_per_record(
    records: Records, order: list[int], count: int | None, seq_len: int | None, tools: Tools
) -> list[torch.Tensor]:
    limit = seq_len if seq_len is not None or records.kind == "input_ids" else DEFAULT_SEQ_LEN
    samples = []
    for index in order:
        if count is not None and len(samples) == count:
            break
        ids = record_ids(records, index, tools)[:limit]
        if ids:
            samples.append(torch.tensor(ids, dtype=torch.long))
    return samples


def _packed(records: Records, order: list[int], count: int | None, seq_len: int, tools: Tools) -> list[torch.Tensor]:
    tokenizer = tools.tokenizer if records.kind == "text" else None
    return list(pack_records(records, order, count, seq_len, tokenizer, lambda i: record_ids(records, i, tools)))


def _what(records: Records, packing: str, seq_len: int | None) -> str:
    if packing == "packed":
        return f"its {records.count} records hold fewer tokens than one block of {seq_len or DEFAULT_SEQ_LEN}"
    return f"its {records.count} records all tokenize to nothing"


def stack_samples(samples: Sequence[torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Samples of one length as a ``[N, L]`` tensor; of several lengths, right-padded to the longest with an
    ``attention_mask`` (1 = token), the form :func:`shardcal.calibrate` takes."""
    lengths = {int(sample.numel()) for sample in samples}
    if len(lengths) == 1:
        return torch.stack(list(samples))
    length = max(lengths)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : sample.numel()] = sample
        mask[row, : sample.numel()] = 1
    return {"input_ids": ids, "attention_mask": mask}


def data_shape(data: torch.Tensor | dict[str, torch.Tensor]) -> tuple[int, int]:
    """(samples, longest sample) of token data as :func:`stack_samples` returns it."""
    ids = data["input_ids"] if isinstance(data, dict) else data
    return int(ids.shape[0]), int(ids.shape[1])


def load_sources(
    sources: Sequence[DataSource],
    tools: Tools,
    *,
    num_samples: int | None,
    seq_len: int | None,
    options: DataOptions,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor | dict[str, torch.Tensor], str]:
    """The samples of every source, concatenated in order, stacked (:func:`stack_samples`), and a description of
    where they came from. Each source's ids are checked against ``vocab_size``; a source with fewer samples than
    asked gives what it has, with a warning."""
    if options.packing not in PACKINGS:
        raise DataError(f"packing must be one of {', '.join(PACKINGS)}, got {options.packing!r}")
    samples: list[torch.Tensor] = []
    described = []
    for source, count in zip(sources, counts_of(sources, num_samples)):
        found, records = source_samples(source, count, seq_len, options, tools)
        _check_ids(found, source.path, vocab_size)
        if count is not None and len(found) < count:
            warnings.warn(
                f"{source.path}: gives {len(found)} samples, fewer than the {count} asked for; using {len(found)}",
                stacklevel=3,
            )
        samples.extend(found)
        described.append(f"{source.path} ({len(found)} x {records.kind} '{records.column}')")
    return stack_samples(samples), " + ".join(described)


def _check_ids(samples: list[torch.Tensor], path: Path, vocab_size: int | None) -> None:
    low, high = min(int(sample.min()) for sample in samples), max(int(sample.max()) for sample in samples)
    check_id_range(path, low, high, vocab_size)


def load_calibration_data(
    model_dir: str | Path,
    *sources: str | Path | DataSource,
    num_samples: int | None = 32,
    seq_len: int | None = None,
    options: DataOptions | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor | dict[str, torch.Tensor], str]:
    """Calibration data for the model in ``model_dir`` from one source or several (``"chat.jsonl:256"``,
    ``"wiki/:256"``: records of text, chat messages or token ids, read as ``options`` says), with its tokenizer and
    chat template; what :func:`shardcal.calibrate` takes (a ``[N, L]`` tensor, or a dict of padded ``input_ids``
    and their ``attention_mask``), and a description of where the samples came from. ``num_samples`` is the count
    of a single source without its own; ``vocab_size`` (when given) checks every id."""
    if not sources:
        raise DataError("load_calibration_data needs at least one source (a .jsonl, .parquet or directory path)")
    options = options or DataOptions()
    model_dir = Path(model_dir)
    return load_sources(sources_of(sources), model_tools(model_dir, options.chat_template),
                        num_samples=num_samples, seq_len=seq_len, options=options, vocab_size=vocab_size)  # fmt: skip
