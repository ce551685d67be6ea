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

from _paths import test_dirs
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
    from shardcal.runtime.launcher import launch

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


def _refuse(ranks: list[int]) -> None:
    import torch.distributed as dist

    from shardcal.errors import DataError

    if dist.get_rank() in ranks:
        raise DataError("data.txt: no text in it")
    dist.barrier()


def test_a_user_error_every_rank_raises_is_itself_one_rank_is_named():
    from shardcal.errors import DataError
    from shardcal.runtime.launcher import launch

    with pytest.raises(DataError) as info:
        launch(_refuse, 2, [0, 1])
    assert str(info.value) == "data.txt: no text in it"  # the same refusal on every rank: no rank to name
    with pytest.raises(DistributedError, match=r"^rank 1 failed: data.txt: no text in it$"):
        launch(_refuse, 2, [1])


def _ctrl_c(kind: str) -> None:
    """Every rank interrupted as Ctrl-C to the process group would: with rank 0's account (``RunInterrupted``), or a
    plain ``KeyboardInterrupt`` after rank 0 recorded where it was."""
    import torch.distributed as dist

    from shardcal.errors import RunInterrupted
    from shardcal.runtime.health import report_phase

    dist.barrier()
    if kind == "account":
        raise RunInterrupted(f"interrupted during the export: out was not written (rank {dist.get_rank()})")
    report_phase("export model.layers.1")
    raise KeyboardInterrupt


def test_the_launcher_relays_rank_0s_account_of_an_interruption():
    """Ctrl-C outside the layer loop on 2 ranks: the launcher raises rank 0's ``RunInterrupted`` as it was (the line the
    command prints); without one, where rank 0 was."""
    from shardcal.errors import RunInterrupted
    from shardcal.runtime.launcher import launch

    with pytest.raises(RunInterrupted) as info:
        launch(_ctrl_c, 2, "account")
    assert str(info.value) == "interrupted during the export: out was not written (rank 0)"
    with pytest.raises(RunInterrupted) as info:
        launch(_ctrl_c, 2, "plain")
    assert str(info.value) == "interrupted (rank 0 was at: export model.layers.1)"


# torchrun stops the other workers (SIGTERM) as soon as its monitor sees one die, which races with the survivor's own
# report. The survivor ignores SIGTERM here so that what is checked is the survivor's message, not that race; it
# exits by itself once it has reported (torchrun would SIGKILL it 30 s later).
TORCHRUN_SCRIPT = """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.path[:0] = {tests!r}
from test_rank_failures import _job
from shardcal.runtime.distributed import init_distributed
init_distributed()
_job("kill", 2)
"""


def test_torchrun_survivor_exits_with_clear_message(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=test_dirs()))
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


def _cli(model_dir: Path, out: Path, ckpt: Path | None, data: Path, *extra: str) -> list[str]:
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
    return cmd + (["--checkpoint-dir", str(ckpt)] if ckpt else []) + list(extra)


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


#: ``make soak`` (SHARDCAL_SOAK=1) runs the long forms of the repeated-fault tests.
SOAK = os.environ.get("SHARDCAL_SOAK") == "1"


