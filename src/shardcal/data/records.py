"""Data sets as records: one value per line of a JSONL file or per row of a parquet table (a file, or a directory
of them as the Hugging Face Hub stores a dataset), read from one column.

A column holds one of three kinds of value: ``text`` (a string), ``messages`` (a conversation: a list of
``{"role": ..., "content": ...}`` objects, rendered later with the model's chat template) or ``input_ids`` (a list
of token ids). Without a column named, the first of ``messages``, ``text`` and ``input_ids`` the data has is
read. Records are read lazily, in any order, so that a large data set costs only the records a run uses; every
problem is a :class:`~shardcal.errors.DataError` naming the file, the line or row and what is wrong. Parquet needs
``pyarrow`` (the optional extra ``shardcal[data]``).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError

RECORD_SUFFIXES = (".jsonl", ".parquet")
#: The columns read when none is named, in this order.
DEFAULT_COLUMNS = ("messages", "text", "input_ids")
KINDS = ("text", "messages", "input_ids")
PARQUET_HINT = "pip install 'shardcal[data]' (pyarrow)"


@dataclass
class Records:
    """The records of one source: how many, which column and kind, and each one by index (read on first use)."""

    path: Path
    column: str
    kind: str
    count: int
    reader: Callable[[int], tuple[Any, str]] = field(repr=False)
    extras: Callable[[int], dict[str, Any]] = field(repr=False, default=lambda index: {})

    def value(self, index: int) -> Any:
        """Record ``index``'s value, checked against the column's kind."""
        value, where = self.reader(index)
        return check_value(value, self.kind, f"{where}: field '{self.column}'")

    def where(self, index: int) -> str:
        """``"<path>: line N"`` or ``"<path>: row N"``: how errors name the record."""
        return self.reader(index)[1]


def is_record_source(path: Path) -> bool:
    """A JSONL file, a parquet file or a directory (of parquet files)."""
    return path.is_dir() or path.suffix.lower() in RECORD_SUFFIXES


def read_records(path: Path, column: str | None = None) -> Records:
    """The records of a ``.jsonl`` file, a ``.parquet`` file or a directory of parquet files, read from ``column``
    (default: the first of :data:`DEFAULT_COLUMNS` present)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        if not files:
            raise DataError(f"{path}: a data directory must hold .parquet files (the Hub's layout); it holds none")
        return _parquet_records(path, files, column)
    if not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    if path.suffix.lower() == ".parquet":
        return _parquet_records(path, [path], column)
    return _jsonl_records(path, column)


# ----------------------------------------------------------------------------------------------------- kinds


