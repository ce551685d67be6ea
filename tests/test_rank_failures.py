"""A rank that dies or raises never hangs the others; a real SIGKILL mid-run resumes to the same export.

These tests start real process groups (our launcher, torchrun, the CLI) because the failure modes are about
processes: a killed rank, a rank's exception, the survivors' exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shardcal.errors import DistributedError

from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint, randomize_

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)


def _job(mode: str, layer: int) -> None:
    """Calibrate a sharded tiny model; rank 1 dies (SIGKILL) or raises when it reaches ``layer``."""
    import torch.distributed as dist

    from shardcal import calibrate, fsdp2_wrap
    from shardcal.models import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    fsdp2_wrap(model)

    def fail(*_: object) -> None:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"injected failure on rank {dist.get_rank()}")

    if dist.get_rank() == 1:
        model.model.layers[layer].register_forward_pre_hook(fail)
    calibrate(model, torch.randint(0, 256, (8, 16)), "w8a8-int8", batch_size=2, progress=False)


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_launcher_names_failed_rank_and_layer(mode, capfd):
    from shardcal.launcher import launch

    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        launch(_job, 2, mode, 2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 60, elapsed
    assert "rank 1" in message
    if mode == "kill":
        assert "killed by signal 9" in message and "model.layers.2" in message
    else:
        assert "ValueError: injected failure on rank 1" in message
        assert capfd.readouterr().err.count("Traceback (most recent call last)") == 1  # once, by the failed rank


# torchrun stops the other workers (SIGTERM) as soon as its monitor sees one die, which races with the survivor's own
# report. The survivor ignores SIGTERM here so that what is checked is the survivor's message, not that race; it
# exits by itself once it has reported (torchrun would SIGKILL it 30 s later).
TORCHRUN_SCRIPT = """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.path.insert(0, {tests!r})
from test_rank_failures import _job
from shardcal.distributed import init_distributed
init_distributed()
_job("kill", 2)
"""


def test_torchrun_survivor_exits_with_clear_message(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).parent)))
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 60, (elapsed, proc.stderr[-2000:])
    assert "DistributedError" in proc.stderr, proc.stderr[-2000:]
    assert "rank 1 died or hung during calibrate model.layers.2" in proc.stderr, proc.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- resume after a real SIGKILL
SLOW = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=16)


def _cli(model_dir: Path, out: Path, ckpt: Path | None, data: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "shardcal",
        "calibrate",
        str(model_dir),
        "--recipe",
        "w8a8-int8",
        "--out",
        str(out),
        "--data",
        str(data),
        "--batch-size",
        "2",
        "--nproc-per-node",
        "2",
    ]
    return cmd + (["--checkpoint-dir", str(ckpt)] if ckpt else [])


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_sigkill_mid_calibration_then_resume_equals_uninterrupted(tmp_path):
    import numpy as np

    model_dir = make_tiny_checkpoint(tmp_path, "llama", **SLOW)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, size=(16, 64)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run(
        _cli(model_dir, tmp_path / "ref", None, data), capture_output=True, text=True, env=env, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = subprocess.Popen(
        _cli(model_dir, out, ckpt, data), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    killed_after = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        manifest = ckpt / "manifest.json"
        if manifest.exists():
            done = json.loads(manifest.read_text())["completed_layers"]
            if done >= 3:
                ranks = _children(proc.pid)
                rank_pids = [p for p in ranks if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]
                os.kill(max(rank_pids), signal.SIGKILL)  # a real signal to one rank, mid-run
                killed_after = done
                break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert killed_after is not None and killed_after < SLOW["num_hidden_layers"], (
        "the run ended before it could be killed"
    )
    assert proc.returncode != 0 and "error: rank" in err and "killed by signal 9" in err, err[-2000:]
    assert not out.exists()

    resumed = subprocess.run(_cli(model_dir, out, ckpt, data), capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["resumed_from_layer"] >= killed_after
    want, got = _tensors(tmp_path / "ref"), _tensors(out)
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
