"""The BPE ``model`` of a tokenizer.json: merges applied lowest rank first, leftmost on ties, as ``tokenizers`` does.

Options: ``unk_token`` and ``fuse_unk``, ``byte_fallback`` (``<0x..>`` tokens for characters not in the vocab),
``ignore_merges``, ``continuing_subword_prefix`` / ``end_of_word_suffix``; ``dropout`` must be null or 0.
"""

from __future__ import annotations

import heapq
from typing import Any

from .spec import Spec, byte_token, utf8


class BPE:
    """A parsed BPE model: ``tokenize(word) -> ids`` and ``vocab`` (token -> id)."""

    def __init__(self, spec: Spec, model: dict[str, Any], where: str = "model"):
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            spec.fail(f"field '{where}.vocab' must be a non-empty object mapping tokens to ids")
        for token, index in vocab.items():
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                spec.fail(f"field '{where}.vocab': token {token!r} has id {index!r}, expected a non-negative integer")
        self.vocab: dict[str, int] = dict(vocab)
        if model.get("dropout") not in (None, 0, 0.0):
            spec.fail(
                f"field '{where}.dropout' = {model['dropout']!r} is not supported (encoding must be deterministic)"
            )
        self.ignore_merges = spec.flag(model, "ignore_merges", where, False)
        self.byte_fallback = spec.flag(model, "byte_fallback", where, False)
        self.fuse_unk = spec.flag(model, "fuse_unk", where, False)
        self.prefix = _optional_text(spec, model, "continuing_subword_prefix", where)
        self.suffix = _optional_text(spec, model, "end_of_word_suffix", where)
        unk = model.get("unk_token")
        if unk is not None and (not isinstance(unk, str) or unk not in self.vocab):
            spec.fail(f"field '{where}.unk_token' {unk!r} is not in the vocab")
        self.unk_id: int | None = self.vocab[unk] if unk is not None else None
        self._simple = not (self.byte_fallback or self.fuse_unk or self.prefix or self.suffix)
        self._bytes = [self.vocab.get(byte_token(b)) for b in range(256)] if self.byte_fallback else []
        self.merges = self._parse_merges(spec, model, where)

    def _parse_merges(self, spec: Spec, model: dict[str, Any], where: str) -> dict[tuple[int, int], tuple[int, int]]:
        merges = model.get("merges")
        if not isinstance(merges, list):
            spec.fail(f"field '{where}.merges' must be a list")
        vocab, prefix = self.vocab, self.prefix
        table: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, merge in enumerate(merges):
            if isinstance(merge, str):
                parts = merge.split(" ")
            elif isinstance(merge, list) and all(isinstance(p, str) for p in merge):
                parts = merge
            else:
                parts = []
            if len(parts) != 2:
                spec.fail(f"field '{where}.merges' entry #{rank} {merge!r} is not a pair of tokens")
            left, right = parts
            joined = left + right
            if prefix:  # tokenizers drops the prefix's length in bytes from the right part
                try:
                    joined = left + utf8(right)[len(utf8(prefix)) :].decode("utf-8")
                except UnicodeDecodeError:
                    spec.fail(f"field '{where}.merges' entry #{rank} {merge!r}: {right!r} is shorter than the prefix")
            ids = [vocab.get(part) for part in (left, right, joined)]
            if None in ids:
                missing = next(p for p, i in zip((left, right, joined), ids) if i is None)
                spec.fail(f"field '{where}.merges' entry #{rank} {merge!r}: token {missing!r} is not in the vocab")
            table[(ids[0], ids[1])] = (rank, ids[2])  # a repeated pair: the last one counts, as in tokenizers
        return table

    def tokenize(self, word: str) -> list[int]:
        """The ids of one pre-tokenized word."""
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        if self._simple:
            vocab, unk = self.vocab, self.unk_id
            ids = []
            for char in word:
                index = vocab.get(char, unk)
                if index is not None:  # a character with no token and no unk token is dropped, as tokenizers does
                    ids.append(index)
        else:
            ids = self._symbols(word)
        return merge_ids(ids, self.merges) if len(ids) > 1 else ids

    def _symbols(self, word: str) -> list[int]:
        """The initial symbols, with unk fusing, byte fallback and the subword prefix/suffix (``merge_word``)."""
        vocab, ids, last = self.vocab, [], len(word) - 1
        pending_unk = False
        for position, char in enumerate(word):
            key = char
            if position and self.prefix:
                key = self.prefix + key
            if position == last and self.suffix:
                key = key + self.suffix
            index = vocab.get(key)
            if index is not None:
                if pending_unk:
                    ids.append(self.unk_id)
                    pending_unk = False
                ids.append(index)
                continue
            if self.byte_fallback:
                fallback = [self._bytes[b] for b in utf8(key)]
                if None not in fallback:
                    ids.extend(fallback)  # as tokenizers: a pending unk is not flushed before byte tokens
                    continue
            if self.unk_id is not None:
                if pending_unk and not self.fuse_unk:
                    ids.append(self.unk_id)
                pending_unk = True
        if pending_unk:
            ids.append(self.unk_id)
        return ids


def _optional_text(spec: Spec, model: dict[str, Any], key: str, where: str) -> str:
    return "" if model.get(key) is None else spec.text(model, key, where)


def merge_ids(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Apply the merges to a symbol sequence, lowest rank first (leftmost on ties), as ``tokenizers`` does."""
    n = len(ids)
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
