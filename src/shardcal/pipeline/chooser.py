"""The recipe chooser: the shipped recipes by scheme, where each export runs, and what it measured.

``shardcal recipes`` prints :func:`recipe_table`; ``shardcal recipes NAME`` the recipe's TOML followed by
:func:`recipe_notes`. Quality and time come from the benchmarks' result tables (``docs/results/*.json``, shipped in
the wheel as ``shardcal/results/``; see docs/results.md), never typed by hand; where a table has no row for a
recipe the cell says ``-``. Where an export runs comes from :mod:`shardcal.export.consumers`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..calib.recipe import Recipe
from ..calib.recipes import load_recipe, shipped_recipes
from ..calib.report import CalibrationReport
from ..export.consumers import deployment

#: The reference models of the quality columns: (column title, the user_path benchmark table's name: each recipe run
#: as a user runs it — the bf16 checkpoint as published, the CLI on 2 ranks, the export judged from disk).
REFERENCE_MODELS: tuple[tuple[str, str, str], ...] = (
    ("SmolLM2", "user_path_smollm2", "SmolLM2-135M"),
    ("Gemma 3", "user_path_gemma3-270m", "Gemma-3-270M"),
)
#: The chooser's columns of where an export runs (:meth:`~shardcal.export.consumers.Deployment.cells`).
RUNTIME_COLUMNS = ("vLLM GPU", "vLLM CPU", "transformers")
#: The table the time column comes from (the first reference model's: the calibrate command, as a process).
TIME_TABLE = "user_path_smollm2"
#: The vLLM check's per-recipe summary (``make test-vllm`` / benchmarks/vllm_check.py).
VLLM_TABLE = "vllm_status"
#: Schemes in the order the chooser lists them, with the words that head each group.
SCHEMES: dict[str, str] = {
    "FP8": "FP8 weights and activations (W8A8-FP8): Hopper, Ada and Blackwell GPUs",
    "INT8": "INT8 weights and activations (W8A8-INT8): most GPUs, also CPUs",
    "INT4": "INT4 weights, 16-bit activations (W4A16): memory-bound serving, small batches",
    "NVFP4": "NVFP4 weights and activations (W4A4): Blackwell GPUs",
    "FP8 block": "FP8 weights per 128 x 128 block, FP8 activations per group of 128 (FP8_BLOCK): DeepSeek-V3's format",
    "W8A16": "INT8 weights, 16-bit activations (W8A16): where activations cannot be quantized",
    "W4AFP8": "INT4 weights, FP8 activations (W4AFP8): Hopper GPUs",
    "NVFP4A16": "NVFP4 weights, 16-bit activations (NVFP4A16): most GPUs (FP4 weight-only kernels)",
    "MXFP4": "MXFP4 weights and activations (OCP microscaling, W4A4): Blackwell and MI355 GPUs",
    "MXFP4A16": "MXFP4 weights, 16-bit activations (MXFP4A16): GPT-OSS's format, most GPUs",
    "MXFP8": "MXFP8 weights and activations (OCP microscaling, W8A8): Blackwell and MI355 GPUs",
}


def algorithm_summary(recipe: Recipe) -> str:
    """``gptq``, ``smoothquant + gptq`` (a smoothing pass first), ``rtn``."""
    name = str(recipe.algorithm.get("name", "rtn"))
    smooth = recipe.algorithm.get("smooth")
    return f"{smooth['name']} + {name}" if isinstance(smooth, Mapping) else name


def scheme_of(recipe: Recipe) -> str:
    """The scheme a recipe belongs to (a key of :data:`SCHEMES`), from its weight and input formats."""
    weight = recipe.weight.format if recipe.weight is not None else ""
    inputs = recipe.input.format if recipe.input is not None else None
    if recipe.weight is not None and recipe.weight.granularity == "block" and (weight, inputs) == ("fp8_e4m3",) * 2:
        return "FP8 block"
    return {
        ("fp8_e4m3", "fp8_e4m3"): "FP8",
        ("int8", "int8"): "INT8",
        ("int8", None): "W8A16",
        ("int4", None): "INT4",
        ("int4", "fp8_e4m3"): "W4AFP8",
        ("nvfp4", "nvfp4"): "NVFP4",
        ("nvfp4", None): "NVFP4A16",
        ("mxfp4", "mxfp4"): "MXFP4",
        ("mxfp4", None): "MXFP4A16",
        ("mxfp8", "mxfp8"): "MXFP8",
    }.get((weight, inputs), "other")


def results_dir() -> Path | None:
    """The folder of the benchmarks' result tables: inside the installed package, or a source checkout's
    ``docs/results``; None when neither exists."""
    package = Path(__file__).resolve().parents[1]  # src/shardcal (installed: site-packages/shardcal)
    for candidate in (package / "results", package.parents[1] / "docs" / "results"):
        if candidate.is_dir():
            return candidate
    return None


def read_table(name: str, folder: Path | None = None) -> dict | None:
    """One result table (see benchmarks/_results.py), or None when it is missing or unreadable."""
    folder = folder if folder is not None else results_dir()
    if folder is None:
        return None
    try:
        table = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return table if isinstance(table, dict) and isinstance(table.get("rows"), list) else None


def _rows_by_recipe(table: dict | None) -> dict[str, dict]:
    if table is None:
        return {}
    columns = table.get("columns", [])
    return {str(row[0]): dict(zip(columns, row)) for row in table["rows"] if row}


@dataclass(frozen=True, kw_only=True)
class RecipeEntry:
    """One line of the chooser: the recipe, its scheme, where it runs, and the measured cells."""

    recipe: Recipe
    scheme: str
    runs_in: tuple[
        str, str, str
    ]  # vLLM GPU, vLLM CPU, transformers (:meth:`~shardcal.export.consumers.Deployment.cells`)
    quality: tuple[str, ...]  # per reference model: the export's mean KL divergence from the source, or "-"
    seconds: str  # the calibrate command's time as a process on the first reference model, or "-"
    vllm_check: str  # what the vLLM CPU check found, or "-"


def _quality(row: dict | None) -> str:
    """The mean KL divergence from the source model, to two significant digits (``0.021``), or ``-``."""
    value = (row or {}).get("mean KL")
    return f"{value:.2g}" if isinstance(value, (int, float)) else "-"


def _seconds(row: dict | None) -> str:
    value = (row or {}).get("process s")  # the command as a process, as a user waits for it
    return f"{value:.0f} s" if isinstance(value, (int, float)) else "-"


def entries(folder: Path | None = None) -> list[RecipeEntry]:
    """Every shipped recipe as a :class:`RecipeEntry`, grouped by scheme (in :data:`SCHEMES` order), the
    recommended one first in its group."""
    quality = [_rows_by_recipe(read_table(table, folder)) for _, table, _ in REFERENCE_MODELS]
    times = _rows_by_recipe(read_table(TIME_TABLE, folder))
    vllm = _rows_by_recipe(read_table(VLLM_TABLE, folder))
    out = []
    for name in shipped_recipes():
        recipe = load_recipe(name)
        out.append(
            RecipeEntry(
                recipe=recipe,
                scheme=scheme_of(recipe),
                runs_in=deployment(recipe).cells(),
                quality=tuple(_quality(rows.get(name)) for rows in quality),
                seconds=_seconds(times.get(name)),
                vllm_check=str(vllm.get(name, {}).get("vllm_cpu") or "-"),
            )
        )
    order = list(SCHEMES)
    return sorted(out, key=lambda e: (order.index(e.scheme) if e.scheme in order else len(order),
                                      not e.recipe.recommended, e.recipe.name))  # fmt: skip


def recipe_table(folder: Path | None = None) -> str:
    """What ``shardcal recipes`` prints: per scheme, its recipes (the recommended one first, marked ``*``) with
    where the export runs, perplexity against FP32 on the reference models, calibration time, and what each is
    for."""
    rows = entries(folder)
    header = ("recipe", *RUNTIME_COLUMNS, *(title for title, _, _ in REFERENCE_MODELS), "time", "for")
    cells = [(f"{'*' if e.recipe.recommended else ' '} {e.recipe.name}", *e.runs_in, *e.quality, e.seconds,
              e.recipe.use) for e in rows]  # fmt: skip
    widths = [max(len(str(row[i])) for row in [(f"  {header[0]}", *header[1:]), *cells]) for i in range(len(header))]
    left = {0, 1, 2, 3, len(header) - 1}  # the recipe, where it runs and what it is for; numbers to the right

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(f"{cell:<{w}}" if i in left else f"{cell:>{w}}"
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()  # fmt: skip

    lines = [line((f"  {header[0]}", *header[1:]))]
    current = None
    for entry, row in zip(rows, cells):
        if entry.scheme != current:
            current = entry.scheme
            lines += ["", SCHEMES.get(current, current)]
        lines.append(line(row))
    lines += [
        "",
        "* recommended for its scheme. vLLM GPU, vLLM CPU, transformers: where the export computes what shardcal",
        "measured (TP 1: tensor parallel 1 only; Blackwell: NVFP4 GPUs; Hopper: Hopper GPUs only; fp8 KV:",
        "--kv-cache-dtype fp8; AVX-512: not on AVX2-only CPUs; close: its own activation rounding; wrong: loads,",
        "computes something else). SmolLM2, Gemma 3:",
        "the export's mean KL divergence from the bf16 model per token (lower is better), SmolLM2-135M and Gemma-3-270M",
        "run as a user runs them (the CLI, 2 ranks, the export read from disk; `shardcal eval OUT --kl --num-samples",
        "64`: 64 x 256 held-out tokens); time: the SmolLM2 calibrate command, start to end, on 2 CPU cores",
        "(docs/results.md). `shardcal recipes NAME` prints a recipe's TOML and its notes.",
    ]
    return "\n".join(lines)


def recipe_notes(name: str, folder: Path | None = None) -> list[str]:
    """What ``shardcal recipes NAME`` adds after the recipe's TOML, as TOML comments (so that the output stays a
    valid recipe file): where the export runs and what to know there, what it measured, what the vLLM check found."""
    recipe = load_recipe(name)
    where = deployment(recipe)
    cells = ", ".join(f"{column} {cell}" for column, cell in zip(RUNTIME_COLUMNS, where.cells(), strict=True))
    notes = [f"# runs in: {cells}"] + [f"#   {note}" for note in where.notes()]
    for _, table_name, model in REFERENCE_MODELS:
        table = read_table(table_name, folder)
        row = _rows_by_recipe(table).get(name)
        if row and row.get("mean KL") is not None:
            notes.append(
                f"# {model}: KL {row['mean KL']} +- {row.get('KL se')} from the bf16 source, top-1 agreement "
                f"{row.get('top-1 %')} %, perplexity {row['perplexity']} ({row.get('vs source')} vs the source), "
                f"{_seconds(row)} for the command ({table['date']}, docs/results.md; `shardcal eval OUT --kl "
                f"--num-samples 64` measures the same way)"
            )
    check = _rows_by_recipe(read_table(VLLM_TABLE, folder)).get(name)
    if check:
        notes.append(f"# vLLM CPU check: {check.get('vllm_cpu')}" + (f"; {check['note']}" if check.get("note") else ""))
    if recipe.recommended:
        notes.append(f"# recommended for {scheme_of(recipe)}")
    return notes


def recommended_for(recipe: Recipe) -> Recipe | None:
    """The recommended shipped recipe of ``recipe``'s scheme (None when the scheme has none)."""
    scheme = scheme_of(recipe)
    for name in shipped_recipes():
        candidate = load_recipe(name)
        if candidate.recommended and scheme_of(candidate) == scheme:
            return candidate
    return None


