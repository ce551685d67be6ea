"""The ``post_processor`` of a tokenizer.json: the special tokens around a single sequence (``add_special_tokens``).

Supported: TemplateProcessing (its ``single`` template, e.g. Gemma's and Llama's BOS), BertProcessing and
RobertaProcessing (``cls`` ... ``sep``), ByteLevel (offsets only: no ids), Sequence (at most one template).
"""

from __future__ import annotations

from typing import Any

from .spec import Spec

SUPPORTED = ["TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel", "Sequence"]


def parse_post_processor(spec: Spec, value: Any, where: str = "post_processor") -> list[int | None] | None:
    """The ids a single sequence gets, ``None`` marking the sequence itself; None when nothing is added."""
    if value is None:
        return None
    kind = spec.kind(value, where)
    if kind == "ByteLevel":
        return None
    if kind == "Sequence":
        processors = value.get("processors") or []
        if not isinstance(processors, list):
            spec.fail(f"field '{where}.processors' must be a list")
        templates = [parse_post_processor(spec, p, f"{where}.processors[{i}]") for i, p in enumerate(processors)]
        templates = [t for t in templates if t is not None]
        if len(templates) > 1:
            spec.fail(f"field '{where}': more than one TemplateProcessing is not supported")
        return templates[0] if templates else None
    if kind in ("BertProcessing", "RobertaProcessing"):
        return [_token_id(spec, value, "cls", where), None, _token_id(spec, value, "sep", where)]
    if kind == "TemplateProcessing":
        single, specials = value.get("single"), value.get("special_tokens", {})
        if not isinstance(single, list) or not isinstance(specials, dict):
            spec.fail(f"field '{where}' needs a 'single' list and a 'special_tokens' object")
        template: list[int | None] = []
        for item in single:
            if isinstance(item, dict) and "Sequence" in item:
                template.append(None)
            elif isinstance(item, dict) and isinstance(item.get("SpecialToken"), dict):
                name = item["SpecialToken"].get("id")
                special = specials.get(name) if isinstance(name, str) else None
                ids = special.get("ids") if isinstance(special, dict) else None
                if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    spec.fail(f"field '{where}': special token {name!r} has no 'ids' in 'special_tokens'")
                template.extend(ids)
            else:
                spec.fail(f"field '{where}.single' has an unrecognised item {item!r}")
        return template
    spec.unsupported(where, "post-processor", kind, SUPPORTED)


def _token_id(spec: Spec, value: dict[str, Any], key: str, where: str) -> int:
    pair = value.get(key)
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int) and not isinstance(pair[1], bool)):
        spec.fail(f"field '{where}.{key}' must be a [token, id] pair")
    return pair[1]
