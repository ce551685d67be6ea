"""The mutation check's catalogue stays in step with the code (tools/mutants.py, tools/mutation.py).

Running the mutants is slow (``make mutation``); this only checks, in well under a second, that every catalogue entry
still applies to exactly one place and compiles, that every mutated module has tests mapped to it, and that the
mechanical operator mutants are one-token changes that compile. When a change to ``src/`` moves a line a mutant
targets, update that entry's ``old``/``new`` text (and rerun ``make mutation``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import mutation  # noqa: E402
from mutants import CATALOGUE  # noqa: E402


def test_catalogue_ids_are_unique_and_modules_mapped():
    ids = [m.id for m in CATALOGUE]
    assert len(ids) == len(set(ids))
    assert {m.module for m in CATALOGUE} <= set(mutation.TESTS)
    for module, tests in mutation.TESTS.items():
        assert (ROOT / "src" / "shardcal" / module).is_file(), module
        for test in tests:
            assert (ROOT / test.split("::")[0]).is_file(), (module, test)
    assert all(m.description for m in CATALOGUE)


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.id for m in CATALOGUE])
def test_catalogue_entry_applies(mutant):
    text = mutation.apply(mutant, ROOT)
    compile(text, mutant.module, "exec")
    assert text != (ROOT / "src" / "shardcal" / mutant.module).read_text(encoding="utf-8")


def test_operator_mutants_change_one_token_and_compile():
    mutants = mutation.operator_mutants("quant/merge.py")
    original = (ROOT / "src" / "shardcal" / "quant" / "merge.py").read_text(encoding="utf-8")
    assert mutants
    for m in mutants:
        assert m.old != m.new and m.old.count("\n") == m.new.count("\n") == 1
        text = mutation.apply(m, ROOT)
        compile(text, "merge.py", "exec")
        assert sum(a != b for a, b in zip(text.splitlines(), original.splitlines())) == 1
