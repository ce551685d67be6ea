"""Fuzzing the readers of untrusted files: only shardcal's own errors come out.

Each reader gets random and mutated input for a bounded number of examples (the file stays well under 30 s):

* the safetensors reader (``CheckpointReader`` and ``from_pretrained``): random bytes, valid files with flipped
  bytes, cut or extended, headers rewritten with fuzzed dtypes / shapes / offsets (terabytes included) and
  length prefixes that lie;
* the config reader (``load_config``): valid configs with fields replaced by arbitrary JSON values, arbitrary
  JSON documents, arbitrary bytes;
* the tokenizer reader (``Tokenizer.from_file``): a valid byte-level BPE tokenizer.json with parts replaced by
  arbitrary JSON (and plausible component types), arbitrary documents; what loads must also encode and decode;
* the recipe reader (``parse_recipe`` / ``recipe_from_dict``): arbitrary and mutated TOML text, valid recipes
  with values replaced by arbitrary TOML values, ``re:`` patterns;
* the calibration-checkpoint manifest (``CalibrationCheckpoint.load``) and the activation-collection one
  (``CollectionCheckpoint.load``).

"Clean" means: a :class:`~shardcal.errors.ShardcalError` subclass of the reader's kind (or success) — never another
exception, a hang (hypothesis deadlines are off, but every test runs in a few seconds) or a large allocation (the
process's peak RSS may not grow by more than :data:`RSS_BUDGET_MB` over the whole module).

Examples are derandomized for a stable suite; ``SHARDCAL_FUZZ_EXAMPLES=2000`` runs longer, randomized campaigns.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_gguf_tokenizer import byte_level_tokenizer_json

from shardcal.calib.calibration_checkpoint import MANIFEST, CalibrationCheckpoint
from shardcal.calib.recipes import parse_recipe, recipe_from_dict
from shardcal.collect.collection_checkpoint import MANIFEST as COLLECT_MANIFEST
from shardcal.collect.collection_checkpoint import CollectionCheckpoint, sha256
from shardcal.errors import (
    CalibrationCheckpointError,
    CheckpointError,
    ConfigError,
    RecipeError,
    ShardcalError,
    TokenizerError,
)
from shardcal.io.tokenizer import Tokenizer
from shardcal.models import from_pretrained, load_config
from shardcal.models.checkpoint import CheckpointReader

from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint

_CAMPAIGN = int(os.environ.get("SHARDCAL_FUZZ_EXAMPLES", "0"))
RSS_BUDGET_MB = 400
DATA_HEADROOM_MB = 2048


def fuzz(examples: int) -> settings:
    """Bounded, deterministic settings (or a randomized campaign of SHARDCAL_FUZZ_EXAMPLES examples)."""
    return settings(
        max_examples=_CAMPAIGN or examples,
        deadline=None,
        derandomize=not _CAMPAIGN,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _data_segment_mb() -> float | None:
    """This process's private writable memory (VmData), or None where /proc does not tell."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) / 1024
    return None


