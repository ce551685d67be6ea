"""The docs say what the code does: every ``shardcal.*`` name in docs/reference/api.md exists, with the defaults shown."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
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


API = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
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


# ---------------------------------------------------------------------------------------------- command lines
ROOT = DOCS.parent
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _command_lines() -> list[tuple[str, str]]:
    """``(file, command)`` for every ``shardcal ...`` command in the docs' shell blocks (continuations joined)."""
    found = []
    for path in MARKDOWN:
        blocks = re.findall(r"```(\w*)\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
        for block in [text for language, text in blocks if language in ("bash", "sh", "console", "")]:
            joined = re.sub(r"\\\n\s*|\n(?=\s+[\[-])", " ", block)  # "\" continuations, indented option lines
            for line in joined.splitlines():
                line = line.split("#")[0].strip()
                if re.match(r"^(shardcal |python -m shardcal |torchrun .*-m shardcal )", line):
                    found.append((str(path.relative_to(ROOT)), line[line.index("shardcal ") + len("shardcal ") :]))
    return found


def _options(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize(("source", "command"), _command_lines())
def test_documented_commands_use_real_options(source, command):
    """Every ``--option`` a doc shows exists on the subcommand it is shown with; the subcommand exists."""
    import argparse

    from shardcal.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    words = command.replace("[", " ").replace("]", " ").split()
    if words[0].startswith("--"):
        assert words[0] in _options(parser), (source, command)
        return
    assert words[0] in sub.choices, (source, command)
    known = _options(sub.choices[words[0]]) | _options(parser)
    for word in words[1:]:
        if word.startswith("--"):
            assert word.split("=")[0] in known, (source, word, command)


def test_documented_commands_without_placeholders_run(capsys):
    """The commands that can run here as written (no model or file to fill in) exit 0."""
    from shardcal.cli import main as cli

    shown = {re.sub(r"\[[^\]]*\]", "", c).strip() for _, c in _command_lines()}  # optional parts left out
    runnable = {c for c in shown if not re.search(r"[A-Z_]{3,}|/|\.gguf", c)} - {"demo"}  # demo: test_cli
    assert "recipes" in runnable, runnable
    for command in sorted(runnable):
        try:
            status = cli.main(command.split())
        except SystemExit as exc:  # --version
            status = exc.code
        assert status == 0, (command, capsys.readouterr())


def shipped_recipes_table() -> str:
    """docs/reference/quant-recipes.md's table of shipped recipes, from the recipe files (``shardcal recipes``' rows)."""
    from shardcal.pipeline.chooser import recipe_rows

    lines = ["| recipe | weight | input | algorithm | description |", "|---|---|---|---|---|"]
    lines += [f"| `{name}` | {' | '.join(cells)} |" for name, *cells in recipe_rows()]
    return "\n".join(lines)


def test_the_shipped_recipes_table_is_the_recipes():
    text = (ROOT / "docs" / "reference" / "quant-recipes.md").read_text(encoding="utf-8")
    table = text.split("<!-- shipped-recipes -->\n", 1)[1].split("\n<!-- /shipped-recipes -->", 1)[0]
    assert table == shipped_recipes_table(), "regenerate with: python tests/contracts/test_docs.py"


def test_the_documented_unknown_recipe_error_is_the_real_one():
    from shardcal.calib.recipes import load_recipe
    from shardcal.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        load_recipe("w3a3")
    assert str(info.value) in (ROOT / "docs" / "reference" / "quant-recipes.md").read_text(encoding="utf-8")


if __name__ == "__main__":
    path = ROOT / "docs" / "reference" / "quant-recipes.md"
    head, rest = path.read_text(encoding="utf-8").split("<!-- shipped-recipes -->\n", 1)
    tail = rest.split("\n<!-- /shipped-recipes -->", 1)[1]
    path.write_text(f"{head}<!-- shipped-recipes -->\n{shipped_recipes_table()}\n<!-- /shipped-recipes -->{tail}")
