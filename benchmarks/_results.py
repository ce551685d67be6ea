"""The benchmarks' results as data: each run writes one JSON table that ``tools/results_page.py`` turns into
``docs/results.md``.

A table is one run of one benchmark: its title, the date, the command that made it, the machine, the columns and
rows, and free-text notes. ``write_table`` stores it as ``docs/results/<name>.json`` (atomically), replacing the
previous run's table of that name; numbers are never typed into the page by hand. ``order`` places the table on
the page (``ORDER``: quality, speed, memory, planner accuracy, the GPU check, peers).

    from _results import ORDER, write_table
    write_table("ptq_quality_smollm2", title=..., columns=[...], rows=[[...], ...], notes=[...],
                order=ORDER["quality"])

A benchmark script takes ``--no-save`` (print only) and ``--results-dir DIR`` (write there instead: a trial run)
through ``add_save_options``, and writes through ``save_table``: a run that leaves out rows of the default run (a
subset of the recipes, a model that is not the reference one) names why in ``off_reference`` and then replaces no
committed table unless ``--results-dir`` says where it goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Where the committed tables live (one JSON file per table).
RESULTS_DIR = ROOT / "docs" / "results"
#: Where each kind of measurement goes on the results page: a table's ``order`` (the page sorts by it, then by
#: title); a benchmark with several tables of one kind adds 1, 2, ... to keep them in its own order.
ORDER: dict[str, int] = {"quality": 100, "speed": 200, "memory": 300, "planner": 400, "gpu": 500, "peers": 600}
#: The columns of a table of ratios: what was measured and what it is compared with, measured in the same run.
RATIO_COLUMNS = ["measurement", "value", "compared with", "its value", "unit", "ratio", "target"]


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
    try:  # how busy the machine was (timings on a shared machine are only as good as that)
        load = f"; load average {os.getloadavg()[0]:.1f} when written"
    except (OSError, AttributeError):
        load = ""
    return f"{cpu}, {os.cpu_count()} cores{memory}; torch {torch_version}, Python {platform.python_version()}{load}"


def command_line() -> str:
    """The command that is running, as a user would type it (``python benchmarks/x.py --flag``)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def _plain(value: Any) -> Any:
    """A cell as strict JSON holds it: a float that is not finite becomes its name ("inf", "nan")."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def write_table(
    name: str,
    *,
    title: str,
    columns: list[str],
    rows: list[list[Any]],
    notes: list[str] | None = None,
    command: str | None = None,
    results_dir: Path | None = None,
    order: int | None = None,
) -> Path:
    """Write one run's table as ``<results_dir>/<name>.json`` (atomically) and return its path.

    ``rows`` hold plain values (numbers, strings, None); ``command`` defaults to the running command line; ``order``
    places the table on the results page (see ``ORDER``; without it the table goes last)."""
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
        "rows": [[_plain(v) for v in row] for row in rows],
        "notes": list(notes or []),
    }
    if order is not None:
        table["order"] = int(order)
    text = json.dumps(table, indent=1, ensure_ascii=False, allow_nan=False) + "\n"  # fails before any file exists
    folder = results_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / f"{name}.json")
    return folder / f"{name}.json"


def ratio_row(
    measurement: str, value: float | None, unit: str, compared_with: str = "", its_value: float | None = None,
    target: str = "", digits: int = 1,
) -> list[Any]:  # fmt: skip
    """One row of ``RATIO_COLUMNS``: ``value`` (and what it is compared with) rounded to ``digits``, and their ratio
    to two decimals (None without a comparison, or where either is None: not measured here)."""
    ratio = None if value is None or its_value in (None, 0) else round(value / its_value, 2)
    mine = None if value is None else round(value, digits)
    theirs = None if its_value is None else round(its_value, digits)
    return [measurement, mine, compared_with or None, theirs, unit, ratio, target or None]


def add_save_options(parser: argparse.ArgumentParser) -> None:
    """``--no-save`` and ``--results-dir``: where (and whether) a benchmark writes its tables."""
    parser.add_argument("--no-save", action="store_true", help="print the tables only, write no JSON")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="write the tables here instead of docs/results (a trial run: the results page shows docs/results only)",
    )


def save_table(args: argparse.Namespace, name: str, *, off_reference: str | None = None, **table: Any) -> Path | None:
    """Write a table as ``args`` say (``add_save_options``), print where, and return the path (None: not written).

    ``off_reference`` says why this run is not the one the committed table holds (e.g. "--recipes leaves out
    recipes"): such a run writes only where ``--results-dir`` points. ``table`` is ``write_table``'s keywords."""
    if args.no_save:
        return None
    if off_reference and args.results_dir is None:
        print(f"not saved to {RESULTS_DIR / (name + '.json')}: {off_reference} (--results-dir DIR writes it there)")
        return None
    path = write_table(name, results_dir=args.results_dir, **table)
    print(f"wrote {path}")
    return path
