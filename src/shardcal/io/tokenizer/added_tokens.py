"""The ``added_tokens`` of a tokenizer.json: found in the text before the model sees it, as ``tokenizers`` does.

Tokens with ``normalized: false`` are matched in the raw text; the pieces between them are normalized, and the
tokens with ``normalized: true`` are then matched (by their normalized content) in those pieces. Matching is
leftmost-longest; ``single_word`` refuses a match inside a word, ``lstrip`` / ``rstrip`` take the whitespace
beside it into the token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .spec import WHITESPACE, Spec


class AddedToken:
    """One entry of ``added_tokens``."""

    def __init__(self, spec: Spec, entry: Any, number: int):
        where = f"added_tokens' entry #{number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            spec.fail(f"field '{where} needs a non-empty string 'content'")
        self.content: str = entry["content"]
        index = entry.get("id")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            spec.fail(f"field '{where} ({self.content!r}) needs a non-negative integer 'id'")
        self.id: int = index
        flags = {}
        for key, default in (("special", False), ("single_word", False), ("lstrip", False), ("rstrip", False)):
            flags[key] = spec.flag(entry, key, f"added_tokens[{number}]", default)
        self.special = flags["special"]
        self.single_word, self.lstrip, self.rstrip = flags["single_word"], flags["lstrip"], flags["rstrip"]
        self.normalized = spec.flag(entry, "normalized", f"added_tokens[{number}]", not self.special)


class Matcher:
    """Finds a set of added tokens in a string: ``split(text) -> [(start, end, token or None)]`` covering it."""

    def __init__(self, spec: Spec, tokens: dict[str, AddedToken]):
        self.tokens = tokens
        self._re = spec.re.compile(_trie_pattern(spec, list(tokens))) if tokens else None
        self._word = spec.re.compile(r"\w")

    def __bool__(self) -> bool:
        return self._re is not None

    def split(self, text: str) -> list[tuple[int, int, AddedToken | None]]:
        """``AddedVocabulary::find_matches``: the spans of ``text``, each an added token or plain text."""
        out: list[tuple[int, int, AddedToken | None]] = []
        if self._re is None:
            return [(0, len(text), None)]
        last = 0
        for match in self._re.finditer(text):
            start, stop = match.span()
            token = self.tokens[match.group()]
            if token.single_word:
                before = start == 0 or not self._word.match(text, start - 1)
                after = stop == len(text) or not self._word.match(text, stop)
                if not (before and after):
                    continue
            if token.lstrip:
                start = max(len(text[:start].rstrip(WHITESPACE)), last)
            if token.rstrip:
                stop = len(text) - len(text[stop:].lstrip(WHITESPACE))
            if last < start:
                out.append((last, start, None))
            out.append((start, stop, token))
            last = stop
        if last < len(text):
            out.append((last, len(text), None))
        return out


class AddedVocabulary:
    """The added tokens: the two matchers, ids, and which are special. ``by_id`` gives the string decoding sees:
    the content, or for a ``normalized`` token its normalized form (``Hello`` -> ``▁Hello`` under Llama 2's
    normalizer)."""

    def __init__(self, spec: Spec, added: Any, normalize: Callable[[str], str] | None):
        if not isinstance(added, list):
            spec.fail("field 'added_tokens' must be a list")
        entries = [AddedToken(spec, entry, number) for number, entry in enumerate(added)]
        self.by_content: dict[str, int] = {t.content: t.id for t in entries}
        self.by_id: dict[int, str] = {t.id: t.content for t in entries}
        self.special_contents: set[str] = {t.content for t in entries if t.special}
        raw = {t.content: t for t in entries if not t.normalized}
        normalized: dict[str, AddedToken] = {}
        for token in entries:
            if token.normalized:
                key = normalize(token.content) if normalize is not None else token.content
                self.by_id[token.id] = key or token.content  # decoding sees the normalized form, as in tokenizers
                if key:
                    normalized.setdefault(key, token)
        self.raw = Matcher(spec, raw)
        self.normalized = Matcher(spec, normalized)


def _trie_pattern(spec: Spec, words: list[str]) -> str:
    """A regex matching the longest of ``words`` at the leftmost position (a trie, so fast for thousands)."""
    if max(map(len, words)) > 400:  # too deep to nest: a plain alternation, longest first
        return "|".join(spec.re.escape(w) for w in sorted(words, key=len, reverse=True))
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    escape = spec.re.escape

    def emit(node: dict[str, Any]) -> str:
        branches = [escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)