def _clean_env() -> dict[str, str]:
    """The environment of a fresh shell: no torchrun variables a test process may carry."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _completed(ckpt: Path) -> int:
    try:
        return json.loads((ckpt / "manifest.json").read_text())["completed_layers"]
    except (OSError, ValueError, KeyError):
        return 0


def _run_until(
    cmd: list[str], ckpt: Path, layers: int, act, env: dict[str, str], **popen
) -> tuple[subprocess.Popen, str, int | None]:
    """Start ``cmd``; once the checkpoint holds at least ``layers`` layers, ``act(proc)``; return (proc, stderr, the
    layer count when it acted, or None if the run ended first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
    acted = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        done = _completed(ckpt)
        if done >= layers:
            act(proc)
            acted = done
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc, err, acted


def _kill_a_rank(proc: subprocess.Popen) -> None:
    ranks = [p for p in _children(proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]
    os.kill(max(ranks), signal.SIGKILL)  # a real signal to one rank, mid-run


def _uninterrupted(tmp_path: Path, sequences: int) -> tuple[Path, Path, dict[str, str]]:
    """The SLOW model, ``sequences`` random sequences of 64 tokens and a clean environment, and the export of an
    uninterrupted resident run of them in ``tmp_path / "ref"``: ``(model_dir, data, env)``."""
    import numpy as np

    model_dir = make_tiny_checkpoint(tmp_path, "llama", **SLOW)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, size=(sequences, 64)))
    env = _clean_env()
    ref = subprocess.run(
        _cli(model_dir, tmp_path / "ref", None, data), capture_output=True, text=True, env=env, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    return model_dir, data, env


def _assert_same_tensors(want_dir: Path, got_dir: Path) -> None:
    want, got = _tensors(want_dir), _tensors(got_dir)
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key


def test_repeated_sigkills_then_resume_equal_the_uninterrupted_export(tmp_path):
    """A 2-rank run SIGKILLed at several random layers in a row, resumed each time, ends with the export of an
    uninterrupted run, tensor for tensor (2 kills here; 4 under ``make soak``)."""
    import random

    model_dir, data, env = _uninterrupted(tmp_path, 16)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    rng = random.Random(0)
    killed = []
    for _ in range(4 if SOAK else 2):
        target = min(_completed(ckpt) + rng.randint(1, 4), SLOW["num_hidden_layers"] - 1)
        proc, err, acted = _run_until(_cli(model_dir, out, ckpt, data), ckpt, target, _kill_a_rank, env)
        assert acted is not None, "the run ended before it could be killed"
        assert proc.returncode == 2 and "error: rank" in err and "killed by signal 9" in err, err[-2000:]
        assert not out.exists()
        killed.append(acted)
    resumed = subprocess.run(_cli(model_dir, out, ckpt, data), capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["resumed_from_layer"] >= killed[-1]
    _assert_same_tensors(tmp_path / "ref", out)


def test_a_streamed_run_sigkilled_resumes_to_the_resident_export(tmp_path):
    """``--stream on`` with a checkpoint: a rank SIGKILLed mid-run leaves no export and no staging directory (the
    rank left removes it); then the whole job SIGKILLed leaves its staging directory, which the rerun removes. The
    rerun announces where it resumes, reads the committed layers in again, exports them from the checkpoint and
    ends with the resident run's export, tensor for tensor."""
    model_dir, data, env = _uninterrupted(tmp_path, 8)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cmd = _cli(model_dir, out, ckpt, data, "--stream", "on")
    proc, err, acted = _run_until(cmd, ckpt, 5, _kill_a_rank, env)
    assert acted is not None, "the run ended before it could be killed"
    assert proc.returncode == 2 and "killed by signal 9" in err, err[-2000:]
    assert not out.exists()
    # then the whole job at once (a preemption): nobody is left to remove the staging directory; the rerun does
    kill_all = lambda proc: os.killpg(proc.pid, signal.SIGKILL)
    proc, err, acted = _run_until(cmd, ckpt, acted + 3, kill_all, env, start_new_session=True)
    assert acted is not None, "the run ended before it could be killed"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")] != []
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["resumed_from_layer"] >= acted
    assert f"resuming after layer {report['resumed_from_layer']} of 16 from {ckpt}" in resumed.stderr
    _assert_same_tensors(tmp_path / "ref", out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []
    assert "removed the staging directory an export to" in resumed.stderr


def _default_sigint() -> None:
    """A terminal's run gets SIGINT's default disposition; a background job of a non-interactive shell (CI run with
    ``&``) inherits it ignored, and Python then installs no handler: restore it, as a terminal would have it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_random_layers_ends_cleanly(tmp_path):
    """SIGINT to the process group (a terminal's Ctrl-C) of a 2-rank run at a random layer: "interrupted at layer
    ..." (rank 0's count, relayed by the launcher: where the rerun resumes) on its own line, exit 130, no traceback,
    nothing of ours left in the temp directory (2 times here; 10 under soak)."""
    import random

    import numpy as np

    model_dir = make_tiny_checkpoint(tmp_path, "llama", **SLOW)
    data = tmp_path / "ids.npy"
    # 32 samples and a layer in the first half: a layer takes ~20 ms here, so at least 8 remain to be interrupted in
    np.save(data, np.random.default_rng(0).integers(0, 256, size=(32, 64)))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**_clean_env(), "TMPDIR": str(scratch)}
    rng = random.Random(1)
    for attempt in range(10 if SOAK else 2):
        ckpt = tmp_path / f"ckpt{attempt}"
        layer = rng.randint(1, SLOW["num_hidden_layers"] // 2)
        proc, err, acted = _run_until(
            _cli(model_dir, tmp_path / f"out{attempt}", ckpt, data), ckpt, layer,
            lambda p: os.killpg(p.pid, signal.SIGINT), env, start_new_session=True, preexec_fn=_default_sigint,
        )  # fmt: skip
        assert acted is not None, "the run ended before it could be interrupted"
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 130 and lines[-1].startswith("interrupted at layer "), err[-2000:]
        assert f" of {SLOW['num_hidden_layers']}: " in lines[-1] and f"committed in {ckpt}; rerun" in lines[-1]
        assert "Traceback" not in err and "Error" not in err and "leaked semaphore" not in err, err[-2000:]
        assert not [p.name for p in scratch.iterdir() if p.name.startswith("shardcal")], list(scratch.iterdir())


def test_consecutive_runs_all_succeed(tmp_path):
    """Finished 2-rank runs never report a failure at teardown (3 in a row here; 20 under soak)."""
    import numpy as np

    model_dir = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, size=(4, 16)))
    for attempt in range(20 if SOAK else 3):
        run = subprocess.run(_cli(model_dir, tmp_path / f"out{attempt}", None, data), capture_output=True, text=True,
                             env=_clean_env(), timeout=300)  # fmt: skip
        assert run.returncode == 0 and "error" not in run.stderr.lower(), (attempt, run.stderr[-2000:])
        assert "leaked semaphore" not in run.stderr and "terminate called" not in run.stderr, run.stderr[-2000:]


# ---------------------------------------------------------------------------- a rank killed inside a commit
#: The steps of a checkpoint commit (``checkpoint.commit`` fault points), the rank killed at each, and the layer a
#: rerun resumes from when the kill hits the second commit (completed layers 2): before the new manifest, the
#: previous commit (1); after it, the new one (2).
COMMIT_STEPS = [("activations written", 1, 1), ("parts written", 1, 1), ("manifest written", 0, 2)]
COMMIT_STEPS += [("old file removed", 0, 2)]


def _killed_in_commit(folder: str, target: str, victim: int) -> None:
    """A 2-rank calibration with a checkpoint; rank ``victim`` is SIGKILLed at ``target`` of the second commit."""
    import torch.distributed as dist

    from shardcal import calibrate, fsdp2_wrap
    from shardcal.models import CausalLM, ModelConfig
    from shardcal.runtime.faults import armed

    commits = 0

    def kill(step: str, rank: int) -> None:
        nonlocal commits
        commits += step == "activations written"
        if commits == 2 and step == target and dist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    fsdp2_wrap(model)
    with armed("checkpoint.commit", kill):
        calibrate(model, _commit_data(), "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=folder)


def _commit_data() -> torch.Tensor:
    return torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(5))


def _resumed(folder: str) -> dict:
    from shardcal import calibrate, fsdp2_wrap
    from shardcal.models import CausalLM, ModelConfig
    from shardcal.quant import iter_quantizers

    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    fsdp2_wrap(model)
    report = calibrate(model, _commit_data(), "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=folder)
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    return {
        "resumed": report.resumed_from_layer,
        "amax": {n: q.amax for n, q in iter_quantizers(model) if q.amax is not None},
        "stray": sorted(set(os.listdir(folder)) - set(manifest["files"]) - {"manifest.json"}),
    }


def test_a_rank_killed_at_each_step_of_a_commit_resumes_to_the_uninterrupted_result(tmp_path):
    from shardcal.runtime.launcher import launch

    from _dist import run_on_ranks

    want = run_on_ranks(2, _resumed, str(tmp_path / "uninterrupted"))[0]
    for step, victim, resumes_from in COMMIT_STEPS:
        folder = tmp_path / step.replace(" ", "-")
        with pytest.raises(DistributedError, match=f"rank {victim} was killed by signal 9"):
            launch(_killed_in_commit, 2, str(folder), step, victim)
        for got in run_on_ranks(2, _resumed, str(folder)):
            assert got["resumed"] == resumes_from, step
            assert all(torch.equal(want["amax"][n], got["amax"][n]) for n in want["amax"]), step
            assert got["stray"] == [], (step, got["stray"])  # the killed commit's files and temporaries are gone


def test_more_cpu_ranks_than_cores_is_one_warning(monkeypatch):
    """``--nproc-per-node`` above the usable cores on CPU warns once, naming both numbers; at the core count it is
    silent."""
    import warnings

    from shardcal.runtime import launcher

    monkeypatch.setattr(launcher, "usable_cores", lambda: 2)
    with pytest.warns(UserWarning, match=r"--nproc-per-node 3 starts 3 ranks on 2 CPU core\(s\).*use at most 2"):
        launcher.warn_if_oversubscribed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launcher.warn_if_oversubscribed(2)
    assert launcher.usable_cores() >= 1
