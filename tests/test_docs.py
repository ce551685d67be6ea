"""The docs say what the code does: every ``shardcal.*`` name in docs/api.md exists, with the defaults shown."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
NAME = re.compile(r"\bshardcal(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
CALL = re.compile(r"\b(shardcal(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\(([^()]*)\)")
DEFAULT = re.compile(r"\b([a-z_][a-z0-9_]*)=([^,()]+)")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def resolve(dotted: str):
    """The object a dotted name denotes: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


API = (DOCS / "api.md").read_text(encoding="utf-8")
BLOCKS = "\n".join(code_blocks(API))


@pytest.mark.parametrize("name", sorted(set(NAME.findall(BLOCKS)) | set(NAME.findall(API))))
def test_every_documented_name_exists(name):
    resolve(name)


def _calls() -> list[tuple[str, str]]:
    text = re.sub(r"\n\s+", " ", BLOCKS)  # join continuation lines of a call
    return [(m.group(1), m.group(2)) for m in CALL.finditer(text)]


@pytest.mark.parametrize(("name", "args"), _calls())
def test_documented_defaults_are_the_codes(name, args):
    obj = resolve(name)
    params = inspect.signature(obj).parameters
    for key, shown in DEFAULT.findall(args):
        assert key in params, f"{name}: no parameter {key!r}"
        if shown.strip().isidentifier() and shown.strip() not in ("None", "True", "False"):
            continue  # an example argument (model=model), not a default
        default = params[key].default
        assert default is not inspect.Parameter.empty, f"{name}: {key} has no default"
        assert repr(default) == shown.strip() or str(default) == shown.strip().strip('"'), (name, key, default, shown)
