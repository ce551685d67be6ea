"""Bad model directories fail with a ShardcalError whose one-line message names the file and the key or field."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardcal.errors import CheckpointError, ConfigError, ShardcalError
from shardcal.models import ModelConfig, from_pretrained, load_config
from shardcal.models.checkpoint import INDEX_NAME, CheckpointReader

from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint

WEIGHTS = "model.safetensors"
KEY = "model.layers.0.self_attn.q_proj.weight"


def load_error(model_dir: Path, error: type[ShardcalError], *fragments: str) -> str:
    """``from_pretrained(model_dir)`` raises ``error``; its one-line message contains every fragment."""
    with pytest.raises(error) as info:
        from_pretrained(model_dir)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def write_config(model_dir: Path, **changes: Any) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


_DELETE = object()


def rewrite_weights(model_dir: Path, change: Any) -> Path:
    path = model_dir / WEIGHTS
    state = load_file(path)
    change(state)
    save_file(state, path)
    return path


def shard(model_dir: Path) -> tuple[Path, dict[str, str]]:
    """Split ``model.safetensors`` into two shards + an index, as transformers writes them."""
    state = load_file(model_dir / WEIGHTS)
    keys = sorted(state)
    halves = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(halves, start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, model_dir / name)
        weight_map.update({k: name for k in part})
    (model_dir / WEIGHTS).unlink()
    index = model_dir / INDEX_NAME
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index, weight_map


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_tiny_checkpoint(tmp_path, "llama")


# --- config.json ----------------------------------------------------------------------------------------------


def test_not_a_directory(tmp_path: Path) -> None:
    load_error(tmp_path / "nowhere", ConfigError, str(tmp_path / "nowhere"), "not a directory")


def test_config_missing(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    load_error(model_dir, ConfigError, str(model_dir / "config.json"), "missing")


def test_config_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"model_type": "llama",')
    load_error(model_dir, ConfigError, str(model_dir / "config.json"), "not valid JSON")


def test_config_not_utf8(model_dir: Path) -> None:
    (model_dir / "config.json").write_bytes(b"\xff\xfe{}")
    load_error(model_dir, ConfigError, str(model_dir / "config.json"), "not valid JSON")


@pytest.mark.parametrize("content", ["[1, 2]", '"llama"', "null", "3"])
def test_config_not_an_object(model_dir: Path, content: str) -> None:
    (model_dir / "config.json").write_text(content)
    load_error(model_dir, ConfigError, str(model_dir / "config.json"), "expected a JSON object")


def test_unknown_model_type(model_dir: Path) -> None:
    path = write_config(model_dir, model_type="gpt2")
    load_error(model_dir, ConfigError, str(path), "model_type", "'gpt2'", "llama")


def test_model_type_missing(model_dir: Path) -> None:
    path = write_config(model_dir, model_type=_DELETE)
    load_error(model_dir, ConfigError, str(path), "'model_type'", "missing")


# (field, bad value, text the message must contain besides the file and the field name)
BAD_FIELDS: list[tuple[str, Any, str]] = [
    ("hidden_size", "64", "'64'"),
    ("hidden_size", 64.0, "integer"),
    ("hidden_size", True, "integer"),
    ("num_hidden_layers", 0, ">= 1"),
    ("num_hidden_layers", None, "integer"),
    ("vocab_size", _DELETE, "missing"),
    ("intermediate_size", -5, ">= 1"),
    ("num_attention_heads", [4], "integer"),
    ("num_key_value_heads", 3, "multiple"),
    ("head_dim", 15, "even"),
    ("vocab_size", 2**40, "implausibly large"),
    ("rms_norm_eps", "1e-6", "positive number"),
    ("rms_norm_eps", 0, "positive number"),
    ("rope_theta", "10000", "positive number"),
    ("rope_theta", -1.0, "positive number"),
    ("tie_word_embeddings", "false", "true or false"),
    ("tie_word_embeddings", 0, "true or false"),
    ("attention_bias", "yes", "true or false"),
    ("hidden_act", "swiglu", "not supported"),
    ("hidden_act", 3, "string"),
    ("max_position_embeddings", "2048", "integer"),
    ("torch_dtype", "int8", "'int8'"),
    ("torch_dtype", 16, "16"),
    ("dtype", "float64", "'float64'"),
    ("eos_token_id", "</s>", "integers"),
    ("rope_scaling", "linear", "object"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
    ("rope_scaling", {"rope_type": "linear"}, "factor"),
    ("rope_scaling", {"type": "dynamic", "factor": "2"}, "factor"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}, "differ"),
    (
        "rope_scaling",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "4k"},
        "original_max_position_embeddings",
    ),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "truncate"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}, "beta_fast"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0}, "rope_parameters.factor"),
    ("rope_parameters", ["default"], "object"),
    ("partial_rotary_factor", 0.5, "0.5"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_FIELDS, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_config_field(model_dir: Path, field: str, value: Any, expected: str) -> None:
    path = write_config(model_dir, **{field: value})
    load_error(model_dir, ConfigError, str(path), field, expected)


# (model_type, field, bad value, text the message must contain besides the file and the field name)
BAD_FAMILY_FIELDS: list[tuple[str, str, Any, str]] = [
    ("mixtral", "num_local_experts", _DELETE, "missing"),
    ("mixtral", "num_local_experts", "4", "integer"),
    ("mixtral", "num_experts_per_tok", 5, "exceeds"),
    ("qwen3_moe", "num_experts", 0, ">= 1"),
    ("qwen3_moe", "moe_intermediate_size", _DELETE, "missing"),
    ("qwen3_moe", "mlp_only_layers", [0, "1"], "list of integers"),
    ("qwen3_moe", "decoder_sparse_step", 0, ">= 1"),
    ("qwen3_moe", "norm_topk_prob", 1, "true or false"),
    ("qwen2_moe", "shared_expert_intermediate_size", _DELETE, "missing"),
    ("qwen2_moe", "qkv_bias", "true", "true or false"),
    ("qwen2", "use_sliding_window", "yes", "true or false"),
    ("mistral", "sliding_window", "4096", "integer"),
]


@pytest.mark.parametrize(("model_type", "field", "value", "expected"), BAD_FAMILY_FIELDS)
def test_bad_family_config_field(tmp_path: Path, model_type: str, field: str, value: Any, expected: str) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, model_type)
    path = write_config(model_dir, **{field: value})
    load_error(model_dir, ConfigError, str(path), field, expected)


def test_bad_layer_types(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "qwen2")
    path = write_config(model_dir, use_sliding_window=True, sliding_window=4, layer_types=["full_attention"])
    load_error(model_dir, ConfigError, str(path), "layer_types", "2 entries")


def test_expert_count_spellings_disagree(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "qwen3_moe")
    path = write_config(model_dir, num_local_experts=8)
    load_error(model_dir, ConfigError, str(path), "num_local_experts", "num_experts", "disagree")


def test_from_dict_names_the_source() -> None:
    raw = {**TINY_CONFIGS["llama"], "hidden_size": "64"}
    with pytest.raises(ConfigError, match=r"my-config: field 'hidden_size'"):
        ModelConfig.from_dict(raw, source="my-config")
    with pytest.raises(ConfigError, match="my-config: expected a JSON object"):
        ModelConfig.from_dict([], source="my-config")  # type: ignore[arg-type]


def test_load_config_alone(model_dir: Path) -> None:
    assert load_config(model_dir).model_type == "llama"
    write_config(model_dir, hidden_size="64")
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(model_dir)


# --- model.safetensors ----------------------------------------------------------------------------------------


def test_no_weights(model_dir: Path) -> None:
    (model_dir / WEIGHTS).unlink()
    load_error(model_dir, CheckpointError, str(model_dir), WEIGHTS, INDEX_NAME)


def test_only_pickled_weights(model_dir: Path) -> None:
    (model_dir / WEIGHTS).rename(model_dir / "pytorch_model.bin")
    load_error(model_dir, CheckpointError, str(model_dir), "pickled")


@pytest.mark.parametrize("keep", [0, 5, 100, -16], ids=["empty", "8-byte-prefix-cut", "inside-header", "data-cut"])
def test_truncated_safetensors(model_dir: Path, keep: int) -> None:
    path = model_dir / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    load_error(model_dir, CheckpointError, str(path), "not a readable safetensors file")


def test_corrupt_header(model_dir: Path) -> None:
    path = model_dir / WEIGHTS
    data = bytearray(path.read_bytes())
    data[8:24] = b"#not-json-at-all"
    path.write_bytes(bytes(data))
    load_error(model_dir, CheckpointError, str(path), "not a readable safetensors file")


def test_absurd_header_length(model_dir: Path) -> None:
    path = model_dir / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    load_error(model_dir, CheckpointError, str(path), "not a readable safetensors file")


def test_header_offsets_beyond_the_file(model_dir: Path) -> None:
    """A well-formed header whose offsets point past the end of the data."""
    path = model_dir / WEIGHTS
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    begin, end = header[KEY]["data_offsets"]
    header[KEY]["data_offsets"] = [begin + 10**9, end + 10**9]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + length :])
    load_error(model_dir, CheckpointError, str(path))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_weight(model_dir: Path, dtype: torch.dtype) -> None:
    path = rewrite_weights(model_dir, lambda s: s.__setitem__(KEY, torch.ones_like(s[KEY], dtype=dtype)))
    load_error(model_dir, CheckpointError, str(path), KEY, "dtype", "float")


def test_missing_key(model_dir: Path) -> None:
    path = rewrite_weights(model_dir, lambda s: s.pop(KEY))
    load_error(model_dir, CheckpointError, str(path), KEY, "missing")


def test_many_missing_keys_are_summarised(model_dir: Path) -> None:
    def drop_layer_1(state: dict[str, torch.Tensor]) -> None:
        for key in [k for k in state if k.startswith("model.layers.1.")]:
            del state[key]

    path = rewrite_weights(model_dir, drop_layer_1)
    message = load_error(model_dir, CheckpointError, str(path), "9 tensor(s)", "model.layers.1.", "and 4 more")
    assert len(message) < 600


def test_extra_key(model_dir: Path) -> None:
    path = rewrite_weights(model_dir, lambda s: s.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(2, 2)))
    load_error(model_dir, CheckpointError, str(path), "model.layers.7.mlp.up_proj.weight", "unexpected")


def test_rotary_inv_freq_is_ignored(model_dir: Path) -> None:
    """Older checkpoints store each layer's rotary table; it is skipped (the tables are computed from the config), so
    the logits are those of the same checkpoint without it; a key that only looks like it is still refused."""
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = from_pretrained(model_dir)(ids)
    rewrite_weights(model_dir, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    with torch.no_grad():
        assert torch.equal(from_pretrained(model_dir)(ids), want)
    rewrite_weights(model_dir, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freqs", torch.ones(8)))
    load_error(model_dir, CheckpointError, "model.layers.0.self_attn.rotary_emb.inv_freqs", "unexpected")


def test_shape_mismatch(model_dir: Path) -> None:
    path = rewrite_weights(model_dir, lambda s: s.__setitem__(KEY, torch.zeros(32, 64)))
    load_error(model_dir, CheckpointError, str(path), KEY, "[32, 64]", "[64, 64]")


def test_config_and_weights_disagree(model_dir: Path) -> None:
    """A config for a bigger model than the weights: the first mismatching tensor is named."""
    write_config(model_dir, intermediate_size=256)
    load_error(model_dir, CheckpointError, str(model_dir / WEIGHTS), "mlp", "[256, 64]")


def test_tied_lm_head_with_wrong_shape(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    path = rewrite_weights(model_dir, lambda s: s.__setitem__("lm_head.weight", torch.zeros(10, 64)))
    load_error(model_dir, CheckpointError, str(path), "lm_head.weight", "[10, 64]")


# --- sharded checkpoints --------------------------------------------------------------------------------------


def test_sharded_loads(model_dir: Path) -> None:
    expected = from_pretrained(model_dir).state_dict()
    index, _ = shard(model_dir)
    with CheckpointReader(model_dir) as reader:
        assert reader.source == index
    got = from_pretrained(model_dir).state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_index_names_a_missing_file(model_dir: Path) -> None:
    index, weight_map = shard(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    key = next(k for k, v in weight_map.items() if v == "model-00002-of-00002.safetensors")
    load_error(model_dir, CheckpointError, str(index), "model-00002-of-00002.safetensors", key, "does not exist")


@pytest.mark.parametrize("content", ['{"weight_map": {', "\x00\x01", ""], ids=["cut", "binary", "empty"])
def test_index_not_json(model_dir: Path, content: str) -> None:
    index, _ = shard(model_dir)
    index.write_text(content)
    load_error(model_dir, CheckpointError, str(index), "not valid JSON")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ([], "expected a JSON object"),
        ({"metadata": {}}, "weight_map"),
        ({"weight_map": {}}, "weight_map"),
        ({"weight_map": ["model-00001-of-00002.safetensors"]}, "weight_map"),
        ({"weight_map": {KEY: 7}}, KEY),
    ],
    ids=["list", "no-weight-map", "empty-weight-map", "weight-map-list", "file-not-a-string"],
)
def test_index_malformed(model_dir: Path, content: Any, expected: str) -> None:
    index, _ = shard(model_dir)
    index.write_text(json.dumps(content))
    load_error(model_dir, CheckpointError, str(index), expected)


def test_index_points_outside_the_model_dir(model_dir: Path) -> None:
    index, weight_map = shard(model_dir)
    (model_dir.parent / "elsewhere.safetensors").write_bytes((model_dir / weight_map[KEY]).read_bytes())
    weight_map[KEY] = "../elsewhere.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    load_error(model_dir, CheckpointError, str(index), KEY, "outside")


def test_index_lists_a_key_its_shard_lacks(model_dir: Path) -> None:
    index, weight_map = shard(model_dir)
    other = next(name for name in set(weight_map.values()) if name != weight_map[KEY])
    weight_map[KEY] = other
    index.write_text(json.dumps({"weight_map": weight_map}))
    load_error(model_dir, CheckpointError, str(model_dir / other), KEY, "not in the file")


def test_index_misses_a_key(model_dir: Path) -> None:
    index, weight_map = shard(model_dir)
    del weight_map[KEY]
    index.write_text(json.dumps({"weight_map": weight_map}))
    load_error(model_dir, CheckpointError, str(index), KEY, "missing")


def test_truncated_shard(model_dir: Path) -> None:
    index, _ = shard(model_dir)
    path = model_dir / "model-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-32])
    load_error(model_dir, CheckpointError, str(path), "not a readable safetensors file")


# --- the reader on its own ------------------------------------------------------------------------------------


def test_reader_errors_name_file_and_key(model_dir: Path) -> None:
    with CheckpointReader(model_dir) as reader:
        with pytest.raises(CheckpointError, match=rf"{WEIGHTS}: tensor 'nope' is missing"):
            reader.get("nope")
        with pytest.raises(CheckpointError, match="'nope'"):
            reader.shape("nope")
        assert reader.dtype(KEY) == torch.float32 and reader.dtype_name(KEY) == "F32"
        assert torch.equal(reader.get_rows(KEY, 2, 5), reader.get(KEY)[2:5])
