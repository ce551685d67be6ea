"""Hugging Face ``tokenizer.json`` files read in plain Python: ``Tokenizer.from_dir(model_dir).encode(text)``.

It needs only the ``regex`` package (for ``\\p{L}``-style classes), not ``tokenizers`` or transformers, and gives
the same ids (and decoded text) as the ``tokenizers`` library for the tokenizers of the common open model
families: GPT-2-style byte-level BPE (SmolLM2, GPT-2, Llama 3, Qwen2) and SentencePiece-style ones (Gemma and
Gemma 3, Llama 2, Mistral v0.1, TinyLlama: BPE with byte fallback; T5/ALBERT-style Unigram models). What it
implements of the tokenizer.json schema, one module each:

* ``added_tokens`` (:mod:`.added_tokens`): special or not; ``normalized`` false (matched in the raw text) or
  true (matched in the normalized text); leftmost-longest; ``lstrip`` / ``rstrip`` / ``single_word``.
* ``normalizer`` (:mod:`.normalizers`): NFC/NFD/NFKC/NFKD, Lowercase, Strip, StripAccents, Replace
  (String or Regex), Prepend, Sequence. ``Precompiled`` (a SentencePiece character map) is not supported.
* ``pre_tokenizer`` (:mod:`.pretokenizers`): ByteLevel, Metaspace (prepend_scheme always / first /
  never, split on or off), Split (all delimiter behaviors, invert), Digits, Whitespace, WhitespaceSplit,
  Punctuation, BertPreTokenizer, CharDelimiterSplit, Sequence.
* ``model``: BPE (:mod:`.bpe`: merges in rank order; ``byte_fallback``, ``unk_token``, ``fuse_unk``,
  ``ignore_merges``, ``continuing_subword_prefix`` / ``end_of_word_suffix``; ``dropout`` null or 0) or Unigram
  (:mod:`.unigram`: Viterbi over the piece scores, ``unk_id``, ``byte_fallback``).
* ``post_processor`` (:mod:`.post_processors`, applied with ``add_special_tokens=True``): TemplateProcessing,
  BertProcessing, RobertaProcessing, ByteLevel, Sequence.
* ``decoder`` (:mod:`.decoders`): ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, BPEDecoder,
  WordPiece, Sequence.

``truncation`` and ``padding`` are ignored: shardcal cuts and packs token blocks itself.

Anything else is a :class:`TokenizerError` naming the file and the field (``tokenizer.json: field 'normalizer':
normalizer type 'Foo' is not supported (supported: ...)``), raised when the tokenizer is built; so is any
malformed content. :func:`check_tokenizer_file` builds one to validate a file up front: about 3 s even for a
262k-token vocabulary (Gemma 3), before anything else is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...errors import TokenizerError
from ...runtime.fsutil import read_bounded_text
from .added_tokens import AddedVocabulary
from .bpe import BPE
from .decoders import Decoder
from .normalizers import parse_normalizer
from .post_processors import parse_post_processor
from .pretokenizers import GPT2_PATTERN, PreTokenizer, bytes_to_unicode
from .spec import Spec
from .unigram import Unigram

__all__ = ["GPT2_PATTERN", "Tokenizer", "bytes_to_unicode", "check_tokenizer_file"]

_CACHE_LIMIT = 50_000
MODELS = ["BPE", "Unigram"]


class Tokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text``; build with :meth:`from_file` / :meth:`from_dir`."""

    def __init__(
        self,
        data: dict[str, Any],
        source: str = "tokenizer.json",
        bos_token: str | int | None = None,
        eos_token: str | int | None = None,
    ):
        """``data`` is a parsed tokenizer.json; ``source`` names it in errors; bos/eos as token strings or ids."""
        self.source = source
        spec = Spec(source)
        if not isinstance(data, dict):
            spec.fail(f"expected a JSON object, got {type(data).__name__}")
        self._model = _parse_model(spec, data.get("model"))
        self.vocab: dict[str, int] = self._model.vocab
        self._normalization = parse_normalizer(spec, data.get("normalizer"))
        self._normalize = self._normalization.apply
        self._added = AddedVocabulary(spec, data.get("added_tokens", []), self._normalize)
        self.added_tokens: dict[str, int] = self._added.by_content
        self.id_to_token: dict[int, str] = {index: token for token, index in self.vocab.items()}
        self.id_to_token.update(self._added.by_id)
        self._pre = PreTokenizer(spec, data.get("pre_tokenizer"))
        self._template = parse_post_processor(spec, data.get("post_processor"))
        self._decoder = Decoder(spec, data.get("decoder"))
        self._cache: dict[str, list[int]] = {}
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_file(
        cls, path: str | Path, bos_token: str | int | None = None, eos_token: str | int | None = None
    ) -> Tokenizer:
        """Read a tokenizer.json; bos/eos default to those named by the sibling tokenizer_config.json / config.json."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"{path}: no such file (a model directory needs a tokenizer.json to tokenize text)")
        try:
            data = json.loads(read_bounded_text(path, TokenizerError))
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
        except RecursionError:
            raise TokenizerError(f"{path}: not valid JSON (nested too deeply)") from None
        found_bos, found_eos = _special_tokens_near(path.parent)
        return cls(
            data,
            source=str(path),
            bos_token=bos_token if bos_token is not None else found_bos,
            eos_token=eos_token if eos_token is not None else found_eos,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face-format model directory (its ``tokenizer.json``)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json (needed to tokenize text for this model)")
        return cls.from_file(path)

    def _fail(self, message: str) -> None:
        raise TokenizerError(f"{self.source}: {message}")

    def _special_id(self, token: str | int | None, name: str) -> int | None:
        if token is None or isinstance(token, int):
            return token
        index = self.token_to_id(token)
        if index is None:
            self._fail(f"{name} {token!r} is not a token of this tokenizer")
        return index

    # ------------------------------------------------------------------ queries

    @property
    def vocab_size(self) -> int:
        """Size of the id space (vocab and added tokens): one more than the largest id."""
        return max(self.id_to_token) + 1

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (added tokens first), or None."""
        return self.added_tokens.get(token, self.vocab.get(token))

    # ------------------------------------------------------------------ encoding

    def _encode_words(self, text: str, at_start: bool, out: list[int]) -> None:
        """Pre-tokenize normalized text and run the model on each word (cached)."""
        cache = self._cache
        for word in self._pre.split(text, at_start):
            ids = cache.get(word)
            if ids is None:
                ids = self._model.tokenize(word)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _encode_chunk(self, text: str, at_start: bool, out: list[int]) -> None:
        """Text between raw-matched added tokens: normalize, find the normalized added tokens, encode the rest."""
        if self._normalize is not None:
            if at_start and self._normalization.drops_start(text):
                at_start = False  # the first character left does not start the original text
            text = self._normalize(text)
            if not text:
                return
        matcher = self._added.normalized
        if not matcher:
            self._encode_words(text, at_start, out)
            return
        for start, end, token in matcher.split(text):
            if token is not None:
                out.append(token.id)
            else:
                self._encode_words(text[start:end], at_start and start == 0, out)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; added/special tokens written in the text map to their ids.

        ``add_special_tokens=True`` applies the tokenizer's template (e.g. a BOS token) where it has one.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        out: list[int] = []
        if text:
            for start, end, token in self._added.raw.split(text):
                if token is not None:
                    out.append(token.id)
                else:
                    self._encode_chunk(text[start:end], start == 0, out)
        if add_special_tokens and self._template is not None:
            out = [index for item in self._template for index in (out if item is None else [item])]
        return out

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text."""
        return [self.encode(text, add_special_tokens) for text in texts]

    # ------------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` through the tokenizer's decoder; a cut-off UTF-8 character becomes U+FFFD."""
        tokens = []
        special = self._added.special_contents
        for index in ids:
            index = int(index)
            token = self.id_to_token.get(index)
            if token is None:
                raise TokenizerError(
                    f"{self.source}: token id {index} is not in the vocabulary (size {self.vocab_size})"
                )
            if skip_special_tokens and token in special:
                continue
            tokens.append(token)
        return self._decoder.decode(tokens)


