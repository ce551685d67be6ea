"""The Unigram ``model`` of a tokenizer.json (T5 / ALBERT / SentencePiece style), as ``tokenizers`` encodes it.

Viterbi over the piece scores; a character no piece covers scores ``min_score - 10`` and becomes ``unk_id``;
consecutive unknowns are fused into one, which ``byte_fallback`` then spells as ``<0x..>`` byte tokens.
"""

from __future__ import annotations

from typing import Any

from ...errors import TokenizerError
from .spec import Spec, byte_token, utf8

UNK_PENALTY = 10.0


class Unigram:
    """A parsed Unigram model: ``tokenize(word) -> ids`` and ``vocab`` (token -> id)."""

    def __init__(self, spec: Spec, model: dict[str, Any], where: str = "model"):
        self.source = spec.source
        pieces = spec.items(model, "vocab", where)
        if not pieces:
            spec.fail(f"field '{where}.vocab' must not be empty")
        self.vocab: dict[str, int] = {}
        self.scores: list[float] = []
        longest: dict[str, int] = {}  # first character -> length of the longest piece starting with it
        for index, entry in enumerate(pieces):
            if (
                not isinstance(entry, list)
                or len(entry) != 2
                or not isinstance(entry[0], str)
                or not isinstance(entry[1], (int, float))
                or isinstance(entry[1], bool)
            ):
                spec.fail(f"field '{where}.vocab' entry #{index} {entry!r} is not a [piece, score] pair")
            piece, score = entry
            self.vocab[piece] = index
            self.scores.append(float(score))
            if piece:
                longest[piece[0]] = max(longest.get(piece[0], 0), len(piece))
        self._longest = longest
        self.min_score = min(self.scores)
        unk = model.get("unk_id")
        if unk is not None and (not isinstance(unk, int) or isinstance(unk, bool) or not 0 <= unk < len(pieces)):
            spec.fail(f"field '{where}.unk_id' {unk!r} is not an index into the vocab")
        self.unk_id: int | None = unk
        self.byte_fallback = spec.flag(model, "byte_fallback", where, False)
        self._bytes = [self.vocab.get(byte_token(b)) for b in range(256)] if self.byte_fallback else []

    def _unk(self) -> int:
        if self.unk_id is None:
            raise TokenizerError(
                f"{self.source}: the text has a character no piece covers, and the model has no unk_id"
            )
        return self.unk_id

    def pieces(self, word: str) -> list[str]:
        """The best segmentation of ``word`` (Viterbi), unknown characters fused, as ``Unigram::encode_optimized``."""
        n = len(word)
        vocab, scores, longest = self.vocab, self.scores, self._longest
        unk_score = self.min_score - UNK_PENALTY
        best = [0.0] * (n + 1)
        start_of: list[int | None] = [None] * (n + 1)
        ids = [0] * (n + 1)
        for start in range(n):
            here = best[start]
            single = False
            for end in range(start + 1, min(n, start + longest.get(word[start], 0)) + 1):
                index = vocab.get(word[start:end])
                if index is None:
                    continue
                candidate = scores[index] + here
                if start_of[end] is None or candidate > best[end]:
                    best[end], start_of[end], ids[end] = candidate, start, index
                if end == start + 1:
                    single = True
            if not single:
                candidate = unk_score + here
                if start_of[start + 1] is None or candidate > best[start + 1]:
                    best[start + 1], start_of[start + 1], ids[start + 1] = candidate, start, self._unk()
        out: list[str] = []
        unknown: list[str] = []
        end = n
        while end > 0:
            start = start_of[end]
            assert start is not None
            if self.unk_id is not None and ids[end] == self.unk_id:
                unknown.append(word[start:end])
            else:
                if unknown:
                    out.append("".join(reversed(unknown)))
                    unknown = []
                out.append(word[start:end])
            end = start
        if unknown:
            out.append("".join(reversed(unknown)))
        out.reverse()
        return out

    def tokenize(self, word: str) -> list[int]:
        """The ids of one pre-tokenized word."""
        ids: list[int] = []
        for piece in self.pieces(word):
            index = self.vocab.get(piece)
            if index is not None:
                ids.append(index)
                continue
            if self.byte_fallback:
                fallback = [self._bytes[b] for b in utf8(piece)]
                if None not in fallback:
                    ids.extend(fallback)
                    continue
            ids.append(self._unk())
        return ids
