"""The recipe chooser (shardcal.pipeline.chooser): measured cells come from the result tables, not from code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from shardcal.calib.recipes import load_recipe, shipped_recipes
from shardcal.export.consumers import deployment
from shardcal.pipeline.chooser import (
    SCHEMES,
    entries,
    recipe_notes,
    recipe_table,
    recommended_for,
    results_dir,
    scheme_of,
)

ROOT = Path(__file__).resolve().parents[2]


def _write_table():
    spec = importlib.util.spec_from_file_location("_results_for_chooser", ROOT / "benchmarks" / "_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.write_table


def test_cells_come_from_the_result_tables(tmp_path):
    write_table = _write_table()
    columns = ["recipe", "algorithm", "mean KL", "KL se", "p99 KL", "top-1 %", "perplexity", "vs source",
               "process s", "wall s", "calibration s", "evaluated by", "notes"]  # fmt: skip
    write_table("user_path_smollm2", title="The numbers a user gets, SmolLM2-135M", results_dir=tmp_path,
                columns=columns, rows=[["fp8-dynamic", "rtn", 0.02142, 0.00031, 0.21, 93.4, 18.4, "+2.6%", 24.4, 9.0,
                                        3.1, "transformers", "±0.9% ppl"]],
                command="python benchmarks/user_path.py")  # fmt: skip
    write_table("vllm_status", title="vLLM", results_dir=tmp_path, columns=["recipe", "vllm_cpu", "note"],
                rows=[["fp8-dynamic", "checked", "logprobs within 1 %"]])  # fmt: skip
    by_name = {e.recipe.name: e for e in entries(tmp_path)}
    assert by_name["fp8-dynamic"].quality == ("0.021", "-") and by_name["fp8-dynamic"].seconds == "24 s"
    assert by_name["fp8"].quality == ("-", "-") and by_name["fp8"].seconds == "-"
    assert by_name["fp8-dynamic"].vllm_check == "checked" and by_name["fp8"].vllm_check == "-"
    line = next(row for row in recipe_table(tmp_path).splitlines() if row.startswith("* fp8-dynamic "))
    assert "0.021" in line and "24 s" in line
    notes = recipe_notes("fp8-dynamic", tmp_path)
    assert all(note.startswith("#") for note in notes)
    date = __import__("json").loads((tmp_path / "user_path_smollm2.json").read_text())["date"]
    assert (
        "# SmolLM2-135M: KL 0.02142 +- 0.00031 from the bf16 source, top-1 agreement 93.4 %, perplexity 18.4 (+2.6% "
        f"vs the source), 24 s for the command ({date}, docs/results.md; `shardcal eval OUT --kl --num-samples 64` "
        "measures the same way)"
    ) in notes
    assert notes[0] == "# runs in: vLLM GPU yes, vLLM CPU yes, transformers yes"
    assert "# vLLM CPU check: checked; logprobs within 1 %" in notes and "# recommended for FP8" in notes
    assert all("-" in e.quality for e in entries(tmp_path / "nothing"))  # no tables: every cell says so


def test_one_recommendation_per_scheme_that_deploys_as_widely_as_any():
    """Each scheme has exactly one recommended recipe; where some recipe of the scheme runs everywhere (vLLM at any
    tensor-parallel size on the usual GPUs, and transformers), the recommended one does too."""
    by_scheme: dict[str, list[str]] = {}
    for name in shipped_recipes():
        by_scheme.setdefault(scheme_of(load_recipe(name)), []).append(name)
    assert set(by_scheme) == set(SCHEMES)
    for scheme, names in by_scheme.items():
        recommended = [n for n in names if load_recipe(n).recommended]
        assert len(recommended) == 1, (scheme, recommended)
        if any(deployment(load_recipe(n)).everywhere for n in names):
            assert deployment(load_recipe(recommended[0])).everywhere, scheme
        for name in names:
            assert recommended_for(load_recipe(name)).name == recommended[0]


def test_the_results_folder_is_the_checkouts():
    assert results_dir() == ROOT / "docs" / "results"


def _report(sqnrs: list[float | None]):
    from shardcal.calib.report import CalibrationReport, LayerReport

    layers = [LayerReport(index=i, name=f"model.layers.{i}", seconds=0.1, sqnr_db=s) for i, s in enumerate(sqnrs)]
    return CalibrationReport(recipe="x", propagate="fp", world_size=1, num_batches=1, num_tokens=16, layers=layers)


def test_the_damage_warning_names_a_recommended_recipe():
    from shardcal.pipeline.chooser import damage_warning

    assert damage_warning(_report([40.0, 19.0, 35.0]), load_recipe("w8a8-int8")) is None  # one low layer: quiet
    assert damage_warning(_report([None, None]), load_recipe("w8a8-int8")) is None  # no SQNR measured
    said = damage_warning(_report([19.9, 35.0, 12.0, 18.0, 5.0, 41.0]), load_recipe("w8a8-int8"))
    assert said == (
        "4 of 6 layers calibrated with w8a8-int8 have an output SQNR under 20 dB (model.layers.0, model.layers.2, "
        "model.layers.3 and 1 more): the model is likely damaged; try the recommended INT8 recipe "
        "w8a8-int8-dynamic-sq (see shardcal recipes)"
    )
    own = damage_warning(_report([10.0, 10.0]), load_recipe("w8a8-int8-dynamic-sq"))
    assert own.endswith("a [fallback] section for those layers, or a wider scheme (shardcal recipes), may help")
    assert damage_warning(_report([20.0, 20.0]), load_recipe("w8a8-int8")) is None  # the floor itself is fine


def test_a_damaged_calibration_ends_with_one_warning_line(tmp_path, capsys, monkeypatch):
    """The command's last stderr line says the model was damaged and names the recommended recipe (every layer
    counts as damaged here: the floor is raised above any SQNR)."""
    import numpy as np

    from shardcal.cli import main as cli
    from shardcal.pipeline import chooser

    from _tiny_models import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, "llama")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, size=(4, 16)))
    argv = ["calibrate", model_dir, "--recipe", "w8a8-int8", "--data", tmp_path / "ids.npy", "--out", tmp_path / "o"]
    monkeypatch.setattr(chooser, "DAMAGED_LAYER_SQNR_DB", 1000.0)
    assert cli.main([str(a) for a in argv]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "likely damaged" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: 2 of 2 layers calibrated with w8a8-int8")
    assert warned[0].endswith("try the recommended INT8 recipe w8a8-int8-dynamic-sq (see shardcal recipes)")
    monkeypatch.setattr(chooser, "DAMAGED_LAYER_SQNR_DB", 0.0)
    assert cli.main([str(a) for a in [*argv[:-1], tmp_path / "p"]]) == 0
    assert "likely damaged" not in capsys.readouterr().err