@pytest.fixture(scope="module", autouse=True)
def _memory_stays_small() -> Iterator[None]:
    """No fuzzed input may make a reader allocate for what a header claims (terabytes).

    While the module runs, RLIMIT_DATA caps new private memory at :data:`DATA_HEADROOM_MB` over what the process
    already has, so such an allocation fails (as a MemoryError or torch's RuntimeError — not a ShardcalError, so
    the example fails) instead of swapping; memory-mapped files do not count. Afterwards the peak RSS may not have
    grown by more than :data:`RSS_BUDGET_MB`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = peak_rss_mb()
    limits = resource.getrlimit(resource.RLIMIT_DATA)
    used = _data_segment_mb()
    if used is not None:
        cap = int((used + DATA_HEADROOM_MB) * 2**20)
        if limits[1] == resource.RLIM_INFINITY or cap < limits[1]:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, limits)
        torch.set_num_threads(threads)
    grown = peak_rss_mb() - before
    assert grown < RSS_BUDGET_MB, f"peak RSS grew by {grown:.0f} MB while fuzzing the readers"


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="shardcal-fuzz-") as tmp:
        yield Path(tmp)


def clean(expected: type[ShardcalError], action: Callable[[], Any]) -> Any:
    """Run ``action``; a ShardcalError of kind ``expected`` (one line, non-empty) is fine, anything else fails."""
    try:
        result = action()
    except expected as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
        event(f"refused: {message.split(': ', 2)[-1][:40]}")  # --hypothesis-show-statistics lists them
        return None
    event("accepted")
    return result


# ---------------------------------------------------------------------------------------------- JSON values

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 3, 16, 2**31, 2**31 + 1, 2**53, 2**63, 2**64, 10**13])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


def to_json(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


# ---------------------------------------------------------------------------------------------- safetensors

SAFETENSORS_DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "I64",
    "I32",
    "I16",
    "I8",
    "U64",
    "U32",
    "U16",
    "U8",
    "BOOL",
    "C64",
    "Q4",
    "",
]


def small_safetensors() -> bytes:
    """A valid file with tensors of several dtypes and ranks (and metadata)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        save_file(
            {
                "a": torch.arange(12, dtype=torch.float32).view(3, 4),
                "b": torch.ones(5, dtype=torch.bfloat16),
                "c": torch.arange(6, dtype=torch.int64).view(2, 3),
                "d": torch.zeros(2, 2, 2, dtype=torch.float16),
                "e": torch.tensor([True, False]),
                "scalar": torch.tensor(3.0),
            },
            str(path),
            metadata={"format": "pt"},
        )
        return path.read_bytes()


SMALL = small_safetensors()


def split_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_file(header: Any, body: bytes, length: int | None = None) -> bytes:
    blob = json.dumps(header, allow_nan=True).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob) if length is None else length) + blob + body


HEADER_FIELD_VALUES = {
    "dtype": st.sampled_from(SAFETENSORS_DTYPES) | JSON_VALUES,
    "shape": st.lists(
        st.integers(min_value=-2, max_value=2**64 - 1) | st.sampled_from([0, 1, 2**40, 10**13]), max_size=4
    )
    | JSON_VALUES,
    "data_offsets": st.lists(
        st.integers(min_value=-1, max_value=2**64 - 1) | st.sampled_from([0, 8, 48, 2**40, 10**13]), max_size=3
    )
    | JSON_VALUES,
}