def kind_of(value: Any) -> str | None:
    """Which kind of record a value is (None: none of them)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(item, dict) for item in value):
            return "messages"
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return "input_ids"
    return None


def check_value(value: Any, kind: str, where: str) -> Any:
    """``value`` when it is a valid record of ``kind``; a :class:`DataError` naming ``where`` and the problem."""
    if kind == "text":
        if not isinstance(value, str):
            raise DataError(f"{where}: expected a string, got {_type_name(value)}")
        return value
    if kind == "input_ids":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(item, int) and not isinstance(item, bool) for item in value
        ):
            raise DataError(f"{where}: expected a list of integer token ids, got {_describe(value)}")
        if not value:
            raise DataError(f"{where}: the list of token ids is empty")
        return list(value)
    return _check_messages(value, where)


def _check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: expected a non-empty list of messages, got {_describe(value)}")
    for number, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {number} is {_type_name(message)}, not an object with role and content")
        if not isinstance(message.get("role"), str):
            raise DataError(f"{where}: message {number} has no string 'role' (keys: {sorted(message)})")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(
                f"{where}: message {number} ({message['role']}): 'content' must be a string or a list of parts, "
                f"got {_type_name(content)}"
            )
    return [dict(message) for message in value]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "an empty list" if not value else f"a list of {', '.join(sorted({_type_name(v) for v in value}))}"
    return _type_name(value)


def _choose_column(available: Sequence[str], column: str | None, where: str) -> str:
    if column is not None:
        if column not in available:
            raise DataError(f"{where}: has no column '{column}' (found: {', '.join(available) or 'none'})")
        return column
    for name in DEFAULT_COLUMNS:
        if name in available:
            return name
    raise DataError(
        f"{where}: has none of the columns {', '.join(DEFAULT_COLUMNS)} (found: {', '.join(available) or 'none'}); "
        "name the one to read with --data-column"
    )


def _kind_of_column(first: Any, column: str, where: str) -> str:
    """A column named ``messages``, ``text`` or ``input_ids`` holds that kind; any other, the kind of its first
    value."""
    if column in KINDS:
        check_value(first, column, f"{where}: field '{column}'")
        return column
    kind = kind_of(first)
    if kind is None:
        raise DataError(
            f"{where}: field '{column}' holds {_describe(first)}, not a string (text), a list of messages or a list "
            "of token ids"
        )
    return kind


# ----------------------------------------------------------------------------------------------------- JSONL


def _jsonl_records(path: Path, column: str | None) -> Records:
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            text = handle.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None
    lines = text.split("\n")  # not splitlines(): JSON strings may hold a raw U+2028
    numbers = [number for number, line in enumerate(lines, 1) if line.strip()]
    if not numbers:
        raise DataError(f"{path}: is empty")
    parsed: dict[int, dict[str, Any]] = {}

    def record(index: int) -> dict[str, Any]:
        if index not in parsed:
            number = numbers[index]
            try:
                value = json.loads(lines[number - 1])
            except (json.JSONDecodeError, RecursionError) as exc:
                raise DataError(f"{path}: line {number} is not valid JSON ({exc})") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}: line {number} is {_type_name(value)}, not a JSON object")
            parsed[index] = value
        return parsed[index]

    first = record(0)
    chosen = _choose_column(list(first), column, f"{path}: line {numbers[0]}")

    def read(index: int) -> tuple[Any, str]:
        where = f"{path}: line {numbers[index]}"
        values = record(index)
        if chosen not in values:
            raise DataError(f"{where} has no '{chosen}' field")
        return values[chosen], where

    kind = _kind_of_column(first[chosen], chosen, f"{path}: line {numbers[0]}")
    return Records(path=path, column=chosen, kind=kind, count=len(numbers), reader=read,
                   extras=lambda index: _tools(record(index)))  # fmt: skip


def _tools(record: dict[str, Any]) -> dict[str, Any]:
    """What a record carries for the template beside its messages: its ``tools`` (function schemas)."""
    tools = record.get("tools")
    return {"tools": tools} if isinstance(tools, list) else {}


# ----------------------------------------------------------------------------------------------------- parquet


def _parquet_records(root: Path, files: list[Path], column: str | None) -> Records:
    parquet = _pyarrow_parquet()
    handles = []
    for path in files:
        try:
            handles.append(parquet.ParquetFile(str(path)))
        except Exception as exc:  # pyarrow raises its own types for a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({' '.join(str(exc).split())})") from None
    chosen = _choose_column(handles[0].schema_arrow.names, column, str(files[0]))
    for path, handle in zip(files, handles):
        _choose_column(handle.schema_arrow.names, chosen, str(path))  # every file has the column
    starts, total = [], 0
    for handle in handles:
        starts.append(total)
        total += handle.metadata.num_rows
    if total == 0:
        raise DataError(f"{root}: the parquet data hold no rows")
    columns: dict[int, list[Any]] = {}
    tools: dict[int, list[Any] | None] = {}

    def locate(index: int) -> tuple[int, int]:
        file_index = bisect.bisect_right(starts, index) - 1  # the last file starting at or before it (empty: skipped)
        return file_index, index - starts[file_index]

    def load(file_index: int) -> None:
        if file_index not in columns:
            handle, names = handles[file_index], handles[file_index].schema_arrow.names
            wanted = [chosen] + (["tools"] if "tools" in names and chosen != "tools" else [])
            try:
                table = handle.read(columns=wanted)
            except Exception as exc:
                raise DataError(
                    f"{files[file_index]}: cannot read column '{chosen}' ({' '.join(str(exc).split())})"
                ) from None
            columns[file_index] = table.column(chosen).to_pylist()
            tools[file_index] = table.column("tools").to_pylist() if len(wanted) > 1 else None

    def read(index: int) -> tuple[Any, str]:
        file_index, row = locate(index)
        load(file_index)
        return columns[file_index][row], f"{files[file_index]}: row {row}"

    def extras(index: int) -> dict[str, Any]:
        file_index, row = locate(index)
        load(file_index)
        found = tools[file_index]
        return {"tools": found[row]} if found is not None and isinstance(found[row], list) else {}

    first_index = next(i for i, handle in enumerate(handles) if handle.metadata.num_rows)
    first, where = read(starts[first_index])
    kind = _kind_of_column(first, chosen, where)
    return Records(path=root, column=chosen, kind=kind, count=total, reader=read, extras=extras)


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise DataError(f"parquet data need pyarrow: {PARQUET_HINT}") from None
    return parquet
