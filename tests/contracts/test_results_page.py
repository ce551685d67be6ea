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
        rows=[["fp8", 18.4401, 12.0], ["w4|a16", None, 3], ["diverged", 1.7e15, 1234567.0]],
        notes=["one note"],
        command="python benchmarks/x.py --flag",
        results_dir=tmp_path,
    )
    table = json.loads(path.read_text())
    assert table["command"] == "python benchmarks/x.py --flag"
    assert table["date"] and "cores" in table["machine"]
    text = page.render_table(table)
    assert "| fp8 | 18.4401 | 12 |" in text and "| diverged | 1.700e+15 | 1.235e+06 |" in text
    assert "| w4\\|a16 | – | 3 |" in text
    assert "python benchmarks/x.py --flag" in text and table["date"] in text and "- one note" in text
    assert [t["name"] for t in page.load_tables(tmp_path)] == ["demo_table"]


def test_rows_must_match_the_columns(tmp_path):
    with pytest.raises(ValueError, match="every row needs 2 values"):
        results.write_table("t", title="t", columns=["a", "b"], rows=[[1]], results_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_tables_are_ordered_by_kind_then_title_and_unordered_ones_last(tmp_path):
    kinds = results.ORDER
    for name, title, order in (
        ("b", "Peers", kinds["peers"]),
        ("c", "No order", None),
        ("d", "B speed", kinds["speed"]),
        ("e", "A speed", kinds["speed"]),
        ("f", "Quality", kinds["quality"]),
        ("g", "Planner", kinds["planner"]),
        ("h", "Memory", kinds["memory"]),
    ):
        results.write_table(name, title=title, columns=["x"], rows=[[1]], order=order, results_dir=tmp_path)
    assert json.loads((tmp_path / "f.json").read_text())["order"] == kinds["quality"]
    assert "order" not in json.loads((tmp_path / "c.json").read_text())
    titles = [t["title"] for t in page.load_tables(tmp_path)]
    assert titles == ["Quality", "A speed", "B speed", "Memory", "Planner", "Peers", "No order"]
    rendered = page.render_page(page.load_tables(tmp_path))
    assert rendered.index("## Quality") < rendered.index("## A speed") < rendered.index("## Peers")


def test_cells_that_are_not_finite_numbers_are_written_as_strict_json(tmp_path):
    path = results.write_table(
        "t", title="t", columns=["a", "b", "c"], rows=[[float("inf"), float("nan"), 1.5]], results_dir=tmp_path
    )
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["rows"] == [["inf", "nan", 1.5]]


def test_ratio_row_rounds_and_divides():
    assert results.ratio_row("calibration", 9.34, "s", "one forward", 9.51, "<= 1.3") == [
        "calibration", 9.3, "one forward", 9.5, "s", 0.98, "<= 1.3"
    ]  # fmt: skip
    assert results.ratio_row("written", 1980.4, "MB", digits=0) == ["written", 1980, None, None, "MB", None, None]
    assert results.ratio_row("peak", None, "MB", "planned", 10.0)[1:6] == [None, "planned", 10.0, "MB", None]


def _save_args(**kwargs):
    import argparse

    parser = argparse.ArgumentParser()
    results.add_save_options(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" if v is not True else f"--{k.replace('_', '-')}"
                              for k, v in kwargs.items()])  # fmt: skip


def test_save_table_writes_the_committed_table_unless_told_otherwise(tmp_path, monkeypatch, capsys):
    committed = tmp_path / "committed"
    monkeypatch.setattr(results, "RESULTS_DIR", committed)
    table = {"title": "t", "columns": ["a"], "rows": [[1]]}
    assert results.save_table(_save_args(no_save=True), "t", **table) is None
    assert results.save_table(_save_args(), "t", off_reference="--recipes leaves out fp8", **table) is None
    assert not committed.exists()
    assert "--recipes leaves out fp8" in capsys.readouterr().out
    trial = tmp_path / "trial"
    path = results.save_table(_save_args(results_dir=trial), "t", off_reference="a subset", order=5, **table)
    assert path == trial / "t.json" and json.loads(path.read_text())["order"] == 5 and not committed.exists()
    assert results.save_table(_save_args(), "t", **table) == committed / "t.json"


