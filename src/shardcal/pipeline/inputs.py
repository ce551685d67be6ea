"""What a calibration can refuse before anything is loaded, and its token data: shared by the library call and the command line.

Errors name the inputs as the caller does: a library call by its parameter names (``out_dir``, ``num_samples``), the
command line by its flags (``--out``, ``--num-samples``), through ``input_names`` (see :data:`PARAMETER_NAMES`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe
from ..data.records import is_record_source
from ..data.sources import DataOptions, data_shape, is_token_file, load_calibration_data, sources_of
from ..errors import CalibrationCheckpointError, ConfigError, DataError, ExportError, TokenizerError
from ..export import check_destination
from ..export.export import export_dtype as dtype_of_export
from ..export.format import DEFAULT_FORMAT, ExportFormat, get_format
from ..loading.foreign import MODEL_IMPLS, choose_impl, raw_config, text_field
from ..models.checkpoint import CheckpointReader
from ..models.config import load_config
from ..plan.preflight import check_recipe_fits, meta_skeleton
from ..runtime.fsutil import check_apart

#: What ``data`` may be: None (the Wikipedia summaries), one source (a path, or ``PATH:COUNT``) or several.
DataArgument = str | Path | Sequence[str | Path] | None
#: Token data: ``[N, L]`` ids, or a dict of right-padded ``input_ids`` and their ``attention_mask``.
TokenData = torch.Tensor | dict[str, torch.Tensor]

#: How errors name each input of a library call (``input_names`` overrides some or all of them).
PARAMETER_NAMES: dict[str, str] = {
    "out_dir": "out_dir",
    "checkpoint_dir": "checkpoint_dir",
    "overwrite": "overwrite=True",
    "num_samples": "num_samples",
    "seq_len": "seq_len",
    "model_impl": "model_impl",
    "format": "format",
    "export_dtype": "export_dtype",
    "stream": "stream",
}


def input_name(input_names: Mapping[str, str] | None, key: str) -> str:
    """How errors name input ``key``: ``input_names[key]``, else its entry in :data:`PARAMETER_NAMES`."""
    return (input_names or {}).get(key, PARAMETER_NAMES[key])


@dataclass(frozen=True, kw_only=True)
class CalibrationInputs:
    """What the checks before loading found: the recipe, whose model class runs it (``"shardcal"`` or
    ``"transformers"``), the model's vocabulary size (what token data is checked against) and the export format."""

    recipe: Recipe
    impl: str
    vocab_size: int | None
    export_format: ExportFormat
    #: The dtype of the export's unquantized tensors (``export_dtype``; ``"auto"``: the checkpoint's own).
    export_dtype: torch.dtype | None = None


