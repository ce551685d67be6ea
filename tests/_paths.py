"""Where the tests live: the root folder (shared helpers such as ``_dist``) and one folder per package."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_dirs() -> list[str]:
    """The folders a test process (and each process it starts) puts on ``sys.path``: tests import helpers and each
    other's fixtures as top-level modules (``_dist``, ``test_gguf_tokenizer``)."""
    return [str(TESTS), *sorted(str(d) for d in TESTS.iterdir() if d.is_dir() and d.name[0] not in "._")]