# The benchmarks' "rows from measurements" functions, fed synthetic measurements (no model runs): the ratios they
# exist for, against values worked out by hand.
sys.path.append(str(ROOT / "benchmarks"))


def _bench(name: str):
    import importlib

    return importlib.import_module(name)


def _check_writes_and_renders(table: dict, tmp_path: Path) -> dict:
    path = results.write_table("t", results_dir=tmp_path, **table)
    written = json.loads(path.read_text())
    page.render_table(written)
    return {row[0] if not isinstance(row[0], int) else tuple(row[:3]): dict(zip(written["columns"], row))
            for row in written["rows"]}  # fmt: skip


def test_load_memory_table_gives_growth_and_read_against_the_plain_load(tmp_path):
    table = _bench("load_memory").load_table(
        [("from_pretrained, 1 process", [[1000.0, 500.0, 500.0]]),
         ("load_pretrained, 2 ranks", [[550.4, 250.0, 500.0], [560.0, 251.0, 500.0]])]
    )  # fmt: skip
    path = results.write_table("t", results_dir=tmp_path, **table)
    rows = json.loads(path.read_text())["rows"]
    assert rows == [
        ["from_pretrained, 1 process", 1, 0, 1000, 500, 500, 1.0, 1.0],
        ["load_pretrained, 2 ranks", 2, 0, 550, 250, 500, 0.55, 0.5],
        ["load_pretrained, 2 ranks", 2, 1, 560, 251, 500, 0.56, 0.5],
    ]


def test_calibration_speed_tables_give_the_ratios_and_targets(tmp_path):
    bench = _bench("calibration_speed")
    measured = {
        "plain": (9.3, 9.5), "one_rank": (14.5, 14.3), "two_ranks": (15.8, 14.2), "scaling": (1.2, 0.6),
        "rss": (216.0, 120.0), "rss_embedding": (200.0, 110.0), "rss_layers": (80.0, 98.0),
        "rss_after_load": (700.0, 1200.0),
    }  # fmt: skip
    rows = _check_writes_and_renders(bench.ratios_table(measured, samples=32, seq_len=256, batch_size=8, layers=6),
                                     tmp_path)  # fmt: skip
    assert rows["calibration, 1 process, plain model"]["ratio"] == 0.98
    assert rows["calibration, 2 ranks, FSDP2 (slowest rank)"]["ratio"] == 1.11
    scaling = rows["calibration, random model of 2L = 12 layers"]
    assert scaling["ratio"] == 2.0 and scaling["compared with"] == "the same with L = 6"
    assert rows["peak RSS growth per rank during calibrate, 2 ranks"]["ratio"] == 1.8
    assert rows["peak RSS growth per rank, the layer steps, 2 ranks"]["ratio"] == 0.82
    per_recipe = _check_writes_and_renders(
        bench.recipes_table([("fp8", "rtn", 10.0, 10.1, "0.99"), ("w4a16-gptq", "gptq", 40.0, 10.0, "4.00")],
                            samples=32, seq_len=256, batch_size=8, repeat=1), tmp_path)  # fmt: skip
    assert per_recipe["fp8"]["calibration / forward"] == 0.99 and per_recipe["fp8"]["target"] == "<= 1.2"
    assert per_recipe["w4a16-gptq"]["calibration / forward"] == 4.0 and per_recipe["w4a16-gptq"]["target"] is None


def test_collect_speed_table_gives_the_collection_and_writer_ratios(tmp_path):
    measured = {"forward": 10.0, "collect": 9.5, "save": 24.0, "written": 1450.0, "writer": 1300.0, "plain": 3250.0,
                "plain+fsync": 1250.0}  # fmt: skip
    table = _bench("collect_speed").collect_table(measured, samples=32, seq_len=256, batch_size=8, repeats=2)
    path = results.write_table("t", results_dir=tmp_path, **table)
    rows = {(r[0], r[2]): r for r in json.loads(path.read_text())["rows"]}
    assert rows[("collect_activations, statistics only", "one plain forward")][5] == 0.95
    assert rows[("save_dir end to end: written / extra time over statistics only", None)][1] == 100.0
    writer = "the collection's writer (temp file, fsync, rename)"
    assert rows[(writer, "save_file + fsync of each file")][5] == 1.04
    assert rows[(writer, "save_file without fsync")][5] == 0.4


