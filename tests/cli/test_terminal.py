"""What a user sees: a 2-rank ``shardcal calibrate`` under a pseudo-terminal, screen read back as a terminal would
show it (carriage returns overwrite the line). One progress bar, the summary on lines of their own, nothing from
the other rank interleaved; an error that happens mid-run starts a line of its own."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from _tiny_models import make_tiny_checkpoint


def _run_in_pty(argv: list[str], timeout: float = 240, extra_env: dict | None = None) -> tuple[int, list[str]]:
    """Run ``argv`` with stdout and stderr on a pty (``extra_env`` added to the environment); the exit status and
    the screen's lines."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="120", TERM="xterm", **(extra_env or {}))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    raw = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other end closed: every process holding the pty has exited
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    status = proc.wait(timeout=30)
    return status, _screen(raw.decode("utf-8", errors="replace"))


def _screen(text: str) -> list[str]:
    """Lines as a terminal leaves them: for each, what the last carriage return left (ANSI codes dropped)."""
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r\n", "\n")
    lines = []
    for line in text.split("\n"):
        pieces = [piece for piece in line.split("\r") if piece.strip()]
        if pieces:
            lines.append(pieces[-1].rstrip())
    return lines


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    model_dir = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    data = tmp_path / "ids.npy"
    np.save(data, np.arange(8 * 16).reshape(8, 16) % 256)
    return model_dir, data


def _calibrate(model_dir: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "shardcal", "calibrate", str(model_dir), "--recipe", "fp8", "--out", str(out),
            "--data", str(data), "--num-samples", "8", "--batch-size", "2", "--nproc-per-node", "2"]  # fmt: skip


def test_a_two_rank_calibration_under_a_terminal(tmp_path):
    model_dir, data = _setup(tmp_path)
    status, lines = _run_in_pty(_calibrate(model_dir, data, tmp_path / "out"))
    assert status == 0, lines
    bars = [line for line in lines if line.startswith("calibrate:")]
    assert len(bars) == 1 and "3/3" in bars[0], lines  # one bar (rank 0's), finished
    summary = [line for line in lines if line.startswith("calibrated 3 layers on 8 x 16 tokens")]
    assert len(summary) == 1 and "over 2 rank(s)" in summary[0], lines
    memory = [line for line in lines if line.startswith("peak memory per rank: growth ")]
    assert len(memory) == 1 and "process peak" in memory[0], lines
    assert lines[-1] == f"exported -> {tmp_path / 'out'} (plot: calibration_sqnr.png)", lines
    warned = [line for line in lines if line.startswith("warning: ")]  # static fp8: vLLM's CPU build fails on it
    assert warned == [f"warning: {tmp_path / 'out'} will not serve everywhere: vLLM CPU fails: it has no static FP8 "
                      "activation kernel (static_scaled_fp8_quant)"], lines  # fmt: skip
    assert len(lines) == 5, lines  # nothing else: no warning from rank 1, no teardown noise


def test_an_error_mid_run_starts_its_own_line(tmp_path):
    model_dir, data = _setup(tmp_path)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(model_dir / "model.safetensors"))
    status, lines = _run_in_pty(_calibrate(model_dir, data, tmp_path / "out"))
    assert status == 2, lines
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("error: model.layers.1: the layer's output holds NaN"), lines
    assert errors[0] == lines[-1] and not (tmp_path / "out").exists()
    assert torch.isnan(weights["model.layers.1.mlp.down_proj.weight"][0, 0])
