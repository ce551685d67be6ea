"""The ``normalizer`` of a tokenizer.json: a function from text to normalized text, as ``tokenizers`` computes it.

Supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Replace (String or Regex), Prepend, Sequence.
``Precompiled`` (the SentencePiece character map of T5/ALBERT-style files) is refused with a TokenizerError.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

from .spec import WHITESPACE, Spec

Normalizer = Callable[[str], str]

SUPPORTED = ["NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace", "Prepend", "Sequence"]


class Normalization:
    """A parsed normalizer: ``apply(text)``, and ``drops_start(text)``: whether normalizing ``text`` removes its
    first character, so that the normalized text no longer begins at the original's start (which Metaspace's
    ``prepend_scheme: first`` sees, as in ``tokenizers``)."""

    def __init__(self, apply: Normalizer | None, drops: Callable[[str], bool] | None = None):
        self.apply = apply
        self._drops = drops

    def drops_start(self, text: str) -> bool:
        """Whether normalizing ``text`` removes its first character (Strip, StripAccents, Replace with nothing)."""
        return self._drops is not None and bool(text) and self._drops(text)


def parse_normalizer(spec: Spec, value: Any, where: str = "normalizer") -> Normalization:
    """The normalizer described by ``value`` (None: no normalization)."""
    if value is None:
        return Normalization(None)
    kind = spec.kind(value, where)
    if kind == "Sequence":
        items = spec.items(value, "normalizers", where)
        parts = [parse_normalizer(spec, p, f"{where}.normalizers[{i}]") for i, p in enumerate(items)]
        parts = [p for p in parts if p.apply is not None]
        steps = [p.apply for p in parts]

        def run(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        def drops(text: str) -> bool:
            for part in parts:
                if part.drops_start(text):
                    return True
                text = part.apply(text)  # type: ignore[misc]
                if not text:
                    return False
            return False

        if not steps:
            return Normalization(None)
        return Normalization(steps[0] if len(steps) == 1 else run, drops if any(p._drops for p in parts) else None)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return Normalization(lambda text, form=kind: unicodedata.normalize(form, text))
    if kind == "Lowercase":
        return Normalization(_lowercase)
    if kind == "Strip":
        left = spec.flag(value, "strip_left", where, True)
        right = spec.flag(value, "strip_right", where, True)
        leading = (lambda text: text[0] in WHITESPACE) if left else None
        if left and right:
            return Normalization(lambda text: text.strip(WHITESPACE), leading)
        if left:
            return Normalization(lambda text: text.lstrip(WHITESPACE), leading)
        return Normalization(lambda text: text.rstrip(WHITESPACE) if right else text)
    if kind == "StripAccents":
        return Normalization(lambda text: "".join(c for c in text if not _is_mark(c)), lambda text: _is_mark(text[0]))
    if kind == "Replace":
        replace = replacer(spec, value, where)
        pattern, content = spec.pattern(value, where), value["content"]
        return Normalization(replace, None if content else lambda text: _starts_with_match(pattern, text))
    if kind == "Prepend":
        prefix = spec.text(value, "prepend", where)
        return Normalization(lambda text: prefix + text if text else text)
    if kind == "Precompiled":
        spec.fail(
            f"field '{where}': normalizer type 'Precompiled' (a SentencePiece character map) is not supported "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    spec.unsupported(where, "normalizer", kind, SUPPORTED)


def _is_mark(char: str) -> bool:
    return unicodedata.category(char).startswith("M")


def _starts_with_match(pattern: Any, text: str) -> bool:
    match = pattern.match(text)
    return match is not None and match.end() > 0


def replacer(spec: Spec, value: dict[str, Any], where: str) -> Normalizer:
    """A Replace step (normalizer or decoder): every non-empty match of the pattern becomes ``content``."""
    content = spec.text(value, "content", where)
    pattern = spec.pattern(value, where)
    raw = value["pattern"]
    literal = None if isinstance(raw.get("Regex"), str) else raw.get("String")
    if isinstance(literal, str) and literal:
        return lambda text: text.replace(literal, content)

    def replace(text: str) -> str:
        out, last = [], 0
        for match in pattern.finditer(text):
            start, end = match.span()
            if start == end:
                continue
            out.append(text[last:start])
            out.append(content)
            last = end
        out.append(text[last:])
        return "".join(out)

    return replace


def _lowercase(text: str) -> str:
    """Per-character lowercasing, as Rust's ``char::to_lowercase`` (no final-sigma rule, unlike ``str.lower``)."""
    if "\u03a3" not in text:
        return text.lower()
    return "".join(c.lower() for c in text)
