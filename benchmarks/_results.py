"""The benchmarks' results as data: each run writes one JSON table that ``tools/results_page.py`` turns into
``docs/results.md``.

A table is one run of one benchmark: its title, the date, the command that made it, the machine, the columns and
rows, and free-text notes. ``write_table`` stores it as ``docs/results/<name>.json`` (atomically), replacing the
previous run's table of that name; numbers are never typed into the page by hand.

    from _results import write_table
    write_table("ptq_quality_smollm2", title=..., command=..., columns=[...], rows=[[...], ...], notes=[...])
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Where the committed tables live (one JSON file per table).
RESULTS_DIR = ROOT / "docs" / "results"


def machine() -> str:
    """This machine in words: CPU model, cores, memory, torch and Python versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    try:
        from importlib import metadata

        torch_version = metadata.version("torch")
    except Exception:
        torch_version = "?"
    return f"{cpu}, {os.cpu_count()} cores{memory}; torch {torch_version}, Python {platform.python_version()}"


def command_line() -> str:
    """The command that is running, as a user would type it (``python benchmarks/x.py --flag``)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def write_table(
    name: str,
    *,
    title: str,
    columns: list[str],
    rows: list[list[Any]],
    notes: list[str] | None = None,
    command: str | None = None,
    results_dir: Path | None = None,
) -> Path:
    """Write one run's table as ``<results_dir>/<name>.json`` (atomically) and return its path.

    ``rows`` hold plain values (numbers, strings, None); ``command`` defaults to the running command line."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"table name {name!r}: a plain file stem is expected")
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"table {name!r}: every row needs {len(columns)} values ({columns})")
    table = {
        "name": name,
        "title": title,
        "date": datetime.date.today().isoformat(),
        "command": command or command_line(),
        "machine": machine(),
        "columns": list(columns),
        "rows": [list(row) for row in rows],
        "notes": list(notes or []),
    }
    folder = results_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / f"{name}.json")
    return folder / f"{name}.json"