def recipe_row(recipe: Recipe) -> tuple[str, str, str, str, str]:
    """Name, weight scheme, input scheme (and the KV cache's, with ``[kv_cache]``), algorithm (and the
    ``[fallback]`` floor, with one), description: what a recipe computes, in one row."""
    weight = recipe.weight.describe() if recipe.weight else "-"
    inputs = recipe.input.describe() if recipe.input else "- (weight only)"
    if recipe.kv_cache is not None:
        inputs += f" + kv cache {recipe.kv_cache.format}, {recipe.kv_cache.observer}"  # always per tensor
    algorithm = algorithm_summary(recipe)
    rotation = recipe.rotation
    if rotation is not None and rotation.residual is not None:
        algorithm += f" + {rotation.residual} residual rotation"
    if rotation is not None and rotation.block is not None:
        algorithm += f" + {rotation.type} rotation ({rotation.block})"
    if recipe.fallback is not None:
        algorithm += f"; fallback under {recipe.min_layer_sqnr_db:g} dB"
    return recipe.name, weight, inputs, algorithm, recipe.description


def recipe_rows() -> list[tuple[str, str, str, str, str]]:
    """Per shipped recipe: name, weight scheme, input scheme, algorithm, description (docs/reference/quant-recipes.md's
    table)."""
    return [recipe_row(load_recipe(name)) for name in shipped_recipes()]