def test_scaling_table_compares_each_n_with_the_fewest_ranks(tmp_path):
    MiB = 2**20

    def row(model, n, peak, read):
        return {"model": model, "ranks": n, "peak_measured": peak * MiB, "peak_predicted": 500 * MiB,
                "bytes_read_per_rank": read * MiB, "allgather_bytes_per_layer": 13.5 * MiB,
                "allgather_sent_per_layer_per_rank": 13.5 * MiB * (n - 1) / n, "calibrate_seconds": 10.0,
                "wall_seconds": 20.0}  # fmt: skip

    table = _bench("scaling").scaling_table([row("a", 1, 1000, 512), row("a", 2, 550, 256), row("b", 2, 400, 100)])
    path = results.write_table("t", results_dir=tmp_path, **table)
    columns = json.loads(path.read_text())["columns"]
    got = [dict(zip(columns, r)) for r in json.loads(path.read_text())["rows"]]
    assert [r["peak vs fewest ranks"] for r in got] == [1.0, 0.55, 1.0]
    assert [r["read vs fewest ranks"] for r in got] == [1.0, 0.5, 1.0]
    assert [r["measured / predicted"] for r in got] == [2.0, 1.1, 0.8]
    assert got[1]["sent / rank / layer MB"] == 6.8  # 13.5 * 1/2, rounded


def test_vs_peers_table_holds_every_run_and_its_error(tmp_path):
    bench = _bench("vs_peers")
    cells = [
        bench.row_cells("fp8", "shardcal `fp8`", {"ppl": 19.0, "calib_seconds": 10.04, "fallback": ""}, 18.0),
        bench.row_cells("fp8", "modelopt 0.47", {"ppl": 18.9, "calib_seconds": 11.0, "patched": True}, 18.0),
        bench.row_cells("nvfp4", "modelopt 0.47", {"error": "refused on a CPU"}, 18.0),
    ]
    rows = json.loads(results.write_table("t", results_dir=tmp_path, **bench.peers_table(
        cells, model="SmolLM2-135M", fp32=18.0, calib=(32, 256), held_out=(8, 256), eval_seed=0)).read_text())["rows"]  # fmt: skip
    assert rows[0] == ["FP32", "", 18.0, None, None, ""]
    assert rows[1] == ["fp8", "shardcal `fp8`", 19.0, "+5.6%", 10.0, ""]
    assert rows[2] == ["fp8", "modelopt 0.47", 18.9, "+5.0%", 11.0, "patched: CPU pinning"]
    assert rows[3] == ["nvfp4", "modelopt 0.47", None, None, None, "refused on a CPU"]
    assert bench._row(cells[2]) == "| nvfp4 | modelopt 0.47 | — | — | — | refused on a CPU |"


def test_plan_accuracy_tables_judge_the_bounds(tmp_path):
    bench = _bench("plan_accuracy")
    MiB = 2**20

    def row(case, predicted, measured, bound):
        phases = {"load": 100 * MiB, "calibrate": measured * MiB, "export": 50 * MiB}
        return {"case": case, "ranks": 2, "rank": 0, "predicted": predicted * MiB, "measured": measured * MiB,
                "error": measured / predicted - 1, "bound": bound, "predicted_phases": phases,
                "measured_phases": phases, "bytes_read": [257 * MiB, 257 * MiB],
                "export_bytes": [140 * MiB, 141 * MiB]}  # fmt: skip

    table = bench.memory_table(
        [row("in", 1000, 1240, True), row("out", 1000, 1260, True), row("info", 100, 300, False)]
    )
    rows = json.loads(results.write_table("t", results_dir=tmp_path, **table).read_text())["rows"]
    assert [(r[6], r[-1]) for r in rows] == [("+24.0%", "ok"), ("+26.0%", "MISSED"), ("+200.0%", "(informative)")]
    assert rows[0][3] == "calibrate" and rows[0][8] == "257 / 257" and rows[0][9] == "140 / 141"
    timing = {"ranks": 1, "predicted_cpu": 40.0, "measured_cpu": 53.0, "error": 53.0 / 40.0 - 1,
              "predicted_wall": 20.0, "measured_wall": 21.0, "estimates": [{"probe_seconds": 2.0},
              {"probe_seconds": 3.0}], "runs": []}  # fmt: skip
    rows = json.loads(results.write_table("t", results_dir=tmp_path, **bench.time_table([timing])).read_text())["rows"]
    assert rows == [[1, 2.5, 40.0, 53.0, "+32.5%", 20.0, 21.0, "MISSED"]]


