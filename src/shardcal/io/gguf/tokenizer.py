"""A GGUF file's vocabulary (``tokenizer.ggml.*``) as the tokenizer.json and tokenizer_config.json transformers builds
from it: byte-level BPE, or a SentencePiece vocabulary as BPE with byte fallback."""

from __future__ import annotations

from typing import Any

from ...errors import TokenizerError
from .reader import GGUFMetadata

# llama.cpp's pre-tokenizer names -> HF pre-tokenizer JSON. The GPT-2 byte-level regex is applied by ByteLevel
# (use_regex); the others are the regexes llama.cpp (llama-vocab.cpp) uses for the same name.
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen2's: Llama 3's with single digits.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_DIGITS_THEN_GPT2 = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt-2": _byte_level(True),
    "gpt2": _byte_level(True),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_REGEX), _byte_level(False)]},
    "qwen2": {"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), _byte_level(False)]},
    "deepseek-r1-qwen": {"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), _byte_level(False)]},
}
#: Pre-tokenizers whose HF tokenizer.json skips merges for words already in the vocab.
_IGNORE_MERGES = {"llama-bpe"}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def tokenizer_json(meta: GGUFMetadata) -> dict[str, Any]:
    """An HF ``tokenizers``-format tokenizer.json built from a GGUF file's ``tokenizer.ggml.*`` metadata.

    ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE; ``llama`` is a SentencePiece vocabulary, written as the
    BPE-with-byte-fallback tokenizer transformers builds from the same file (Gemma's variant for ``gemma3``).
    """
    path = meta.path
    model = meta.get("tokenizer.ggml.model", None)
    if model not in _TOKENIZER_MODELS:
        raise TokenizerError(
            f"{path}: metadata 'tokenizer.ggml.model' = {model!r} is not supported "
            f"(supported: {', '.join(_TOKENIZER_MODELS)})"
        )
    tokens = meta.list("tokenizer.ggml.tokens")
    types = meta.list("tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens))
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.tokens' must be a non-empty array of strings")
    if len(types) != len(tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} tokens")
    if not all(isinstance(kind, int) and not isinstance(kind, bool) for kind in types):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.token_type' must be an array of integers")
    if model == "llama":
        return _sentencepiece_json(meta, tokens, types)
    return _byte_level_json(meta, tokens, types)


_TOKENIZER_MODELS = ("gpt2", "llama")


def _added_token(index: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": index,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[list[str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first.

    The same order as transformers' ``generate_merges``: per piece its splits by the ids of their halves, then all
    merges by (score, length of the left half, length of the right half), descending, ties in that order.
    """
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _template(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> dict[str, Any]:
    """transformers' TemplateProcessing for optional BOS/EOS: ``[bos] $A [eos]`` and ``[bos] $A [eos] [bos] $B [eos]``."""

    def seq(part: str, type_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if bos is not None:
            items.append({"SpecialToken": {"id": bos, "type_id": type_id}})
        items.append({"Sequence": {"id": part, "type_id": type_id}})
        if eos is not None:
            items.append({"SpecialToken": {"id": eos, "type_id": type_id}})
        return items

    specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None}
    return {
        "type": "TemplateProcessing",
        "single": seq("A", 0),
        "pair": seq("A", 0) + seq("B", 1),
        "special_tokens": specials,
    }


def _sentencepiece_json(meta: GGUFMetadata, tokens: list[str], types: list[Any]) -> dict[str, Any]:
    """A SentencePiece (``tokenizer.ggml.model = llama``) vocabulary as BPE with byte fallback.

    Pieces are scored (``tokenizer.ggml.scores``); the merges are every split of a piece into two pieces, best
    first. Bytes without a piece fall back to the ``<0xNN>`` tokens. Gemma files are special in three ways, as in
    transformers: whitespace pieces stored with real spaces are spelled with ``▁``, the merge order is the file
    order (Gemma's scores do not follow it), and spaces become ``▁`` in a normalizer with no prefix space, where
    Llama-style vocabularies get a ``Metaspace`` pre-tokenizer that prepends one to the first word.
    """
    path = meta.path
    gemma = meta.get("general.architecture", None) == "gemma3"
    stored = tokens
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta.metadata:
        merges = []
        for number, merge in enumerate(meta.list("tokenizer.ggml.merges")):
            parts = merge.split(" ") if isinstance(merge, str) else []
            if len(parts) != 2:
                raise TokenizerError(f"{path}: merge #{number} {merge!r} is not two tokens separated by one space")
            merges.append(parts)
    else:
        if gemma:
            scores: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
        else:
            values = meta.list("tokenizer.ggml.scores")
            if len(values) != len(tokens) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise TokenizerError(
                    f"{path}: 'tokenizer.ggml.scores' must be {len(tokens)} numbers, one per token (got {len(values)})"
                )
            scores = dict(zip(tokens, values))
        merges = _merges_from_scores(vocab, scores)

    def token(name: str) -> tuple[str | None, int | None]:
        index = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        if index is None:
            return None, None
        if index >= len(tokens):
            raise TokenizerError(
                f"{path}: metadata 'tokenizer.ggml.{name}_token_id' = {index} is not below the {len(tokens)} tokens"
            )
        return tokens[index], index

    (bos, bos_id), (eos, eos_id), (unk, unk_id), (pad, pad_id) = (
        token(n) for n in ("bos", "eos", "unknown", "padding")
    )
    special = {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
    special |= {i for i, kind in enumerate(types) if int(kind) == _TOKEN_CONTROL}
    # User-defined pieces stay whole (not special); Gemma's whitespace pieces, respelled above, are not among them.
    user = {vocab[t] for t, kind in zip(stored, types) if int(kind) == _TOKEN_USER_DEFINED and t in vocab} - special
    added = [_added_token(i, tokens[i], i in special) for i in sorted(special | user)]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    replace_space = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    decoders: list[dict[str, Any]] = [replace_space, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if gemma:
        normalizer: dict[str, Any] | None = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        pre: dict[str, Any] = {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        }
        unk_token = unk if unk is not None else "<unk>"
    else:
        normalizer = None
        pre = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        unk_token = None
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": _template(bos if add_bos else None, bos_id, eos if add_eos else None, eos_id),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _byte_level_json(meta: GGUFMetadata, tokens: list[str], types: list[Any]) -> dict[str, Any]:
    """A byte-level BPE (``tokenizer.ggml.model = gpt2``) vocabulary with its merges and pre-tokenizer."""
    path = meta.path
    merges = meta.list("tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")  # files from before the key existed: plain GPT-2
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{path}: 'tokenizer.ggml.tokens' holds duplicate tokens")
    pairs = []
    for number, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise TokenizerError(f"{path}: merge #{number} {merge!r} is not two tokens separated by one space")
        pairs.append(parts)
    added = [
        {
            "id": index,
            "content": tokens[index],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": int(kind) != _TOKEN_USER_DEFINED,
        }
        for index, kind in enumerate(types)
        if int(kind) in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    bos = meta.int("tokenizer.ggml.bos_token_id", None)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    post: dict[str, Any] | None = None
    if add_bos:
        bos_token = tokens[bos]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos_token, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [bos], "tokens": [bos_token]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in _IGNORE_MERGES,
            "vocab": vocab,
            "merges": pairs,
        },
    }


def tokenizer_config(meta: GGUFMetadata, tokens: list[str]) -> dict[str, Any]:
    def token(name: str) -> str | None:
        index = meta.int(f"tokenizer.ggml.{name}_token_id", None)
        return tokens[index] if index is not None and index < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.ggml.model", None) == "llama":  # SentencePiece: BOS unless the file says otherwise
        cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        cfg["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template", None)
    if isinstance(template, str):
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}
