"""A GPT-2-style byte-level BPE tokenizer that reads Hugging Face ``tokenizer.json`` files, in plain Python.

It needs only the ``regex`` package (for ``\\p{L}``-style classes), not ``tokenizers`` or transformers, and gives
the same ids as the ``tokenizers`` library for the byte-level BPE tokenizers it accepts (SmolLM2, GPT-2, Llama 3,
Qwen2 style). What it implements of the tokenizer.json schema:

* ``added_tokens``: matched literally in the raw text first (longest first; ``lstrip``/``rstrip`` honoured).
* ``normalizer``: none, NFC/NFD/NFKC/NFKD, Lowercase, or a Sequence of those.
* ``pre_tokenizer``: ByteLevel (with or without the GPT-2 regex), Split (regex or string, Isolated / Removed /
  MergedWithPrevious / MergedWithNext), Digits, or a Sequence of those.
* ``model``: BPE with its merges, applied in rank order exactly as ``tokenizers`` does; ``ignore_merges``.
* ``post_processor``: none, ByteLevel, TemplateProcessing (used when ``add_special_tokens=True``), Sequence.
* ``decoder``: ByteLevel.

Anything else is a :class:`TokenizerError` naming the file and the field, as is any malformed content.
"""

from __future__ import annotations

import heapq
import json
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from ..fsutil import read_bounded_text

# The GPT-2 pre-tokenizer regex, as the ``tokenizers`` ByteLevel pre-tokenizer uses it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CACHE_LIMIT = 50_000


def _regex() -> Any:
    try:
        import regex
    except ImportError:
        raise TokenizerError("the tokenizer needs the package 'regex': pip install regex") from None
    return regex


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_TABLE = [_BYTE_TO_CHAR[b] for b in range(256)]

Step = Callable[[list[str]], list[str]]