#: A layer whose output SQNR (quantizers on vs off) is under this many dB lost much of its signal.
DAMAGED_LAYER_SQNR_DB = 20.0
#: How many such layers make :func:`damage_warning` speak (one can be an outlier layer a fallback handles).
DAMAGED_LAYERS = 2


def damage_warning(report: CalibrationReport, recipe: Recipe) -> str | None:
    """One sentence when a finished calibration's per-layer SQNR says the model was badly damaged (at least
    :data:`DAMAGED_LAYERS` layers under :data:`DAMAGED_LAYER_SQNR_DB`), naming the recommended recipe of its
    scheme (or, for that recipe itself, what else to try); None otherwise or without SQNR figures."""
    low = [layer.name for layer in report.layers if layer.sqnr_db is not None and layer.sqnr_db < DAMAGED_LAYER_SQNR_DB]
    if len(low) < DAMAGED_LAYERS:
        return None
    shown = ", ".join(low[:3]) + (f" and {len(low) - 3} more" if len(low) > 3 else "")
    said = (
        f"{len(low)} of {len(report.layers)} layers calibrated with {recipe.name} have an output SQNR under "
        f"{DAMAGED_LAYER_SQNR_DB:g} dB ({shown}): the model is likely damaged"
    )
    better = recommended_for(recipe)
    if better is not None and better.name != recipe.name:
        return f"{said}; try the recommended {scheme_of(recipe)} recipe {better.name} (see shardcal recipes)"
    return f"{said}; a [fallback] section for those layers, or a wider scheme (shardcal recipes), may help"
