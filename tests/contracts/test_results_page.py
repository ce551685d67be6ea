"""The results page is generated from the benchmarks' JSON tables, never edited by hand (tools/results_page.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


results = _module(ROOT / "benchmarks" / "_results.py", "_results_under_test")
page = _module(ROOT / "tools" / "results_page.py", "results_page_under_test")


def test_page_is_what_the_tables_give():
    """docs/results.md equals the page generated from docs/results/*.json (rerun tools/results_page.py)."""
    assert page.main(["--check"]) == 0


def test_written_table_renders_every_row_and_fact(tmp_path):
    path = results.write_table(
        "demo_table",
        title="A table",
        columns=["recipe", "perplexity", "seconds"],
        rows=[["fp8", 18.4401, 12.0], ["w4|a16", None, 3]],
        notes=["one note"],
        command="python benchmarks/x.py --flag",
        results_dir=tmp_path,
    )
    table = json.loads(path.read_text())
    assert table["command"] == "python benchmarks/x.py --flag"
    assert table["date"] and "cores" in table["machine"]
    text = page.render_table(table)
    assert "| fp8 | 18.44 | 12 |" in text
    assert "| w4\\|a16 | – | 3 |" in text
    assert "python benchmarks/x.py --flag" in text and table["date"] in text and "- one note" in text
    assert [t["name"] for t in page.load_tables(tmp_path)] == ["demo_table"]


def test_rows_must_match_the_columns(tmp_path):
    with pytest.raises(ValueError, match="every row needs 2 values"):
        results.write_table("t", title="t", columns=["a", "b"], rows=[[1]], results_dir=tmp_path)
    assert not list(tmp_path.iterdir())