class Tokenizer:
    """Byte-level BPE: ``encode(text) -> ids``, ``decode(ids) -> text``; build with :meth:`from_file` / :meth:`from_dir`."""

    def __init__(
        self,
        data: dict[str, Any],
        source: str = "tokenizer.json",
        bos_token: str | int | None = None,
        eos_token: str | int | None = None,
    ):
        """``data`` is a parsed tokenizer.json; ``source`` names it in errors; bos/eos as token strings or ids."""
        self.source = source
        if not isinstance(data, dict):
            self._fail(f"expected a JSON object, got {type(data).__name__}")
        self._re = _regex()
        self._parse_model(data.get("model"))
        self._parse_added(data.get("added_tokens", []))
        self._normalize = self._parse_normalizer(data.get("normalizer"), "normalizer")
        self._byte_level = False
        self._pre_steps = self._parse_pre(data.get("pre_tokenizer"), "pre_tokenizer")
        if not self._byte_level:
            self._fail("field 'pre_tokenizer' has no ByteLevel step: only byte-level BPE tokenizers are supported")
        self._template = self._parse_post(data.get("post_processor"), "post_processor")
        self._check_decoder(data.get("decoder"), "decoder")
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

    def _parse_model(self, model: Any) -> None:
        if not isinstance(model, dict):
            self._fail("field 'model' is missing or not an object")
        kind = model.get("type", "BPE" if "merges" in model else None)
        if kind != "BPE":
            self._fail(f"model type {kind!r} is not supported (only 'BPE')")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            self._fail("field 'model.vocab' must be a non-empty object mapping tokens to ids")
        for token, index in vocab.items():
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                self._fail(f"field 'model.vocab': token {token!r} has id {index!r}, expected a non-negative integer")
        self.vocab: dict[str, int] = dict(vocab)
        for key in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                self._fail(f"field 'model.{key}' = {model[key]!r} is not supported")
        if model.get("dropout") not in (None, 0, 0.0):
            self._fail(
                f"field 'model.dropout' = {model['dropout']!r} is not supported (encoding must be deterministic)"
            )
        self.ignore_merges = bool(model.get("ignore_merges", False))
        unk = model.get("unk_token")
        if unk is not None and (not isinstance(unk, str) or unk not in self.vocab):
            self._fail(f"field 'model.unk_token' {unk!r} is not in the vocab")
        self._unk_id = self.vocab[unk] if unk is not None else None
        merges = model.get("merges")
        if not isinstance(merges, list):
            self._fail("field 'model.merges' must be a list")
        self._merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, merge in enumerate(merges):
            if isinstance(merge, str):
                parts = merge.split(" ")
            elif isinstance(merge, list) and all(isinstance(p, str) for p in merge):
                parts = merge
            else:
                parts = []
            if len(parts) != 2:
                self._fail(f"field 'model.merges' entry #{rank} {merge!r} is not a pair of tokens")
            left, right = parts
            for part in (left, right, left + right):
                if part not in self.vocab:
                    self._fail(f"field 'model.merges' entry #{rank} {merge!r}: token {part!r} is not in the vocab")
            self._merges.setdefault((self.vocab[left], self.vocab[right]), (rank, self.vocab[left + right]))

    def _parse_added(self, added: Any) -> None:
        if not isinstance(added, list):
            self._fail("field 'added_tokens' must be a list")
        self.added_tokens: dict[str, int] = {}
        self._special_ids: set[int] = set()
        alternatives = []
        for number, entry in enumerate(added):
            if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
                self._fail(f"field 'added_tokens' entry #{number} needs a non-empty string 'content'")
            index = entry.get("id")
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                self._fail(
                    f"field 'added_tokens' entry #{number} ({entry['content']!r}) needs a non-negative integer 'id'"
                )
            content = entry["content"]
            self.added_tokens[content] = index
            if entry.get("special", False):
                self._special_ids.add(index)
            pattern = self._re.escape(content)
            if entry.get("single_word", False):
                pattern = rf"(?<!\w){pattern}(?!\w)"
            if entry.get("lstrip", False):
                pattern = rf"\s*{pattern}"
            if entry.get("rstrip", False):
                pattern = rf"{pattern}\s*"
            alternatives.append((len(content), pattern, content))
        alternatives.sort(key=lambda item: -item[0])  # leftmost, then longest match, as tokenizers does
        self._added_re = self._re.compile("|".join(f"({p})" for _, p, _ in alternatives)) if alternatives else None
        self._added_by_group = [content for _, _, content in alternatives]
        self.id_to_token: dict[int, str] = {index: token for token, index in self.vocab.items()}
        self.id_to_token.update({index: content for content, index in self.added_tokens.items()})
        self._added_ids = set(self.added_tokens.values())

    def _parse_normalizer(self, spec: Any, where: str) -> Callable[[str], str] | None:
        if spec is None:
            return None
        if not isinstance(spec, dict):
            self._fail(f"field '{where}' must be an object or null")
        kind = spec.get("type")
        if kind in ("NFC", "NFD", "NFKC", "NFKD"):
            return lambda text, form=kind: unicodedata.normalize(form, text)
        if kind == "Lowercase":
            return str.lower
        if kind == "Sequence":
            parts = spec.get("normalizers")
            if not isinstance(parts, list):
                self._fail(f"field '{where}.normalizers' must be a list")
            steps = [self._parse_normalizer(p, f"{where}.normalizers[{i}]") for i, p in enumerate(parts)]

            def run(text: str) -> str:
                for step in steps:
                    if step is not None:
                        text = step(text)
                return text

            return run
        self._fail(
            f"field '{where}': normalizer type {kind!r} is not supported (NFC, NFD, NFKC, NFKD, Lowercase, Sequence)"
        )
        return None

    def _parse_pre(self, spec: Any, where: str) -> list[Step]:
        if spec is None:
            return []
        if not isinstance(spec, dict):
            self._fail(f"field '{where}' must be an object or null")
        kind = spec.get("type")
        if kind == "Sequence":
            parts = spec.get("pretokenizers")
            if not isinstance(parts, list):
                self._fail(f"field '{where}.pretokenizers' must be a list")
            return [
                step for i, part in enumerate(parts) for step in self._parse_pre(part, f"{where}.pretokenizers[{i}]")
            ]
        if kind == "ByteLevel":
            self._byte_level = True
            steps: list[Step] = []
            if spec.get("add_prefix_space", False):
                steps.append(lambda pieces: [p if p.startswith(" ") else " " + p for p in pieces])
            if spec.get("use_regex", True):
                steps.append(self._splitter(self._re.compile(GPT2_PATTERN), "Isolated", where))
            steps.append(lambda pieces: ["".join(_BYTE_TABLE[b] for b in _utf8(p)) for p in pieces])
            return steps
        if kind == "Digits":
            pattern = r"\p{N}" if spec.get("individual_digits", False) else r"\p{N}+"
            return [self._splitter(self._re.compile(pattern), "Isolated", where)]
        if kind == "Split":
            if spec.get("invert", False):
                self._fail(f"field '{where}': Split with invert=true is not supported")
            pattern = spec.get("pattern")
            if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
                source = pattern["Regex"]
            elif isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
                source = self._re.escape(pattern["String"])
            else:
                self._fail(f'field \'{where}.pattern\' must be {{"Regex": ...}} or {{"String": ...}}')
            try:
                compiled = self._re.compile(source)
            except Exception as exc:
                self._fail(f"field '{where}.pattern' is not a valid regex ({exc})")
            return [self._splitter(compiled, spec.get("behavior", "Isolated"), where)]
        self._fail(
            f"field '{where}': pre-tokenizer type {kind!r} is not supported (ByteLevel, Split, Digits, Sequence)"
        )
        return []

    def _splitter(self, pattern: Any, behavior: str, where: str) -> Step:
        if behavior not in ("Isolated", "Removed", "MergedWithPrevious", "MergedWithNext"):
            self._fail(f"field '{where}': split behavior {behavior!r} is not supported")

        def split(pieces: list[str]) -> list[str]:
            out: list[str] = []
            for piece in pieces:
                spans: list[tuple[int, int, bool]] = []  # (start, end, is_match), covering the piece
                last = 0
                for match in pattern.finditer(piece):
                    start, end = match.span()
                    if start == end:
                        continue
                    if start > last:
                        spans.append((last, start, False))
                    spans.append((start, end, True))
                    last = end
                if last < len(piece):
                    spans.append((last, len(piece), False))
                if behavior == "Isolated":
                    out.extend(piece[s:e] for s, e, _ in spans)
                elif behavior == "Removed":
                    out.extend(piece[s:e] for s, e, m in spans if not m)
                elif behavior == "MergedWithPrevious":
                    current = ""
                    for s, e, m in spans:
                        current += piece[s:e]
                        if m:
                            out.append(current)
                            current = ""
                    if current:
                        out.append(current)
                else:  # MergedWithNext
                    current = ""
                    for s, e, m in spans:
                        if m and current:
                            out.append(current)
                            current = ""
                        current += piece[s:e]
                    if current:
                        out.append(current)
            return out

        return split

    def _parse_post(self, spec: Any, where: str) -> list[Any] | None:
        """The ``single`` template of a TemplateProcessing (as ids / the sequence marker), or None."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            self._fail(f"field '{where}' must be an object or null")
        kind = spec.get("type")
        if kind == "ByteLevel":
            return None
        if kind == "Sequence":
            processors = spec.get("processors") or []
            if not isinstance(processors, list):
                self._fail(f"field '{where}.processors' must be a list")
            templates = [self._parse_post(p, f"{where}.processors[{i}]") for i, p in enumerate(processors)]
            templates = [t for t in templates if t is not None]
            if len(templates) > 1:
                self._fail(f"field '{where}': more than one TemplateProcessing is not supported")
            return templates[0] if templates else None
        if kind == "TemplateProcessing":
            single, specials = spec.get("single"), spec.get("special_tokens", {})
            if not isinstance(single, list) or not isinstance(specials, dict):
                self._fail(f"field '{where}' needs a 'single' list and a 'special_tokens' object")
            template: list[Any] = []
            for item in single:
                if isinstance(item, dict) and "Sequence" in item:
                    template.append(None)
                elif isinstance(item, dict) and isinstance(item.get("SpecialToken"), dict):
                    name = item["SpecialToken"].get("id")
                    special = specials.get(name) if isinstance(name, str) else None
                    ids = special.get("ids") if isinstance(special, dict) else None
                    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                        self._fail(f"field '{where}': special token {name!r} has no 'ids' in 'special_tokens'")
                    template.extend(ids)
                else:
                    self._fail(f"field '{where}.single' has an unrecognised item {item!r}")
            return template
        self._fail(
            f"field '{where}': post-processor type {kind!r} is not supported (ByteLevel, TemplateProcessing, Sequence)"
        )
        return None

    def _check_decoder(self, spec: Any, where: str) -> None:
        if spec is None:
            return
        if not isinstance(spec, dict):
            self._fail(f"field '{where}' must be an object or null")
        kind = spec.get("type")
        if kind == "Sequence":
            decoders = spec.get("decoders") or []
            if not isinstance(decoders, list):
                self._fail(f"field '{where}.decoders' must be a list")
            for i, part in enumerate(decoders):
                self._check_decoder(part, f"{where}.decoders[{i}]")
        elif kind != "ByteLevel":
            self._fail(f"field '{where}': decoder type {kind!r} is not supported (ByteLevel)")

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
        return self.added_tokens.get(token, self.vocab.get(token))

    # ------------------------------------------------------------------ encoding

    def _bpe(self, word: str) -> list[int]:
        """Apply the merges to one pre-tokenized word, lowest rank first (leftmost on ties), as ``tokenizers`` does."""
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        ids: list[int] = []
        for char in word:
            index = self.vocab.get(char, self._unk_id)
            if index is not None:  # a character with no token and no unk token is dropped, as tokenizers does
                ids.append(index)
        n = len(ids)
        if n < 2:
            return ids
        merges = self._merges
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            found = merges.get((ids[i], ids[i + 1]))
            if found is not None:
                heap.append((found[0], i, found[1]))
        heapq.heapify(heap)
        while heap:
            _, pos, new_id = heapq.heappop(heap)
            if not alive[pos]:
                continue
            right = nxt[pos]
            if right == -1:
                continue
            found = merges.get((ids[pos], ids[right]))
            if found is None or found[1] != new_id:
                continue  # a stale entry: the pair at pos has changed since it was queued
            ids[pos] = new_id
            alive[right] = False
            after = nxt[right]
            nxt[pos] = after
            if after != -1:
                prev[after] = pos
            before = prev[pos]
            if before != -1:
                found = merges.get((ids[before], ids[pos]))
                if found is not None:
                    heapq.heappush(heap, (found[0], before, found[1]))
            if after != -1:
                found = merges.get((ids[pos], ids[after]))
                if found is not None:
                    heapq.heappush(heap, (found[0], pos, found[1]))
        return [ids[i] for i in range(n) if alive[i]]

    def _encode_chunk(self, text: str, out: list[int]) -> None:
        if self._normalize is not None:
            text = self._normalize(text)
        pieces = [text]
        for step in self._pre_steps:
            pieces = step(pieces)
        cache = self._cache
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; added/special tokens written in the text map to their ids.

        ``add_special_tokens=True`` applies the tokenizer's template (e.g. a BOS token) where it has one.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        out: list[int] = []
        last = 0
        if self._added_re is not None:
            for match in self._added_re.finditer(text):
                if match.start() > last:
                    self._encode_chunk(text[last : match.start()], out)
                out.append(self.added_tokens[self._added_by_group[match.lastindex - 1]])
                last = match.end()
        if last < len(text):
            self._encode_chunk(text[last:], out)
        if add_special_tokens and self._template is not None:
            templated: list[int] = []
            for item in self._template:
                if item is None:
                    templated.extend(out)
                else:
                    templated.append(item)
            out = templated
        return out

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(text, add_special_tokens) for text in texts]

    # ------------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 (a cut-off character) become U+FFFD."""
        data = bytearray()
        for index in ids:
            index = int(index)
            token = self.id_to_token.get(index)
            if token is None:
                raise TokenizerError(
                    f"{self.source}: token id {index} is not in the vocabulary (size {self.vocab_size})"
                )
            if index in self._added_ids:
                if skip_special_tokens and index in self._special_ids:
                    continue
                data += token.encode("utf-8")
                continue
            for char in token:
                byte = _CHAR_TO_BYTE.get(char)
                if byte is None:
                    data += char.encode("utf-8")
                else:
                    data.append(byte)
        try:
            return data.decode("utf-8", errors="surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", errors="replace")


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogatepass")


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
