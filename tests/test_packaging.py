"""The wheel ships every package: each src/shardcal subpackage is listed in pyproject.toml (recipes as data)."""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {"shardcal." + ".".join(p.parent.relative_to(ROOT / "src" / "shardcal").parts) for p in (ROOT / "src" / "shardcal").rglob("__init__.py")}
    found = {name.rstrip(".") for name in found}
    assert found | {"shardcal.calibration"} == listed
    assert config["package-data"]["shardcal.calibration"] == ["recipes/*.toml"]