def test_ptq_quality_table_is_what_the_recipe_chooser_reads(tmp_path):
    import argparse

    from shardcal.pipeline import chooser

    args = argparse.Namespace(samples=32, seq_len=256, batch_size=8, eval_samples=8, eval_seed=0)
    table = _bench("ptq_quality").quality_table(
        [("FP32", "", 20.0, None, ""), ("fp8", "rtn", 20.5, 12.34, "fp")], model="SmolLM2-135M", args=args
    )
    results.write_table("ptq_quality_smollm2", results_dir=tmp_path, **table)
    row = chooser._rows_by_recipe(chooser.read_table("ptq_quality_smollm2", tmp_path))["fp8"]
    assert row["vs FP32"] == "+2.5%" and row["calibration s"] == 12.3 and row["perplexity"] == 20.5


@pytest.mark.parametrize("name", _bench("run_all").BENCHMARKS)
def test_every_benchmark_writes_its_tables(name):
    """Each benchmark that make bench runs takes --no-save / --results-dir and writes through save_table."""
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert "add_save_options(parser)" in source and "save_table(" in source and "order=ORDER[" in source


def test_the_other_benchmarks_tables_give_their_ratios(tmp_path):
    foreign = _check_writes_and_renders(_bench("foreign_speed").foreign_table(
        [("shardcal CausalLM", 10.0, 9.8), ("transformers LlamaForCausalLM", 9.3, 11.2)], worst_amax=0.0,
        same_quantizers=True, recipe="w8a8-int8", samples=32, seq_len=256, batch_size=8, repeats=2), tmp_path)  # fmt: skip
    assert foreign["shardcal CausalLM"]["that ratio / shardcal CausalLM's"] == 1.0
    assert foreign["transformers LlamaForCausalLM"]["calibration / forward"] == 1.2
    assert foreign["transformers LlamaForCausalLM"]["that ratio / shardcal CausalLM's"] == 1.23  # 1.2043 / 0.98
    autoround = _check_writes_and_renders(_bench("autoround_speed").autoround_table(
        [("GPTQ", 21.2, 30.0), ("AutoRound 14 steps", 20.6, 113.0), ("GPTQ again", 21.2, 36.0)], target="fp",
        calib=(32, 256), held_out=(8, 256), batch_size=8), tmp_path)  # fmt: skip
    assert [r["time / GPTQ's mean"] for r in autoround.values()] == [0.91, 3.42, 1.09]
    sample = _bench("sqnr_sample").sample_table([("w4a16", 4, [0.1, 0.3, 0.2])], samples=32, seq_len=256, batch_size=8)
    got = _check_writes_and_renders(sample, tmp_path)["w4a16"]
    assert (got["tokens"], got["sample / all tokens"], got["max difference dB"], got["mean difference dB"]) == (
        1024,
        0.125,
        0.3,
        0.2,
    )
    measured = {"modules": 210, "skipped": 0, "sqnr": 36.123, "mean": float("inf"), "min": 30.0}
    sqnr = _bench("weight_sqnr").sqnr_table([("fp8", "fp8_e4m3 tensor max", measured, 1.04)], model="m", linears=211)
    assert _check_writes_and_renders(sqnr, tmp_path)["fp8"]["mean dB per Linear"] == "inf"
    devices = {"quantizers": 28, "max_rel_amax_diff": 2.5e-7, "ok": True}
    wide = {"layers": 2, "forward_s": 2.0, "calibrate_s": 2.5, "peak_device_mb": None, "predicted_peak_mb": 900.0,
            "export_s": 3.0, "export_mb": 800.0, "source_mb": 1600.0, "mean_sqnr_db": 40.0,
            "reload_max_abs_diff": 0.0}  # fmt: skip
    gpu = _check_writes_and_renders(
        _bench("gpu_check").gpu_table(devices, wide, device="cpu", samples=4, seq_len=32, batch_size=8), tmp_path
    )
    assert gpu["fp8 calibration, activations offloaded"]["ratio"] == 1.25
    assert gpu["export size"]["ratio"] == 0.5 and gpu["peak device memory during calibration"]["ratio"] is None