def check_calibration_inputs(
    model_dir: str | Path,
    out_dir: str | Path,
    recipe: str | Path | Recipe,
    *,
    data: DataArgument = None,
    checkpoint_dir: str | Path | None = None,
    overwrite: bool = False,
    model_impl: str = "auto",
    format: str | ExportFormat = DEFAULT_FORMAT,
    export_dtype: str | None = "auto",
    input_names: Mapping[str, str] | None = None,
    data_options: DataOptions | None = None,
) -> CalibrationInputs:
    """Everything a calibration can refuse before loading weights or data, in this order: the recipe, the export
    format, where outputs go (``out_dir`` and ``checkpoint_dir`` never over an input), the model's config, its
    tensors' names and shapes (the safetensors headers) and the recipe (and its ``[fallback]``) against every decoder
    layer (:mod:`shardcal.plan.preflight`), the data's tokenizer and chat template (:func:`check_data_tokenizer`),
    and ``out_dir`` itself (non-empty without ``overwrite``, unwritable).

    Not collective; reads no weight. Raises a :class:`~shardcal.errors.ShardcalError` naming the input (as
    ``input_names`` says: :data:`PARAMETER_NAMES` by default).
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    recipe = load_recipe(recipe)
    export_format = get_format(format, input_name(input_names, "format"))
    if export_dtype != "auto":
        dtype_of_export(export_dtype, input_name(input_names, "export_dtype"))
    protected = protected_inputs(model_dir, data, data_options)
    check_apart(out_dir, input_name(input_names, "out_dir"), protected, ExportError)
    if checkpoint_dir is not None:
        check_apart(
            checkpoint_dir,
            input_name(input_names, "checkpoint_dir"),
            {**protected, input_name(input_names, "out_dir"): out_dir},
            CalibrationCheckpointError,
        )
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(
            f"{input_name(input_names, 'model_impl')} must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}"
        )
    impl = choose_impl(model_dir, model_impl)
    vocab_size = (
        load_config(model_dir).vocab_size if impl == "shardcal" else text_field(raw_config(model_dir), "vocab_size")
    )
    check_recipe_fits(meta_skeleton(model_dir, impl), recipe)  # headers and shapes: no weight is read
    if recipe.fallback is not None and recipe.fallback.quantizes_linears:  # [fallback]'s scheme must fit as well
        check_recipe_fits(meta_skeleton(model_dir, impl), recipe.fallback)
    check_data_tokenizer(model_dir, data, data_options)
    check_destination(out_dir, overwrite, flag=input_name(input_names, "overwrite"))
    if export_dtype == "auto":
        with CheckpointReader(model_dir) as reader:
            stored = reader.floating_dtype()
    else:
        stored = dtype_of_export(export_dtype, input_name(input_names, "export_dtype"))
    return CalibrationInputs(
        recipe=recipe, impl=impl, vocab_size=vocab_size, export_format=export_format, export_dtype=stored
    )


def protected_inputs(
    model_dir: Path, data: DataArgument, data_options: DataOptions | None
) -> dict[str, str | Path | None]:
    """What no output may be, contain or lie inside: the model directory, every data source, the chat template."""
    protected: dict[str, str | Path | None] = {"the model directory": model_dir}
    for number, source in enumerate(sources_of(data)):
        protected["the data file" + (f" (source {number + 1})" if number else "")] = source.path
    if data_options is not None and data_options.chat_template is not None:
        protected["the chat template"] = data_options.chat_template
    return protected


def check_data_tokenizer(model_dir: str | Path, data: DataArgument, data_options: DataOptions | None = None) -> None:
    """When the data is text (the default Wikipedia summaries, a ``.txt`` file, records of text or conversations),
    build the model directory's tokenizer now, so that a missing or unsupported tokenizer.json fails in seconds,
    before any weight or text is read, with a :class:`~shardcal.errors.TokenizerError` naming the file and the
    field; for conversations, compile the chat template as well (a :class:`~shardcal.errors.DataError` naming it)."""
    from ..data.chat import load_chat_template
    from ..data.records import read_records
    from ..io.tokenizer.tokenizer import check_tokenizer_file

    options = data_options or DataOptions()
    sources = sources_of(data)
    kinds = set()
    for source in sources:
        if is_record_source(source.path):
            kinds.add(read_records(source.path, options.column).kind)
        elif not is_token_file(source.path):
            kinds.add("text")
    if not sources or kinds - {"input_ids"}:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json (needed to tokenize text for this model)")
        check_tokenizer_file(path)
    if "messages" in kinds:
        load_chat_template(model_dir, options.chat_template)


def read_token_data(
    model_dir: str | Path,
    vocab_size: int | None,
    *,
    data: DataArgument = None,
    num_samples: int | None = 32,
    seq_len: int | None = None,
    split: str = "calib",
    input_names: Mapping[str, str] | None = None,
    data_options: DataOptions | None = None,
) -> tuple[TokenData, str]:
    """Token data and where they came from, checked before the model is loaded.

    ``data``: one source or several, each a path with an optional ``:COUNT`` (:mod:`shardcal.data.sources`): a
    token-id file (``.safetensors`` with an int ``input_ids`` [N, L], ``.npy``), a ``.txt`` document, or records
    (``.jsonl``, ``.parquet``, a directory of parquet files) of text, conversations (rendered with the model's chat
    template) or token ids, read as ``data_options`` says (column, chat template, packing, seed); None: the
    Wikipedia summaries of ``split`` (``"calib"`` or ``"eval"``). ``num_samples`` samples (of a single source) of
    ``seq_len`` tokens (a token-id file keeps its own length when ``seq_len`` is None; text defaults to 256).

    The result is an int64 ``[N, L]`` tensor, or, when samples are shorter than the longest (conversations one per
    sample), a dict of ``input_ids`` right-padded and its ``attention_mask``. Every id must be below
    ``vocab_size`` and samples must fit the model's ``max_position_embeddings``; a
    :class:`~shardcal.errors.DataError` names the file, the record (or the option) otherwise.
    """
    import shardcal.data.token_data as data_mod

    model_dir = Path(model_dir)
    options = data_options or DataOptions()
    if num_samples is not None and num_samples < 1:
        raise DataError(f"{input_name(input_names, 'num_samples')} must be >= 1, got {num_samples}")
    if seq_len is not None and seq_len < 2:
        raise DataError(f"{input_name(input_names, 'seq_len')} must be >= 2, got {seq_len}")
    sources = sources_of(data)
    unmixable = [source for source in sources if not is_record_source(source.path)]
    if len(sources) > 1 and unmixable:
        raise DataError(
            f"{unmixable[0].path}: only records (.jsonl, .parquet, a directory of parquet files) can be mixed with "
            "other sources"
        )
    if sources and not unmixable:
        ids, source = load_calibration_data(model_dir, *sources, num_samples=num_samples,
                                            seq_len=seq_len, options=options, vocab_size=vocab_size)  # fmt: skip
    elif sources:
        path = sources[0].path
        count = sources[0].count if sources[0].count is not None else num_samples
        tokenizer = _tokenizer(model_dir) if not is_token_file(path) else None
        ids = data_mod.load_token_data(path, tokenizer, seq_len=seq_len, num_samples=count, vocab_size=vocab_size)
        source = str(path)
    else:
        ids = data_mod.token_blocks(
            _tokenizer(model_dir), num_samples, seq_len or data_mod.DEFAULT_SEQ_LEN, split=split
        )
        if vocab_size is not None and int(ids.max()) >= vocab_size:
            raise DataError(
                f"{model_dir}: its tokenizer produces id {int(ids.max())}, beyond the model's vocab_size {vocab_size}"
            )
        source = f"{'held-out' if split == 'eval' else 'calibration'} Wikipedia summaries"
    positions = text_field(raw_config(model_dir), "max_position_embeddings")
    longest = data_shape(ids)[1]
    if isinstance(positions, int) and longest > positions:
        raise DataError(
            f"{source}: sequences of {longest} tokens exceed {model_dir}'s max_position_embeddings={positions} "
            f"(pass a shorter {input_name(input_names, 'seq_len')})"
        )
    return ids, source


def _tokenizer(model_dir: Path):
    from ..io.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)
