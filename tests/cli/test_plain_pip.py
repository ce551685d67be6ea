"""A new user's path: ``pip install .`` (the wheel, no extras: no transformers, no compressed-tensors, no gguf),
then ``calibrate``, ``eval`` and ``plan`` of a model shardcal has a class for, on a terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_terminal import _run_in_pty

from _tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
#: Put first on sys.path by the test's PYTHONPATH: the extras a plain install lacks cannot be imported.
BLOCK_EXTRAS = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "compressed_tensors", "huggingface_hub", "gguf", "accelerate"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """shardcal's wheel, built from this checkout and installed into a folder of its own (torch and the other run
    time dependencies come from this environment)."""
    work = tmp_path_factory.mktemp("plain-pip")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", work / "wheel", ROOT], check=True)
    (wheel,) = (work / "wheel").glob("shardcal-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", work / "site", wheel], check=True)
    (work / "site" / "sitecustomize.py").write_text(BLOCK_EXTRAS)
    return work / "site"


def test_calibrate_eval_plan_from_a_plain_install(installed, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    np.save(tmp_path / "ids.npy", np.arange(8 * 16).reshape(8, 16) % 256)
    env = {"PYTHONPATH": str(installed)}
    shardcal = [sys.executable, "-m", "shardcal"]
    where = [sys.executable, "-c", "import shardcal, sys; print(shardcal.__file__); import transformers"]
    located = subprocess.run(where, capture_output=True, text=True, env={**env, "PATH": ""}, timeout=120)
    assert located.stdout.startswith(str(installed)) and "No module named 'transformers'" in located.stderr

    args = ["--recipe", "w8a8-int8", "--data", str(tmp_path / "ids.npy"), "--batch-size", "4"]
    status, lines = _run_in_pty([*shardcal, "plan", str(model_dir), "--recipe", "w8a8-int8"], extra_env=env)
    assert status == 0 and any("PEAK" in line or "peak" in line for line in lines), lines
    status, lines = _run_in_pty([*shardcal, "calibrate", str(model_dir), *args, "--out", str(tmp_path / "out")],
                                extra_env=env)  # fmt: skip
    assert status == 0 and lines[-1].startswith(f"exported -> {tmp_path / 'out'}"), lines
    status, lines = _run_in_pty([*shardcal, "eval", str(tmp_path / "out"), "--data", str(tmp_path / "ids.npy")],
                                extra_env=env)  # fmt: skip
    assert status == 0 and any("perplexity" in line for line in lines), lines
