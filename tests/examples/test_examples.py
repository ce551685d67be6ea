"""Every script in examples/ runs as its docstring shows, on a tiny model (smoke tests: the numbers they print
are checked for shape, the exports for the files vLLM reads)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _tiny_models import make_tiny_text_model, write_chat_data, write_parquet_text, write_text_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # shardcal, torchrun
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(*argv: object, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env or _env(), cwd=ROOT,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("examples")
    return make_tiny_text_model(root), write_text_data(root / "calib.jsonl")


def _quantized_config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_every_example_is_tested():
    tested = {"fp8_for_vllm.py", "int4_weights.py", "moe.py", "collect_activations.py", "multinode.sh", "chat_data.py"}
    assert {p.name for p in EXAMPLES.iterdir()} == tested


def test_fp8_for_vllm(tiny, tmp_path):
    model_dir, data = tiny
    out = _run(sys.executable, EXAMPLES / "fp8_for_vllm.py", model_dir, tmp_path / "out", "--data", data,
               "--num-samples", 8, "--seq-len", 64)  # fmt: skip
    assert f"serve it with: vllm serve {tmp_path / 'out'}" in out and "mean output SQNR" in out
    assert _quantized_config(tmp_path / "out")["format"] == "float-quantized"


def test_int4_weights(tiny, tmp_path):
    model_dir, data = tiny
    out = _run(sys.executable, EXAMPLES / "int4_weights.py", model_dir, tmp_path / "out", "--data", data,
               "--eval-data", data, "--num-samples", 8, "--seq-len", 64)  # fmt: skip
    assert out.startswith("perplexity: original ") and "INT4 export" in out
    assert _quantized_config(tmp_path / "out")["format"] == "pack-quantized"


def test_moe(tmp_path):
    model_dir = make_tiny_text_model(tmp_path, "qwen2_moe")
    data = write_text_data(tmp_path / "calib.jsonl")
    out = _run(sys.executable, EXAMPLES / "moe.py", model_dir, tmp_path / "out", "--data", data,
               "--num-samples", 8, "--seq-len", 64)  # fmt: skip
    assert "expert" in out.splitlines()[0] and f"exported -> {tmp_path / 'out'}" in out
    weights = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.3." in key and key.endswith("weight_scale") for key in weights)


def test_collect_activations(tiny, tmp_path):
    model_dir, data = tiny
    out = _run(sys.executable, EXAMPLES / "collect_activations.py", model_dir, "--data", data, "--num-samples", 4,
               "--seq-len", 32, "--save-dir", tmp_path / "acts")  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("model.layers.0.mlp.down_proj:input: largest input channel ")
    assert lines[-1] == f"raw activations of 4 samples in {tmp_path / 'acts'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multinode_script_on_one_node_of_two_ranks(tiny, tmp_path):
    """The multi-node script as a single node of 2 ranks would run it (the same torchrun rendezvous)."""
    model_dir, data = tiny
    env = {**_env(), "HOST": "127.0.0.1", "PORT": str(_free_port()), "NNODES": "1", "NPROC": "2"}
    out = _run("bash", EXAMPLES / "multinode.sh", model_dir, tmp_path / "out", tmp_path / "ckpt", data, env=env)
    assert "serve it with: vllm serve" in out and (tmp_path / "out" / "shardcal_export.json").is_file()
    assert not (tmp_path / "ckpt").exists()  # removed after the successful export


def test_chat_data(tiny, tmp_path):
    """Conversations (one masked sample each) mixed with a parquet text dataset, on 2 ranks under torchrun."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("jinja2")
    model_dir, _ = tiny
    chat, text = write_chat_data(tmp_path / "chat.jsonl"), write_parquet_text(tmp_path / "wiki")
    out = _run("torchrun", "--standalone", "--nproc-per-node", 2, EXAMPLES / "chat_data.py", model_dir,
               tmp_path / "out", "--chat", chat, "--text", text, "--samples", 6, "--seq-len", 32)  # fmt: skip
    assert f"calibrated on 12 samples of up to 32 tokens: {chat} (6 x messages 'messages') + {text}" in out, out
    assert "serve it with: vllm serve" in out
    assert _quantized_config(tmp_path / "out")["config_groups"]
