"""The ``pre_tokenizer`` of a tokenizer.json: splits normalized text into the words the model tokenizes.

Supported: ByteLevel (with or without the GPT-2 regex), Metaspace (prepend_scheme always / first / never, split
on or off), Split (Regex or String; Isolated / Removed / MergedWithPrevious / MergedWithNext / Contiguous;
invert), Digits, Whitespace, WhitespaceSplit, Punctuation, BertPreTokenizer, CharDelimiterSplit, Sequence.

A step maps ``(pieces, at_start)`` to the same: ``at_start`` says whether the first piece begins at the start of
the original text, which Metaspace's ``prepend_scheme: first`` needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .spec import WHITESPACE_CLASS, Spec, metaspace_settings, utf8

Step = Callable[[list[str], bool], tuple[list[str], bool]]

#: The GPT-2 pre-tokenizer regex, as the ``tokenizers`` ByteLevel pre-tokenizer uses it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Rust's ``is_ascii_punctuation() || is_punctuation()`` as a regex class.
PUNCTUATION_CLASS = r"[\p{P}!-/:-@\[-`{-~]"
BEHAVIORS = ("Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous")
SUPPORTED = [
    "ByteLevel",
    "Metaspace",
    "Split",
    "Digits",
    "Whitespace",
    "WhitespaceSplit",
    "Punctuation",
    "BertPreTokenizer",
    "CharDelimiterSplit",
    "Sequence",
]


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


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
BYTE_TABLE = [BYTE_TO_CHAR[b] for b in range(256)]


class PreTokenizer:
    """A parsed pre-tokenizer: ``split(text, at_start) -> words``; ``byte_level`` when it has a ByteLevel step."""

    def __init__(self, spec: Spec, value: Any, where: str = "pre_tokenizer"):
        self.byte_level = False
        self.steps: list[Step] = self._parse(spec, value, where)

    def split(self, text: str, at_start: bool) -> list[str]:
        """The words of one normalized chunk of text."""
        pieces = [text]
        for step in self.steps:
            pieces, at_start = step(pieces, at_start)
        return pieces

    def _parse(self, spec: Spec, value: Any, where: str) -> list[Step]:
        if value is None:
            return []
        kind = spec.kind(value, where)
        if kind == "Sequence":
            parts = spec.items(value, "pretokenizers", where)
            return [
                step for i, part in enumerate(parts) for step in self._parse(spec, part, f"{where}.pretokenizers[{i}]")
            ]
        if kind == "ByteLevel":
            self.byte_level = True
            return byte_level_steps(spec, value, where)
        if kind == "Metaspace":
            return [metaspace_step(spec, value, where)]
        if kind == "Split":
            behavior = spec.text(value, "behavior", where, "Isolated")
            invert = spec.flag(value, "invert", where, False)
            return [splitter(spec, spec.pattern(value, where), behavior, where, invert)]
        if kind == "Digits":
            pattern = r"\p{N}" if spec.flag(value, "individual_digits", where, False) else r"\p{N}+"
            return [splitter(spec, spec.re.compile(pattern), "Isolated", where)]
        if kind == "Whitespace":
            pattern = spec.re.compile(rf"\w+|[^\w{WHITESPACE_CLASS}]+")
            return [splitter(spec, pattern, "Removed", where, invert=True)]
        if kind == "WhitespaceSplit":
            return [splitter(spec, spec.re.compile(f"[{WHITESPACE_CLASS}]"), "Removed", where)]
        if kind == "Punctuation":
            behavior = spec.text(value, "behavior", where, "Isolated")
            return [splitter(spec, spec.re.compile(PUNCTUATION_CLASS), behavior, where)]
        if kind == "BertPreTokenizer":
            return [
                splitter(spec, spec.re.compile(f"[{WHITESPACE_CLASS}]"), "Removed", where),
                splitter(spec, spec.re.compile(PUNCTUATION_CLASS), "Isolated", where),
            ]
        if kind == "CharDelimiterSplit":
            delimiter = spec.char(value, "delimiter", where)
            return [splitter(spec, spec.re.compile(spec.re.escape(delimiter)), "Removed", where)]
        spec.unsupported(where, "pre-tokenizer", kind, SUPPORTED)


def byte_level_steps(spec: Spec, value: dict[str, Any], where: str) -> list[Step]:
    """ByteLevel: an optional prefix space, the GPT-2 regex split, then each byte as its printable character."""
    steps: list[Step] = []
    if spec.flag(value, "add_prefix_space", where, True):
        steps.append(lambda pieces, at_start: ([p if p.startswith(" ") else " " + p for p in pieces], at_start))
    if spec.flag(value, "use_regex", where, True):
        steps.append(splitter(spec, spec.re.compile(GPT2_PATTERN), "Isolated", where))
    table = BYTE_TABLE
    steps.append(lambda pieces, at_start: (["".join(table[b] for b in utf8(p)) for p in pieces], at_start))
    return steps


def metaspace_step(spec: Spec, value: dict[str, Any], where: str) -> Step:
    """Metaspace: spaces become the replacement character, prepended per ``prepend_scheme``, split before each."""
    rep, scheme = metaspace_settings(spec, value, where)
    if not isinstance(value.get("add_prefix_space", True), bool):
        spec.fail(f"field '{where}.add_prefix_space' must be true or false")
    split = spec.flag(value, "split", where, True)

    def step(pieces: list[str], at_start: bool) -> tuple[list[str], bool]:
        out: list[str] = []
        for index, piece in enumerate(pieces):
            piece = piece.replace(" ", rep)
            if not piece.startswith(rep) and (scheme == "always" or (scheme == "first" and index == 0 and at_start)):
                piece = rep + piece
            if not split:
                out.append(piece)
                continue
            parts = piece.split(rep)
            if parts[0]:
                out.append(parts[0])
            out.extend(rep + part for part in parts[1:])
        return out, at_start

    return step


def splitter(spec: Spec, pattern: Any, behavior: str, where: str, invert: bool = False) -> Step:
    """A split of every piece on the (non-empty) matches of ``pattern``, with a ``tokenizers`` delimiter behavior."""
    if behavior not in BEHAVIORS:
        spec.fail(f"field '{where}': split behavior {behavior!r} is not supported (supported: {', '.join(BEHAVIORS)})")

    def spans_of(piece: str) -> list[tuple[int, int, bool]]:
        spans: list[tuple[int, int, bool]] = []  # (start, end, is_match), covering the piece
        last = 0
        for match in pattern.finditer(piece):
            start, end = match.span()
            if start == end:
                continue
            if start > last:
                spans.append((last, start, invert))
            spans.append((start, end, not invert))
            last = end
        if last < len(piece):
            spans.append((last, len(piece), invert))
        return spans

    def split(pieces: list[str], at_start: bool) -> tuple[list[str], bool]:
        out: list[str] = []
        for number, piece in enumerate(pieces):
            spans = spans_of(piece)
            if number == 0 and behavior == "Removed" and (not spans or spans[0][2]):
                at_start = False
            if behavior == "Isolated":
                out.extend(piece[s:e] for s, e, _ in spans)
            elif behavior == "Removed":
                out.extend(piece[s:e] for s, e, m in spans if not m)
            elif behavior == "Contiguous":
                current, previous = "", False
                for s, e, m in spans:
                    if m and previous:
                        current += piece[s:e]
                    else:
                        if current:
                            out.append(current)
                        current = piece[s:e]
                    previous = m
                if current:
                    out.append(current)
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
        return out, at_start

    return split
