"""Every relative link in README.md and docs/ resolves (the file, and the heading a ``#fragment`` names), and every
``docs/*.md`` path the code, tools, recipes and tests name exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NAMING = ["src", "tools", "benchmarks", "calibration", "examples", "tests"]
#: Old page paths still named in modules being rewritten on other branches when docs/ was split (their owners move
#: them to the new path, then drop the entry here): file -> the stale paths it may still name.
PENDING = {
    "src/shardcal/plan/planner.py": {"docs/scaling.md"},
}


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (a link shown as code is not a link)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces made hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ``#fragment`` every heading of ``page`` answers to (a repeated heading gets ``-1``, ``-2``, ...)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = _slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of ``page``'s markdown links that are not web addresses or mail."""
    targets = re.findall(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", _prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file or heading does not exist, each as written."""
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / unquote(path)).resolve() if path else page
        if not resolved.exists() or (fragment and resolved.suffix == ".md" and fragment not in anchors(resolved)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links {broken_links(page)}"


def test_the_docs_index_links_every_page():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in relative_links(index)}
    missing = [p.relative_to(ROOT) for p in PAGES if p.parent != ROOT and p != index and p.resolve() not in linked]
    assert not missing, f"pages docs/README.md does not list: {missing}"


def _named_doc_paths() -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    files = [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run", *PAGES]
    for folder in NAMING:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".toml", ".md", ".sh") and p.is_file()]
    for file in files:
        if file == Path(__file__).resolve():
            continue  # this file names pages to test the checker
        for path in re.findall(r"\bdocs/[\w./-]*?\.md\b", file.read_text(encoding="utf-8")):
            named.setdefault(path, []).append(str(file.relative_to(ROOT)))
    return named


def test_every_docs_path_named_exists():
    """A docs page named in a docstring, a ``--help`` text, an error message or a recipe's comment is a real page."""
    named = _named_doc_paths()
    assert "docs/results.md" in named  # the scan sees the code's mentions
    stale = {
        path: pending
        for path, files in named.items()
        if not (ROOT / path).is_file() and (pending := [f for f in files if path not in PENDING.get(f, set())])
    }
    assert not stale, f"docs paths that do not exist, and where they are named: {stale}"


def test_the_checker_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# B page\n\n## Input rotations (`rotation`)\n\n## Same\n\n## Same\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](sub/b.md) [ok](sub/b.md#input-rotations-rotation) [ok](sub/b.md#same-1) [web](https://x.org/y.md)\n"
        "[no file](b.md) [no heading](sub/b.md#nothing) [no second](sub/b.md#same-2) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n[self](#a-page) [self bad](#b-page)\n# A page\n"
    )
    assert broken_links(page) == ["b.md", "sub/b.md#nothing", "sub/b.md#same-2", "#b-page"]