@st.composite
def header_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` (a valid file) with its JSON header changed: a field of a tensor entry, an entry, or the length."""
    header, body = split_file(data)
    header = copy.deepcopy(header)
    keys = sorted(header)
    key = draw(st.sampled_from(keys + ["new.tensor"]))
    kind = draw(st.sampled_from(["field", "field", "field", "entry", "drop", "terabytes", "length"]))
    if kind == "field":
        entry = header.setdefault(key, {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
        if isinstance(entry, dict):
            name = draw(st.sampled_from(sorted(HEADER_FIELD_VALUES)))
            entry[name] = draw(HEADER_FIELD_VALUES[name])
    elif kind == "entry":
        header[key] = draw(JSON_VALUES)
    elif kind == "drop":
        header.pop(key, None)
    elif kind == "terabytes":  # a consistent-looking entry for a multi-terabyte tensor
        rows = draw(st.sampled_from([2**20, 10**9, 2**40]))
        header[key] = {"dtype": "F32", "shape": [rows, 1024], "data_offsets": [0, rows * 1024 * 4]}
    body_change = draw(st.sampled_from(["keep", "keep", "cut", "extend"]))
    if body_change == "cut":
        body = body[: draw(st.integers(0, len(body)))]
    elif body_change == "extend":
        body += draw(st.binary(max_size=64))
    length = None
    if kind == "length":
        length = draw(st.integers(min_value=0, max_value=2**64 - 1) | st.sampled_from([0, 1, 7, 2**40, 10**13, 2**63]))
    return join_file(header, body, length)


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with bytes overwritten (mostly in the header), cut short, or with bytes inserted."""
    out = bytearray(data)
    (length,) = struct.unpack("<Q", data[:8])
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "flip", "cut", "insert", "prefix"]))
        if not out:
            break
        if action == "flip":
            pos = draw(st.integers(0, min(len(out), 8 + length) - 1))
            out[pos] = draw(st.integers(0, 255))
        elif action == "cut":
            del out[draw(st.integers(0, len(out))) :]
        elif action == "insert":
            pos = draw(st.integers(0, len(out)))
            out[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            out[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    return bytes(out)


def safetensors_inputs(data: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=256),
        st.binary(max_size=64).map(lambda tail: struct.pack("<Q", len(tail)) + tail),
        header_mutations(data),
        byte_mutations(data),
    )


def exercise_reader(model_dir: Path) -> None:
    """Open the directory's checkpoint and read everything in it (shapes, dtypes, whole tensors, row slices)."""
    with CheckpointReader(model_dir) as reader:
        for key in reader.keys():
            reader.shape(key)
            reader.dtype_name(key)
            reader.dtype(key)
            reader.get(key)
            if reader.shape(key):
                reader.get_rows(key, 0, 1)


@fuzz(150)
@given(data=safetensors_inputs(SMALL))
def test_safetensors_reader_fuzz(workdir: Path, data: bytes) -> None:
    model_dir = workdir / "st"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "model.safetensors").write_bytes(data)
    clean(CheckpointError, lambda: exercise_reader(model_dir))


#: A very small llama (one layer, hidden 16, vocab 32; a 10 kB file) whose weights the next test mutates.
MICRO_LLAMA = dict(
    num_hidden_layers=1,
    vocab_size=32,
    hidden_size=16,
    intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module")
def micro_model(workdir: Path) -> Path:
    return make_tiny_checkpoint(workdir / "micro", "llama", **MICRO_LLAMA)


def _micro_llama_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return (make_tiny_checkpoint(tmp, "llama", **MICRO_LLAMA) / "model.safetensors").read_bytes()


MICRO_BYTES = _micro_llama_bytes()


@fuzz(80)
@given(data=st.one_of(header_mutations(MICRO_BYTES), byte_mutations(MICRO_BYTES)))
def test_from_pretrained_fuzzed_weights(micro_model: Path, data: bytes) -> None:
    (micro_model / "model.safetensors").write_bytes(data)
    clean(CheckpointError, lambda: from_pretrained(micro_model))


def _npy_bytes() -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.arange(32, dtype=np.int64).reshape(4, 8), allow_pickle=False)
    return buffer.getvalue()


NPY = _npy_bytes()
IDS_SAFETENSORS = join_file({"input_ids": {"dtype": "I64", "shape": [2, 4], "data_offsets": [0, 64]}}, bytes(64))


@fuzz(200)
@given(
    case=st.one_of(
        st.tuples(st.just(".npy"), byte_mutations(NPY) | st.binary(max_size=128)),
        st.tuples(st.just(".safetensors"), safetensors_inputs(IDS_SAFETENSORS)),
    )
)
def test_data_file_reader_fuzz(workdir: Path, case: tuple[str, bytes]) -> None:
    """``--data`` token-id files (.npy read without pickle, .safetensors): only DataError."""
    from shardcal.data.token_data import load_token_data
    from shardcal.errors import DataError

    suffix, data = case
    path = workdir / f"ids{suffix}"
    path.write_bytes(data)
    clean(DataError, lambda: load_token_data(path, seq_len=4, num_samples=2, vocab_size=64))


@pytest.mark.parametrize(
    "make",
    [
        lambda: struct.pack("<Q", 10 * 10**12) + b"{}" + b" " * 6,  # length prefix: 10 TB of header
        lambda: join_file({"w": {"dtype": "F32", "shape": [10**12, 2500], "data_offsets": [0, 10**16]}}, b"\0" * 16),
        lambda: join_file({"w": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 16]}}, b"\0" * 16),
        lambda: join_file({"w": {"dtype": "U8", "shape": [10**13], "data_offsets": [0, 10**13]}}, b""),
    ],
    ids=["header-length-10TB", "tensor-40PB", "shape-overflows", "tensor-10TB-no-data"],
)
def test_terabyte_claims_fail_fast_and_cleanly(workdir: Path, make: Callable[[], bytes]) -> None:
    model_dir = workdir / "tb"
    model_dir.mkdir(exist_ok=True)
    path = model_dir / "model.safetensors"
    path.write_bytes(make())
    before, start = peak_rss_mb(), time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        exercise_reader(model_dir)
    assert time.perf_counter() - start < 2.0
    assert peak_rss_mb() - before < 100
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_data_file_claiming_terabytes(workdir: Path) -> None:
    """The ``--data`` safetensors reader refuses the same lies just as fast."""
    from shardcal.data.token_data import load_token_data
    from shardcal.errors import DataError

    path = workdir / "ids.safetensors"
    path.write_bytes(
        join_file({"input_ids": {"dtype": "I64", "shape": [10**12, 1000], "data_offsets": [0, 8 * 10**15]}}, b"\0" * 64)
    )
    start = time.perf_counter()
    with pytest.raises(DataError, match="not a readable safetensors file"):
        load_token_data(path)
    path.write_bytes(struct.pack("<Q", 10 * 10**12) + b"{}")
    with pytest.raises(DataError, match="not a readable safetensors file"):
        load_token_data(path)
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------------------------------------- config.json

CONFIG_FIELDS = sorted(
    {key for cfg in TINY_CONFIGS.values() for key in cfg}
    | {
        "head_dim",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "torch_dtype",
        "dtype",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "use_sliding_window",
        "layer_types",
        "max_window_layers",
        "num_local_experts",
        "num_experts",
        "qkv_bias",
        "original_max_position_embeddings",
        "quantization_config",
    }
)
ROPE_DICTS = st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn", "longrope"]) | JSON_SCALARS},
    optional={
        key: JSON_SCALARS
        for key in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
            "rope_theta",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "truncate",
            "type",
            "partial_rotary_factor",
        )
    },
)


@st.composite
def fuzzed_configs(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["fields", "fields", "fields", "document", "text"]))
    if kind == "document":
        return to_json(draw(JSON_VALUES))
    if kind == "text":
        return draw(st.text(max_size=64))
    raw = copy.deepcopy(TINY_CONFIGS[draw(st.sampled_from(sorted(TINY_CONFIGS)))])
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(CONFIG_FIELDS) | st.text(max_size=6))
        action = draw(st.sampled_from(["value", "value", "rope", "delete"]))
        if action == "delete":
            raw.pop(key, None)
        elif action == "rope":
            raw[draw(st.sampled_from(["rope_scaling", "rope_parameters"]))] = draw(ROPE_DICTS)
        else:
            raw[key] = draw(JSON_VALUES)
    return to_json(raw)


@fuzz(150)
@given(text=fuzzed_configs())
def test_config_reader_fuzz(workdir: Path, text: str) -> None:
    model_dir = workdir / "cfg"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    clean(ConfigError, lambda: load_config(model_dir))


@fuzz(60)
@given(data=st.binary(max_size=64))
def test_config_reader_bytes(workdir: Path, data: bytes) -> None:
    model_dir = workdir / "cfg-bytes"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_bytes(data)
    clean(ConfigError, lambda: load_config(model_dir))


# ---------------------------------------------------------------------------------------------- tokenizer.json

TOKENIZER_PATHS = [
    (),
    ("model",),
    ("model", "type"),
    ("model", "vocab"),
    ("model", "merges"),
    ("model", "unk_token"),
    ("model", "dropout"),
    ("model", "ignore_merges"),
    ("model", "continuing_subword_prefix"),
    ("added_tokens",),
    ("added_tokens", 0),
    ("added_tokens", 0, "content"),
    ("added_tokens", 0, "id"),
    ("added_tokens", 0, "special"),
    ("normalizer",),
    ("pre_tokenizer",),
    ("pre_tokenizer", "pretokenizers"),
    ("pre_tokenizer", "pretokenizers", 0),
    ("pre_tokenizer", "pretokenizers", 1),
    ("pre_tokenizer", "pretokenizers", 1, "use_regex"),
    ("post_processor",),
    ("decoder",),
    ("decoder", "type"),
]
COMPONENT_TYPES = [
    "BPE",
    "WordPiece",
    "ByteLevel",
    "Split",
    "Digits",
    "Sequence",
    "NFC",
    "NFKD",
    "Lowercase",
    "TemplateProcessing",
    "Metaspace",
    "Strip",
    "Unigram",
    "Replace",
    "Prepend",
    "ByteFallback",
    "Fuse",
    "Whitespace",
    "Punctuation",
]
COMPONENTS = st.fixed_dictionaries(
    {"type": st.sampled_from(COMPONENT_TYPES)},
    optional={
        key: JSON_VALUES
        for key in (
            "pretokenizers",
            "normalizers",
            "processors",
            "decoders",
            "pattern",
            "behavior",
            "invert",
            "individual_digits",
            "add_prefix_space",
            "use_regex",
            "single",
            "pair",
            "special_tokens",
            "vocab",
            "merges",
            "replacement",
            "prepend_scheme",
            "split",
            "content",
            "prepend",
            "unk_id",
            "byte_fallback",
            "start",
            "stop",
        )
    },
)
PATTERNS = st.fixed_dictionaries({}, optional={"Regex": st.text(max_size=12) | JSON_SCALARS, "String": JSON_SCALARS})
TEMPLATE = st.fixed_dictionaries(
    {
        "type": st.just("TemplateProcessing"),
        "single": st.lists(
            st.sampled_from([{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<s>", "type_id": 0}}])
            | JSON_VALUES,
            max_size=3,
        ),
        "special_tokens": st.dictionaries(
            st.sampled_from(["<s>", "x"]), JSON_VALUES | st.fixed_dictionaries({"ids": JSON_VALUES}), max_size=2
        )
        | JSON_VALUES,
    },
)


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    target = doc
    for part in path[:-1]:
        try:
            target = target[part]
        except (KeyError, IndexError, TypeError):
            return doc
    try:
        target[path[-1]] = value
    except (IndexError, TypeError):
        pass
    return doc


@st.composite
def fuzzed_tokenizers(draw: st.DrawFn) -> Any:
    doc = byte_level_tokenizer_json()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(TOKENIZER_PATHS))
        value = draw(
            JSON_VALUES | COMPONENTS | TEMPLATE | st.builds(lambda p: {"type": "Split", "pattern": p}, PATTERNS)
        )
        doc = _set(doc, path, value)
    return doc


def exercise_tokenizer(path: Path) -> None:
    tokenizer = Tokenizer.from_file(path)
    for text in ("Hello world 123", " <|endoftext|> x", "ünï\u2028code\n\n", ""):
        ids = tokenizer.encode(text, add_special_tokens=True)
        tokenizer.decode(ids)
    assert tokenizer.vocab_size >= 0


@fuzz(120)
@given(doc=fuzzed_tokenizers())
def test_tokenizer_reader_fuzz(workdir: Path, doc: Any) -> None:
    path = workdir / "tok" / "tokenizer.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(to_json(doc), encoding="utf-8", errors="surrogatepass")
    clean(TokenizerError, lambda: exercise_tokenizer(path))


@fuzz(60)
@given(doc=JSON_VALUES, config=st.none() | JSON_VALUES)
def test_tokenizer_reader_arbitrary_documents(workdir: Path, doc: Any, config: Any) -> None:
    """Any document, with any tokenizer_config.json beside it (bos/eos come from there)."""
    folder = workdir / "tok-doc"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(to_json(doc), encoding="utf-8", errors="surrogatepass")
    if config is None:
        (folder / "tokenizer_config.json").unlink(missing_ok=True)
    else:
        (folder / "tokenizer_config.json").write_text(
            to_json({"bos_token": config, "eos_token": config}), errors="surrogatepass"
        )
    clean(TokenizerError, lambda: exercise_tokenizer(folder / "tokenizer.json"))


@fuzz(40)
@given(config=JSON_VALUES)
def test_tokenizer_special_tokens_config_fuzz(workdir: Path, config: Any) -> None:
    """A valid tokenizer.json with an arbitrary tokenizer_config.json / config.json next to it."""
    folder = workdir / "tok-cfg"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (folder / "tokenizer_config.json").write_text(
        to_json({"bos_token": config, "eos_token": config}), errors="surrogatepass"
    )
    (folder / "config.json").write_text(
        to_json({"bos_token_id": config, "eos_token_id": config}), errors="surrogatepass"
    )
    clean(TokenizerError, lambda: exercise_tokenizer(folder / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------- recipes

VALID_RECIPE = """\
name = "fuzz"
description = "a valid recipe that the fuzzer mutates"

[targets]
include = ["*", "re:model\\\\.layers\\\\.\\\\d+\\\\..*"]
exclude = ["*.down_proj"]
default_excludes = true

[weight]
format = "int4"
granularity = "group"
group_size = 32
observer = { name = "mse", max_shrink = 0.3 }

[input]
format = "int8"
granularity = "tensor"
observer = "max"

[algorithm]
name = "rtn"
"""

TOML_SCALARS = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "int8",
            "int4",
            "fp8_e4m3",
            "nvfp4",
            "tensor",
            "channel",
            "group",
            "max",
            "mse",
            "percentile",
            "rtn",
            "gptq",
            "awq",
            "smoothquant",
            "re:(",
            "re:a{4294967296}",
            "re:" + "(" * 600 + ")" * 600,
            "re:[",
            "*",
            "",
        ]
    )
)
TOML_VALUES = st.recursive(
    TOML_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
RECIPE_PATHS = [
    ("name",),
    ("description",),
    ("targets",),
    ("targets", "include"),
    ("targets", "exclude"),
    ("targets", "default_excludes"),
    ("weight",),
    ("weight", "format"),
    ("weight", "granularity"),
    ("weight", "group_size"),
    ("weight", "axis"),
    ("weight", "observer"),
    ("weight", "observer", "max_shrink"),
    ("weight", "observer", "name"),
    ("weight", "symmetric"),
    ("weight", "dynamic"),
    ("input",),
    ("input", "observer"),
    ("input", "observer", "percentile"),
    ("input", "dynamic"),
    ("input", "granularity"),
    ("input", "axis"),
    ("output",),
    ("algorithm",),
    ("algorithm", "name"),
    ("algorithm", "alpha"),
    ("algorithm", "block_size"),
    ("algorithm", "dampening"),
    ("unknown",),
]


def _set_or_create(data: dict[str, Any], path: tuple, value: Any) -> None:
    """``data[path] = value``, replacing missing or non-table parents with tables."""
    for part in path[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[path[-1]] = value


def _delete(data: dict[str, Any], path: tuple) -> None:
    for part in path[:-1]:
        data = data.get(part) if isinstance(data, dict) else None
    if isinstance(data, dict):
        data.pop(path[-1], None)


@st.composite
def fuzzed_recipe_dicts(draw: st.DrawFn) -> dict[str, Any]:
    import tomllib

    data = tomllib.loads(VALID_RECIPE)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(RECIPE_PATHS))
        if draw(st.integers(0, 3)) == 0:
            _delete(data, path)
        elif path == ("algorithm", "name"):
            _set_or_create(data, path, draw(st.sampled_from(["rtn", "gptq", "awq", "smoothquant"]) | TOML_VALUES))
        else:
            _set_or_create(data, path, draw(TOML_VALUES))
    return data


@fuzz(200)
@given(data=fuzzed_recipe_dicts())
def test_recipe_from_dict_fuzz(data: dict[str, Any]) -> None:
    clean(RecipeError, lambda: recipe_from_dict(data, "fuzz.toml"))


TOML_LITERALS = ["1", "-1", "0", "1e400", "nan", "inf", "true", "[]", "{}", '[1, "a"]', '"re:("', "2024-01-01", '"x"']


@st.composite
def mutated_toml(draw: st.DrawFn) -> str:
    text = VALID_RECIPE
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace-value"]))
        if action == "insert":
            text = (
                text[:pos]
                + draw(st.text(alphabet=st.sampled_from('[]{}"=,.#\n 0123456789abcre:*\\'), max_size=6))
                + text[pos:]
            )
        elif action == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 8)) :]
        else:
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            if " = " in lines[i]:
                key = lines[i].split(" = ")[0]
                lines[i] = f"{key} = {draw(st.sampled_from(TOML_LITERALS))}"
            text = "\n".join(lines)
    return text


@fuzz(200)
@given(text=mutated_toml() | st.text(max_size=80))
def test_parse_recipe_fuzz(text: str) -> None:
    clean(RecipeError, lambda: parse_recipe(text, "fuzz.toml"))


@fuzz(100)
@given(
    pattern=st.text(max_size=16) | st.sampled_from(["a{4294967296}", "(" * 1200 + ")" * 1200, "a{2,1}", "(?P<x", "\\"])
)
def test_recipe_regex_patterns(pattern: str) -> None:
    """Any ``re:`` pattern compiles or is refused as an invalid regular expression naming the key."""
    for key in ("include", "exclude"):
        data = {"targets": {key: ["*", "re:" + pattern]}, "weight": {"format": "int8"}}
        try:
            recipe_from_dict(data, "fuzz.toml")
        except RecipeError as exc:
            assert str(exc).startswith(f"fuzz.toml: key 'targets.{key}[1]': invalid regular expression"), str(exc)


# ---------------------------------------------------------------------------------------------- GGUF import


def _tiny_gguf_bytes() -> bytes:
    try:
        from test_gguf_tokenizer import tiny_state_dict, write_tiny_gguf

        with tempfile.TemporaryDirectory() as tmp:
            state = tiny_state_dict(vocab=270, hidden=32, intermediate=32, layers=1, heads=2, kv_heads=1)
            return write_tiny_gguf(Path(tmp) / "t.gguf", state, quant="Q8_0").read_bytes()
    except ImportError:  # the gguf package (writer and dequantizer) is optional
        return b""


GGUF = _tiny_gguf_bytes()


@st.composite
def gguf_mutations(draw: st.DrawFn) -> bytes:
    """The tiny GGUF file with bytes of its metadata / tensor infos overwritten (u8 or u64), cut, or inserted."""
    out = bytearray(GGUF)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "flip", "u64", "cut", "insert"]))
        head = min(len(out), 2048)
        if action == "flip" and head:
            out[draw(st.integers(0, head - 1))] = draw(st.integers(0, 255))
        elif action == "u64" and head >= 8:
            pos = draw(st.integers(0, head - 8))
            out[pos : pos + 8] = draw(st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**31, 2**40, 2**63])).to_bytes(
                8, "little"
            )
        elif action == "cut":
            del out[draw(st.integers(0, len(out))) :]
        elif action == "insert":
            pos = draw(st.integers(0, head))
            out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


@pytest.mark.skipif(not GGUF, reason="needs the gguf package")
@fuzz(60)
@given(data=gguf_mutations())
def test_gguf_import_fuzz(workdir: Path, data: bytes) -> None:
    """``import_gguf`` of a corrupted file: a ShardcalError (CheckpointError, TokenizerError, ...) and nothing written."""
    import shutil

    from shardcal.io.gguf import import_gguf

    folder = workdir / "gguf"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "m.gguf").write_bytes(data)
    if clean(ShardcalError, lambda: import_gguf(folder / "m.gguf", folder / "out")) is None:
        assert sorted(p.name for p in folder.iterdir()) == ["m.gguf"]


# ---------------------------------------------------------------------------------------------- calibration checkpoint

FINGERPRINT = {"model": "m", "model_weights": "1", "recipe": "r", "data": "d", "options": "o"}
MANIFEST_PATHS = [
    (),
    ("format_version",),
    ("fingerprint",),
    ("fingerprint", "model"),
    ("completed_layers",),
    ("num_layers",),
    ("files",),
    ("files", "quantizers-L00001.safetensors"),
    ("files", "activations-L00001-rank00000.safetensors"),
    ("report",),
    ("batches",),
    ("batches", "0"),
    ("weights",),
    ("weights", "w"),
    ("quantizers",),
]


@st.composite
def fuzzed_manifests(draw: st.DrawFn) -> str:
    manifest = {
        "format_version": 2,
        "fingerprint": dict(FINGERPRINT),
        "completed_layers": 1,
        "num_layers": 2,
        "files": {"quantizers-L00001.safetensors": "0" * 64, "activations-L00001-rank00000.safetensors": "0" * 64},
        "report": [{"index": 0, "name": "model.layers.0", "seconds": 0.1, "sqnr_db": 30.0}],
        "batches": {"0": "activations-L00001-rank00000.safetensors"},
        "weights": {"w": [["activations-L00001-rank00000.safetensors", 0, 2]]},
        "quantizers": "quantizers-L00001.safetensors",
    }
    for _ in range(draw(st.integers(1, 3))):
        manifest = _set(manifest, draw(st.sampled_from(MANIFEST_PATHS)), draw(JSON_VALUES))
    return to_json(manifest)


@fuzz(100)
@given(text=fuzzed_manifests() | st.text(max_size=40))
def test_calibration_manifest_fuzz(workdir: Path, text: str) -> None:
    folder = workdir / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / MANIFEST).write_text(text, encoding="utf-8", errors="surrogatepass")
    (folder / "quantizers-L00001.safetensors").write_bytes(SMALL)
    (folder / "activations-L00001-rank00000.safetensors").write_bytes(SMALL)
    checkpoint = CalibrationCheckpoint(folder, dict(FINGERPRINT), rank=0, world_size=1)
    clean(CalibrationCheckpointError, lambda: checkpoint.load([0, 1]))


# ---------------------------------------------------------------------------------------------- collection checkpoint

COLLECT_FINGERPRINT = {"model": "m", "model_weights": "w", "data": "d", "targets": ["t:output"], "bins": 64}
STATS_FILE, INPUTS_FILE = "stats-L00000.safetensors", "inputs-L00001-B000000.safetensors"
COLLECT_PATHS = [
    (),
    ("format",),
    ("format_version",),
    ("fingerprint",),
    ("fingerprint", "targets"),
    ("completed_layers",),
    ("finished",),
    ("files",),
    ("files", STATS_FILE),
    ("files", INPUTS_FILE),
    ("batches",),
    ("batches", "0"),
    ("layers",),
    ("layers", 0),
    ("layers", 0, "layer"),
    ("layers", 0, "stats"),
    ("layers", 0, "targets"),
    ("layers", 0, "targets", 0),
    ("layers", 0, "targets", 0, "name"),
    ("layers", 0, "targets", 0, "tokens"),
    ("layers", 0, "targets", 0, "top_channels"),
]


def _collection_files(folder: Path) -> dict[str, str]:
    save_file({"t:output/absmax": torch.ones(2)}, str(folder / STATS_FILE))
    save_file({"hidden": torch.zeros(1, 2, 2)}, str(folder / INPUTS_FILE))
    return {name: sha256(folder / name) for name in (STATS_FILE, INPUTS_FILE)}


@st.composite
def fuzzed_collection_manifests(draw: st.DrawFn, digests: dict[str, str]) -> str:
    summary = {"name": "t:output", "pattern": "t", "layer": 0, "channels": 2, "tokens": 3, "top_channels": [[0, 1.0]]}
    manifest = {
        "format": "shardcal-collect-checkpoint",
        "format_version": 1,
        "fingerprint": dict(COLLECT_FINGERPRINT),
        "completed_layers": 1,
        "finished": False,
        "files": dict(digests),
        "batches": {"0": INPUTS_FILE},
        "layers": [{"layer": 0, "stats": STATS_FILE, "targets": [summary]}],
    }
    for _ in range(draw(st.integers(0, 3))):
        manifest = _set(manifest, draw(st.sampled_from(COLLECT_PATHS)), draw(JSON_VALUES))
    return to_json(manifest)


@fuzz(100)
@given(data=st.data())
def test_collection_manifest_fuzz(workdir: Path, data: st.DataObject) -> None:
    folder = workdir / "collect-ckpt"
    folder.mkdir(exist_ok=True)
    digests = _collection_files(folder)
    text = data.draw(fuzzed_collection_manifests(digests) | st.text(max_size=40))
    (folder / COLLECT_MANIFEST).write_text(text, encoding="utf-8", errors="surrogatepass")
    checkpoint = CollectionCheckpoint(folder, dict(COLLECT_FINGERPRINT))
    clean(CalibrationCheckpointError, lambda: checkpoint.load([0]))