def check_tokenizer_file(path: str | Path) -> Tokenizer:
    """Read and build the tokenizer of ``path`` (a tokenizer.json), so that a bad or unsupported one fails now.

    Every component is parsed and checked (types, fields, merges against the vocab); the error is a
    :class:`TokenizerError` naming the file and the field. Returns the tokenizer, ready to use.
    """
    return Tokenizer.from_file(path)


def _parse_model(spec: Spec, model: Any) -> BPE | Unigram:
    if not isinstance(model, dict):
        spec.fail("field 'model' is missing or not an object")
    kind = model.get("type")
    if kind is None:
        kind = "BPE" if "merges" in model else "Unigram" if isinstance(model.get("vocab"), list) else None
    if kind == "BPE":
        return BPE(spec, model)
    if kind == "Unigram":
        return Unigram(spec, model)
    spec.unsupported("model", "model", kind, MODELS)


def _special_tokens_near(folder: Path) -> tuple[str | int | None, str | int | None]:
    """BOS/EOS of a model directory: tokenizer_config.json's tokens, else generation_config/config ids."""

    def read(name: str) -> dict[str, Any]:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def content(value: Any) -> str | None:
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) and value else None

    def first_id(value: Any) -> int | None:
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    tok_cfg = read("tokenizer_config.json")
    ids = [read("generation_config.json"), read("config.json")]
    bos: str | int | None = content(tok_cfg.get("bos_token"))
    eos: str | int | None = content(tok_cfg.get("eos_token"))
    for source in ids:
        if bos is None:
            bos = first_id(source.get("bos_token_id"))
        if eos is None:
            eos = first_id(source.get("eos_token_id"))
    return bos, eos
