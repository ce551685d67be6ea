"""The wheel ships every package: each src/shardcal subpackage is listed in pyproject.toml (recipes as data)."""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        "shardcal." + ".".join(p.parent.relative_to(ROOT / "src" / "shardcal").parts)
        for p in (ROOT / "src" / "shardcal").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found}
    assert found | {"shardcal.recipes", "shardcal.results"} == listed
    assert config["package-data"]["shardcal.recipes"] == ["*.toml"]
    assert config["package-data"]["shardcal.results"] == ["*.json"]  # the tables `shardcal recipes` shows
    assert config["package-dir"]["shardcal.results"] == "docs/results"


def test_recipes_folder_holds_recipes_only():
    """What users read, copy and edit: TOML recipes, no Python."""
    files = [p for p in (ROOT / "recipes").rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".toml" and p.parent.name == "recipes" for p in files), files


def test_make_bench_runs_every_benchmark():
    """``make bench`` runs benchmarks/run_all.py, which lists every benchmark script (gpu_check runs alone;
    peer_run is no benchmark but the script vs_peers runs inside the peers' venv; _-prefixed modules are shared
    helpers)."""
    import importlib.util

    makefile = (ROOT / "Makefile").read_text()
    assert "benchmarks/run_all.py" in makefile
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    scripts -= {"run_all", "gpu_check", "peer_run"}
    assert set(run_all.BENCHMARKS) == scripts
    assert "bench-peers:" in makefile and "benchmarks/vs_peers.py" in makefile
