"""The README is a user's guide that works: at most 12 KB, and every command and snippet in it runs, on a tiny model.

The README's placeholders are filled in (``MODEL_DIR``: a tiny Llama with a byte-level tokenizer and a ChatML chat
template; ``calib.jsonl``, ``eval.jsonl``: text; ``chat.jsonl``: conversations; ``wiki``: a parquet dataset; ``OUT_DIR``, ``CKPT_DIR``: fresh directories) and each shell block runs line by line as a user
would type it, each Python block in a fresh interpreter. What cannot run here is named and checked for form: ``git
clone`` and ``pip install`` (the environment is already installed), ``vllm serve`` (vLLM is not installed: its
check is ``make test-vllm``). The README's sizes are for a real model: ``num_samples=512, seq_len=2048`` become
``8, 64`` here, and torchrun's two nodes of 8 GPUs one node of 2 ranks.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _tiny_models import make_tiny_text_model, write_chat_data, write_parquet_text, write_text_data

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
SIZES = {"num_samples=512": "num_samples=8", "seq_len=2048": "seq_len=64"}


def _blocks(language: str) -> list[str]:
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", TEXT, flags=re.S) if lang == language]


def _commands(block: str) -> list[str]:
    """The block's command lines, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def workspace(tmp_path) -> dict[str, str]:
    model_dir = make_tiny_text_model(tmp_path)
    write_text_data(tmp_path / "calib.jsonl")
    write_text_data(tmp_path / "eval.jsonl", documents=10)
    write_chat_data(tmp_path / "chat.jsonl")
    write_parquet_text(tmp_path / "wiki")
    return {"MODEL_DIR": str(model_dir), "OUT_DIR": str(tmp_path / "out"), "CKPT_DIR": str(tmp_path / "ckpt"),
            "HOST": "127.0.0.1", "29500": str(_free_port()), "cwd": str(tmp_path)}  # fmt: skip


def _fill(text: str, places: dict[str, str]) -> str:
    for key, value in places.items():
        if key != "cwd":
            text = re.sub(rf"\b{re.escape(key)}\b", value, text)
    for key, value in SIZES.items():
        text = text.replace(key, value)
    return text


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # shardcal, torchrun, python
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(command: str, cwd: str) -> subprocess.CompletedProcess:
    result = subprocess.run(shlex.split(command), capture_output=True, text=True, cwd=cwd, env=_env(), timeout=600)
    assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
    return result


def test_the_readme_is_a_guide_not_a_notebook():
    assert len(TEXT.encode("utf-8")) <= 12 * 1024
    assert max(len(line) for line in TEXT.splitlines() if not line.startswith("|")) <= 120
    assert max(len(line) for line in TEXT.splitlines()) <= 180  # a table row is one line
    headings = re.findall(r"^## (.+)$", TEXT, flags=re.M)
    assert headings == ["Install", "Quick start", "Choosing a recipe", "Calibration data", "Models",
                        "Scaling to a cluster", "Documentation"]  # fmt: skip
    assert not re.search(r"[‖¶§‡◇▲◆△◊★]", TEXT)  # no footnote marks for rows measured later


def test_install_block_installs_torch_first_from_an_index():
    (install,) = [b for b in _blocks("bash") if "pip install" in b]
    lines = _commands(install)
    assert lines[0].startswith("git clone ")
    torch_line = next(i for i, line in enumerate(lines) if line.startswith("pip install torch"))
    first_shardcal = min(i for i, line in enumerate(lines) if "pip install ." in line)
    assert "--index-url" in lines[torch_line] and torch_line < first_shardcal
    extras = [line for line in lines if line.startswith("pip install ") and "torch" not in line]
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line in extras:  # every extra named exists
        for extra in re.findall(r"\.\[(\w+)\]", line):
            assert extra in declared, line


def test_every_shell_command_runs(workspace):
    """Each README shell block (but the install one), command by command, as a user types it."""
    ran = []
    for n, block in enumerate(b for b in _blocks("bash") if "pip install" not in b):
        places = {**workspace, "OUT_DIR": f"{workspace['OUT_DIR']}{n}", "CKPT_DIR": f"{workspace['CKPT_DIR']}{n}"}
        for line in _commands(block):
            if line.startswith("vllm serve"):
                assert line == "vllm serve OUT_DIR", line  # served by vLLM: checked by make test-vllm
                continue
            command = _fill(line, places)
            command = command.replace("--nnodes 2 --nproc-per-node 8", "--nnodes 1 --nproc-per-node 2")
            result = _run(command, workspace["cwd"])
            ran.append(line.split()[:2])
            if line.startswith("shardcal eval"):
                assert "source model " in result.stdout  # the export's baseline, as the README says
            if line.startswith("shardcal calibrate"):  # the files the README says the export holds
                for name in re.findall(r"`OUT_DIR/([\w.]+)`", TEXT):
                    assert (Path(places["OUT_DIR"]) / name).is_file(), name
    assert ["shardcal", "calibrate"] in ran and ["shardcal", "recipes"] in ran and ["torchrun", "--nnodes"] in ran


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_every_python_snippet_runs(workspace, index):
    code = _fill(_blocks("python")[index], workspace)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workspace["cwd"],
                            env=_env(), timeout=600)  # fmt: skip
    assert result.returncode == 0, (code, result.stderr[-3000:])
    assert (Path(workspace["OUT_DIR"]) / "shardcal_export.json").is_file()


def test_the_recommended_table_is_the_recipes():
    """The README's table of recommended recipes is what the recipes and `shardcal recipes` say."""
    from shardcal.calib.recipes import load_recipe, shipped_recipes
    from shardcal.pipeline.chooser import scheme_of

    table = TEXT.split("## Choosing a recipe", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| [^|]+ \| `([\w-]+)` \|", table, flags=re.M)
    recommended = [n for n in shipped_recipes() if load_recipe(n).recommended]
    assert sorted(named) == sorted(recommended)
    assert [scheme_of(load_recipe(n)) for n in named] == [
        "FP8",
        "INT8",
        "INT4",
        "NVFP4",
        "FP8 block",
        "W8A16",
        "W4AFP8",
        "NVFP4A16",
        "MXFP4",
        "MXFP4A16",
        "MXFP8",
    ]
    from shardcal.export.consumers import deployment

    for row in re.findall(r"^\| [^|]+ \| `[\w-]+` \|.*$", table, flags=re.M):  # where it runs: the chooser's cells
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert tuple(cells[2:5]) == deployment(load_recipe(cells[1].strip("`"))).cells(), row
    from shardcal.cli.main import build_parser

    help_text = " ".join(build_parser().format_help().split())
    calibrate_help = next(a for a in build_parser()._actions if getattr(a, "choices", None))
    recipe_help = next(a.help for a in calibrate_help.choices["calibrate"]._actions if a.dest == "recipe")
    assert all(name in recipe_help for name in recommended) and help_text
