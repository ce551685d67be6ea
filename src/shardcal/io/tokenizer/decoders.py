"""The ``decoder`` of a tokenizer.json: token strings back to text, as ``tokenizers``' ``decode_chain`` does.

Supported: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace, BPEDecoder, WordPiece, Sequence; no decoder
joins the tokens with spaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .normalizers import replacer
from .pretokenizers import CHAR_TO_BYTE
from .spec import Spec, metaspace_settings, utf8

Chain = Callable[[list[str]], list[str]]

SUPPORTED = [
    "ByteLevel",
    "Metaspace",
    "ByteFallback",
    "Fuse",
    "Strip",
    "Replace",
    "BPEDecoder",
    "WordPiece",
    "Sequence",
]


class Decoder:
    """A parsed decoder: ``decode(tokens) -> text``."""

    def __init__(self, spec: Spec, value: Any, where: str = "decoder"):
        self._chain = None if value is None else parse_decoder(spec, value, where)

    def decode(self, tokens: list[str]) -> str:
        """The text of a sequence of token strings."""
        if self._chain is None:
            return " ".join(tokens)
        return "".join(self._chain(tokens))


def parse_decoder(spec: Spec, value: Any, where: str) -> Chain:
    """One decoder step: a list of token strings to another."""
    kind = spec.kind(value, where)
    if kind == "Sequence":
        steps = [
            parse_decoder(spec, p, f"{where}.decoders[{i}]") for i, p in enumerate(spec.items(value, "decoders", where))
        ]

        def run(tokens: list[str]) -> list[str]:
            for step in steps:
                tokens = step(tokens)
            return tokens

        return run
    if kind == "ByteLevel":
        return lambda tokens: [_byte_level(tokens)]
    if kind == "ByteFallback":
        return _byte_fallback
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Replace":
        replace = replacer(spec, value, where)
        return lambda tokens: [replace(t) for t in tokens]
    if kind == "Strip":
        return _strip(
            spec.char(value, "content", where), spec.count(value, "start", where), spec.count(value, "stop", where)
        )
    if kind == "Metaspace":
        return _metaspace(spec, value, where)
    if kind == "BPEDecoder":
        suffix = spec.text(value, "suffix", where, "</w>")
        return lambda tokens: [t.replace(suffix, "" if i == len(tokens) - 1 else " ") for i, t in enumerate(tokens)]
    if kind == "WordPiece":
        return _wordpiece(spec.text(value, "prefix", where, "##"), spec.flag(value, "cleanup", where, True))
    spec.unsupported(where, "decoder", kind, SUPPORTED)


def _byte_level(tokens: list[str]) -> str:
    """Each token's characters as GPT-2 bytes (a token with any other character as its UTF-8), then the text."""
    data = bytearray()
    table = CHAR_TO_BYTE
    for token in tokens:
        values = [table.get(c) for c in token]
        if None in values:
            data += utf8(token)
        else:
            data.extend(values)  # type: ignore[arg-type]
    return _text_of(bytes(data))


def _text_of(data: bytes) -> str:
    """UTF-8 text; invalid sequences (a cut-off character) become U+FFFD."""
    try:
        return data.decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace")


def _byte_of(token: str) -> int | None:
    """The byte of a ``<0x..>`` token (Rust's ``u8::from_str_radix`` on its two characters), else None."""
    if len(utf8(token)) != 6 or not token.startswith("<0x") or not token.endswith(">"):
        return None
    digits = token[3:5]
    body = digits[1:] if digits.startswith("+") else digits
    if not body or any(c not in "0123456789abcdefABCDEF" for c in body):
        return None
    return int(body, 16)


def _byte_fallback(tokens: list[str]) -> list[str]:
    out: list[str] = []
    pending = bytearray()

    def flush() -> None:
        if pending:
            try:
                out.append(bytes(pending).decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" for _ in pending)
            pending.clear()

    for token in tokens:
        byte = _byte_of(token)
        if byte is None:
            flush()
            out.append(token)
        else:
            pending.append(byte)
    flush()
    return out


def _strip(content: str, start: int, stop: int) -> Chain:
    def strip(tokens: list[str]) -> list[str]:
        out = []
        for token in tokens:
            cut = 0
            while cut < min(start, len(token)) and token[cut] == content:
                cut += 1
            end = len(token)
            while len(token) - end < stop and end > cut and token[end - 1] == content:
                end -= 1
            out.append(token[cut:end])
        return out

    return strip


def _metaspace(spec: Spec, value: dict[str, Any], where: str) -> Chain:
    rep, scheme = metaspace_settings(spec, value, where)

    def decode(tokens: list[str]) -> list[str]:
        out = []
        for i, token in enumerate(tokens):
            out.append(token.replace(rep, "" if i == 0 and scheme != "never" else " "))
        return out

    return decode


def _wordpiece(prefix: str, cleanup: bool) -> Chain:
    def decode(tokens: list[str]) -> list[str]:
        out = []
        for i, token in enumerate(tokens):
            if i:
                token = token[len(prefix) :] if token.startswith(prefix) else " " + token
            if cleanup:
                for old, new in (
                    (" .", "."),
                    (" ?", "?"),
                    (" !", "!"),
                    (" ,", ","),
                    (" ' ", "'"),
                    (" n't", "n't"),
                    (" 'm", "'m"),
                    (" do not", " don't"),
                    (" 's", "'s"),
                    (" 've", "'ve"),
                    (" 're", "'re"),
                ):
                    token = token.replace(old, new)
            out.append(token)
        return out

    return decode
