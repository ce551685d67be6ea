"""The pure-torch models give transformers' logits, for every family and option we support.

Each parity test builds a tiny transformers model (eager attention, random weights), saves it with
``save_pretrained`` and loads the directory with ``shardcal.models.from_pretrained``: this checks the config
parser, the loader and the model together. transformers is a test-only reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardcal.models import CausalLM, ModelConfig, SparseMoeBlock, from_pretrained, load_config
from shardcal.models.checkpoint import INDEX_NAME, CheckpointReader

from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint, randomize_

transformers = pytest.importorskip("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

ATOL = 1e-4
VOCAB = TINY_CONFIGS["llama"]["vocab_size"]


# --- helpers ------------------------------------------------------------------------------------------------


pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


def hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers model of ``model_type`` (TINY_CONFIGS + overrides), random weights, eager attention."""
    fields = {k: v for k, v in TINY_CONFIGS[model_type].items() if k not in ("model_type", "architectures")}
    fields.update(copy.deepcopy(overrides))
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model, seed=seed)
    return model.eval()


def save_hf(model: Any, directory: Path, **kwargs: Any) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


def token_ids(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def checkpoint_keys(model_dir: Path) -> set[str]:
    with CheckpointReader(model_dir) as reader:
        return set(reader.keys())


def assert_close(got: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert got.shape == expected.shape
    assert torch.isfinite(got).all()
    diff = (got.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"max abs logits difference {diff:.3g} > {atol}"


@torch.no_grad()
def hf_logits(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False, **kwargs).logits


# --- logits parity, every family ----------------------------------------------------------------------------

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # head_dim 16: low, medium and high frequencies all present
# factor != max_position_embeddings / original (64 / 16): transformers 5 uses `factor` itself.
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
YARN_MSCALE = {**YARN, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}
YARN_ATTENTION_FACTOR = {**YARN, "attention_factor": 1.25}

# (id, model_type, config overrides, seq_len)
PARITY_CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("llama", "llama", {}, 24),
    ("llama-biases", "llama", {"attention_bias": True, "mlp_bias": True}, 24),
    ("llama-head-dim-32-mha", "llama", {"head_dim": 32, "num_key_value_heads": 4}, 24),
    ("llama-gelu-tanh", "llama", {"hidden_act": "gelu_pytorch_tanh"}, 16),
    ("llama-rope-llama3", "llama", {"max_position_embeddings": 64, "rope_scaling": LLAMA3}, 32),
    # no original_max_position_embeddings: it defaults to max_position_embeddings (transformers 5)
    (
        "llama-rope-llama3-default-original",
        "llama",
        {
            "max_position_embeddings": 24,
            "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"},
        },
        32,
    ),
    ("llama-rope-linear", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 32),
    # dynamic NTK scales only past max_position_embeddings: 40 > 16 exercises it, 12 < 16 the plain branch
    (
        "llama-rope-dynamic",
        "llama",
        {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        40,
    ),
    (
        "llama-rope-dynamic-short",
        "llama",
        {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        12,
    ),
    ("llama-rope-yarn", "llama", {"max_position_embeddings": 64, "rope_scaling": YARN}, 48),
    ("llama-rope-yarn-mscale", "llama", {"max_position_embeddings": 64, "rope_scaling": YARN_MSCALE}, 48),
    (
        "llama-rope-yarn-attention-factor",
        "llama",
        {"max_position_embeddings": 64, "rope_scaling": YARN_ATTENTION_FACTOR},
        48,
    ),
    ("llama-rope-theta", "llama", {"rope_theta": 500000.0}, 24),
    ("mistral", "mistral", {}, 24),
    ("mistral-sliding-window", "mistral", {"sliding_window": 8}, 24),
    ("qwen2-qkv-bias", "qwen2", {}, 24),
    ("qwen2-sliding-window", "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, 24),
    ("qwen3-qk-norm", "qwen3", {}, 24),
    ("qwen3-attention-bias", "qwen3", {"attention_bias": True}, 24),
    ("qwen3-rope-yarn", "qwen3", {"max_position_embeddings": 64, "rope_scaling": YARN}, 48),
    ("mixtral", "mixtral", {}, 24),
    ("mixtral-sliding-window", "mixtral", {"sliding_window": 8}, 24),
    # layers 0 and 2 dense (sparse step 2), 1 sparse, 3 dense via mlp_only_layers; shared expert on
    (
        "qwen2_moe-step2-mlp-only",
        "qwen2_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
        24,
    ),
    ("qwen2_moe-norm-topk-no-qkv-bias", "qwen2_moe", {"norm_topk_prob": True, "qkv_bias": False}, 24),
    (
        "qwen2_moe-sliding-window",
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "mlp_only_layers": [],
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 2,
        },
        24,
    ),
    ("qwen3_moe", "qwen3_moe", {}, 24),
    ("qwen3_moe-no-norm-topk-mlp-only", "qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [1]}, 24),
    ("qwen3_moe-sliding-window", "qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, 24),
]


@pytest.mark.parametrize(
    ("model_type", "overrides", "seq_len"),
    [pytest.param(t, o, s, id=i) for i, t, o, s in PARITY_CASES],
)
def test_logits_match_transformers(tmp_path: Path, model_type: str, overrides: dict[str, Any], seq_len: int) -> None:
    if "yarn" in json.dumps(overrides) and not TRANSFORMERS_5:
        pytest.skip("transformers 4.x derives YaRN's factor from max/original positions; we follow 5.x")
    hf = hf_model(model_type, **overrides)
    model_dir = save_hf(hf, tmp_path / "hf")
    ours = from_pretrained(model_dir)
    ids = token_ids(2, seq_len)

    expected = hf_logits(hf, ids)
    with torch.no_grad():
        got = ours(ids)
    assert expected.std() > 0.1  # the comparison means something
    assert_close(got, expected)
    # Names equal the checkpoint's: nothing renamed, nothing extra, nothing left out.
    assert set(ours.state_dict()) == checkpoint_keys(model_dir)
    # The layer structure is transformers': sliding windows and sparse/dense blocks where its config says.
    layer_types = getattr(hf.config, "layer_types", None)
    for i, layer in enumerate(ours.model.layers):
        window = getattr(hf.config, "sliding_window", None) or None
        if layer_types is not None and model_type not in ("mistral", "mixtral", "qwen3_moe"):
            window = window if layer_types[i] == "sliding_attention" else None
        assert layer.self_attn.sliding_window == window
        hf_sparse = "Sparse" in type(hf.model.layers[i].mlp).__name__
        assert isinstance(layer.feed_forward, SparseMoeBlock) == hf_sparse


def test_qwen2_moe_layer_kinds(tmp_path: Path) -> None:
    """decoder_sparse_step=2 + mlp_only_layers=[3]: only layer 1 is sparse; sparse layers have a shared expert."""
    ours = from_pretrained(
        make_tiny_checkpoint(tmp_path, "qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["MLP", "SparseMoeBlock", "MLP", "MLP"]
    assert ours.model.layers[1].mlp.shared_expert is not None


def test_layers_called_directly_reproduce_forward(tmp_path: Path) -> None:
    """The calibration runner's contract: embed once, call each layer on the cached inputs, get the logits."""
    ours = from_pretrained(make_tiny_checkpoint(tmp_path, "mistral", sliding_window=6))
    ids = token_ids(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        inputs = ours.model.embed(ids, mask)
        h = inputs.hidden_states
        for layer in ours.model.layers:
            h = layer(h, position_embeddings=inputs.position_embeddings, attention_mask=inputs.attention_mask)
        logits = ours.lm_head(ours.model.norm(h))
        assert torch.equal(logits, ours(ids, mask))


# --- tied embeddings ----------------------------------------------------------------------------------------


def test_tied_embeddings(tmp_path: Path) -> None:
    hf = hf_model("qwen2", tie_word_embeddings=True)
    model_dir = save_hf(hf, tmp_path / "hf")
    assert "lm_head.weight" not in checkpoint_keys(model_dir)  # transformers omits the tied copy
    ours = from_pretrained(model_dir)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = token_ids(2, 16)
    with torch.no_grad():
        assert_close(ours(ids), hf_logits(hf, ids))
    assert set(ours.state_dict()) == checkpoint_keys(model_dir) | {"lm_head.weight"}


def test_tied_checkpoint_that_stores_lm_head_loads(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    state = load_file(model_dir / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, model_dir / "model.safetensors")
    ours = from_pretrained(model_dir)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert torch.equal(ours.lm_head.weight, state["model.embed_tokens.weight"])


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path: Path) -> None:
    from shardcal.errors import CheckpointError

    model_dir = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        from_pretrained(model_dir)


# --- padding --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("llama", {}), ("mistral", {"sliding_window": 6}), ("qwen2_moe", {}), ("qwen3", {})],
    ids=["llama", "mistral-sliding-window", "qwen2_moe", "qwen3"],
)
def test_left_padding(tmp_path: Path, model_type: str, overrides: dict[str, Any]) -> None:
    hf = hf_model(model_type, **overrides)
    ours = from_pretrained(save_hf(hf, tmp_path / "hf"))
    ids = token_ids(3, 20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :13] = 0
    # transformers' generate() counts positions over real tokens only; so does our model.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = hf_logits(hf, ids, attention_mask=mask, position_ids=position_ids)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        real = mask.bool()
        assert_close(got[real], expected[real])
        # And a left-padded row gives what the unpadded sequence gives alone.
        for row in (1, 2):
            alone = ours(ids[row : row + 1, mask[row].bool()])
            assert_close(got[row, mask[row].bool()], alone[0])
        # An all-ones mask is the same as none.
        assert torch.equal(ours(ids, attention_mask=torch.ones_like(ids)), ours(ids))


# --- sharded checkpoints ------------------------------------------------------------------------------------


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = hf_model("qwen3_moe")
    model_dir = save_hf(hf, tmp_path / "hf", max_shard_size="60KB")
    assert (model_dir / INDEX_NAME).is_file()
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1
    assert not (model_dir / "model.safetensors").exists()
    ours = from_pretrained(model_dir)
    ids = token_ids(2, 16)
    with torch.no_grad():
        assert_close(ours(ids), hf_logits(hf, ids))
    assert set(ours.state_dict()) == checkpoint_keys(model_dir)


# --- dtypes ---------------------------------------------------------------------------------------------------


def _rewrite(model_dir: Path, change: Any) -> None:
    state = load_file(model_dir / "model.safetensors")
    save_file({k: change(k, v) for k, v in state.items()}, model_dir / "model.safetensors")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_bf16_model_keeps_float32_router(tmp_path: Path, model_type: str) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, model_type, dtype=torch.bfloat16)
    fp32 = from_pretrained(model_dir, dtype=torch.float32)  # reference, before the router is widened
    _rewrite(model_dir, lambda k, v: v.float() if k.endswith(".gate.weight") else v)

    model = from_pretrained(model_dir)
    routers = [m.gate for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert routers
    for name, param in model.named_parameters():
        is_router = name.endswith(".gate.weight") and any(param is r.weight for r in routers)
        assert param.dtype == (torch.float32 if is_router else torch.bfloat16), name
    ids = token_ids(2, 16)
    with torch.no_grad():
        logits = model(ids)
        reference = fp32(ids)
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
    assert (logits.float() - reference).abs().mean() < 0.02

    # Asked for float32, everything is float32; a router stored bf16 stays with the model dtype.
    assert all(p.dtype == torch.float32 for p in from_pretrained(model_dir, dtype=torch.float32).parameters())
    bf16_dir = make_tiny_checkpoint(tmp_path, model_type, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in from_pretrained(bf16_dir).parameters())


def _set_config(model_dir: Path, **fields: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"torch_dtype": "bfloat16", "dtype": None}, torch.bfloat16),  # transformers 4.x spelling
        ({"torch_dtype": None, "dtype": "float16"}, torch.float16),  # transformers 5.x spelling
        ({"torch_dtype": "float32", "dtype": "bfloat16"}, torch.bfloat16),  # both: `dtype` wins, as in transformers
        ({"torch_dtype": "torch.float16", "dtype": None}, torch.float16),
        ({"torch_dtype": None, "dtype": None}, torch.float32),
        ({"torch_dtype": "auto", "dtype": None}, torch.float32),
    ],
)
def test_config_dtype_is_honoured(tmp_path: Path, fields: dict[str, Any], expected: torch.dtype) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "llama")
    _set_config(model_dir, **fields)
    model = from_pretrained(model_dir)
    assert {p.dtype for p in model.parameters()} == {expected}
    with torch.no_grad():
        assert model(token_ids(1, 8)).dtype == expected


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (torch.float32, torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("auto", torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_dtype_argument_overrides_config(tmp_path: Path, arg: Any, expected: torch.dtype) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16)
    assert {p.dtype for p in from_pretrained(model_dir, dtype=arg).parameters()} == {expected}


def test_bad_dtype_argument(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="int8"):
        from_pretrained(model_dir, dtype="int8")
    with pytest.raises(ValueError, match="int8"):
        from_pretrained(model_dir, dtype=torch.int8)


def test_bf16_checkpoint_from_transformers(tmp_path: Path) -> None:
    model_dir = save_hf(hf_model("qwen3").to(torch.bfloat16), tmp_path / "hf")
    assert json.loads((model_dir / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    ours = from_pretrained(model_dir)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    # Reference: transformers' own load of the bf16 weights, computing in float32.
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ids = token_ids(2, 16)
    expected = hf_logits(hf.eval(), ids)
    with torch.no_grad():
        assert_close(from_pretrained(model_dir, dtype=torch.float32)(ids), expected)
        assert (ours(ids).float() - expected).abs().mean() < 0.02


# --- transformers 4.x config spellings ----------------------------------------------------------------------


def _as_v4(config: dict[str, Any], type_key: str) -> dict[str, Any]:
    """A transformers-5 config.json rewritten the way 4.x wrote it."""
    v4 = {k: v for k, v in config.items() if k not in ("dtype", "rope_parameters")}
    v4["torch_dtype"] = config["dtype"]
    rope = dict(config["rope_parameters"])
    v4["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    v4["rope_scaling"] = None if rope_type == "default" else {type_key: rope_type, **rope}
    return v4


def _comparable(cfg: ModelConfig) -> dict[str, Any]:
    fields = dict(vars(cfg))
    fields.pop("raw")
    return fields


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
@pytest.mark.parametrize(
    ("overrides", "seq_len"),
    [
        ({}, 16),
        ({"max_position_embeddings": 64, "rope_scaling": LLAMA3}, 32),
        ({"max_position_embeddings": 64, "rope_scaling": YARN_MSCALE}, 48),
        ({"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 40),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 123456.0}, 24),
    ],
    ids=["default", "llama3", "yarn", "dynamic", "linear"],
)
def test_v4_config_spellings(tmp_path: Path, overrides: dict[str, Any], seq_len: int, type_key: str) -> None:
    hf = hf_model("llama", **overrides)
    model_dir = save_hf(hf, tmp_path / "hf")
    v5 = json.loads((model_dir / "config.json").read_text())
    assert "rope_parameters" in v5 or not TRANSFORMERS_5
    if "rope_parameters" not in v5:
        pytest.skip("transformers 4.x already writes the 4.x spellings")
    cfg5 = load_config(model_dir)

    (model_dir / "config.json").write_text(json.dumps(_as_v4(v5, type_key)))
    cfg4 = load_config(model_dir)
    assert _comparable(cfg4) == _comparable(cfg5)
    ours = from_pretrained(model_dir)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    ids = token_ids(1, seq_len)
    with torch.no_grad():
        assert_close(ours(ids), hf_logits(hf, ids))


def test_family_defaults_match_transformers() -> None:
    """Optional fields a hand-written config omits mean the same here as in transformers."""
    for model_type, tiny in TINY_CONFIGS.items():
        required = {
            k: v
            for k, v in tiny.items()
            if k
            not in (
                "rms_norm_eps",
                "rope_theta",
                "max_position_embeddings",
                "sliding_window",
                "use_sliding_window",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
                "tie_word_embeddings",
                "hidden_act",
                "head_dim" if model_type == "qwen3" else "",
                "architectures",
            )
        }
        ours = ModelConfig.from_dict(required)
        theirs = transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in required.items() if k != "model_type"}
        )
        rope_theta = theirs.rope_parameters["rope_theta"] if TRANSFORMERS_5 else theirs.rope_theta
        assert ours.rms_norm_eps == theirs.rms_norm_eps, model_type
        assert ours.rope_theta == rope_theta, model_type
        assert ours.max_position_embeddings == theirs.max_position_embeddings, model_type
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 16), model_type
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings, model_type
        if model_type in ("mistral", "mixtral"):
            assert ours.sliding_window == theirs.sliding_window, model_type
        if ours.is_moe and model_type != "mixtral":
            assert ours.norm_topk_prob == theirs.norm_topk_prob, model_type


def test_model_built_from_config_dict_has_checkpoint_names() -> None:
    """``CausalLM(ModelConfig.from_dict(...))`` needs no checkpoint: the helper other tests rely on."""
    model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS["mixtral"]))
    names = set(model.state_dict())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


def test_make_tiny_checkpoint(tmp_path: Path) -> None:
    for model_type in TINY_CONFIGS:
        model_dir = make_tiny_checkpoint(tmp_path, model_type, dtype=torch.bfloat16, seed=3)
        config = json.loads((model_dir / "config.json").read_text())
        assert config["model_type"] == model_type and config["torch_dtype"] == "bfloat16"
        with safe_open(model_dir / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        model = from_pretrained(model_dir)
        with torch.no_grad():
            assert model(token_ids(1, 8)).float().std() > 0.1
    # Same arguments, new directory; same seed, same weights.
    again = make_tiny_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, seed=3)
    assert again.name == "tiny-llama-1"
    first = load_file(tmp_path / "tiny-llama" / "model.safetensors")
    assert all(torch.equal(v, load_file(again / "model.safetensors")[k]) for k, v in first.items())
