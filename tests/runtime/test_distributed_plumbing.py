"""One home for collectives: the backend the default group gets, the device each collective uses, and a scan
that no other module of the package calls a ``torch.distributed`` collective."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from shardcal.runtime import distributed

SRC = Path(__file__).resolve().parents[2] / "src" / "shardcal"

#: torch.distributed functions that communicate (a collective or point-to-point).
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


def collective_calls(source: str) -> list[str]:
    """``dist.<collective>`` / ``torch.distributed.<collective>`` uses, and collectives imported by name."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = node.value
            text = ast.unparse(base)
            if text in ("dist", "torch.distributed", "distributed_c10d", "dist.distributed_c10d"):
                found.append(f"{text}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in COLLECTIVES]
    return found


def test_no_module_but_distributed_calls_a_collective():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "runtime" / "distributed.py":
            continue
        calls = collective_calls(path.read_text(encoding="utf-8"))
        if calls:
            offenders[str(path.relative_to(SRC))] = calls
    assert not offenders, f"collectives outside shardcal/runtime/distributed.py: {offenders}"


def test_the_scan_sees_a_stray_collective():
    assert collective_calls("import torch.distributed as dist\ndist.all_reduce(t)\n") == ["dist.all_reduce"]
    assert collective_calls("import torch\ntorch.distributed.broadcast(t, 0)\n") == ["torch.distributed.broadcast"]
    assert collective_calls("from torch.distributed import barrier\n") == ["from torch.distributed import barrier"]
    assert collective_calls("x.all_reduce(t)\nfrom .distributed import all_reduce_\n") == []


def test_default_group_has_gloo_beside_nccl_on_cuda(monkeypatch):
    """With CUDA, init_distributed asks for one backend per device, so CPU tensors keep working beside NCCL."""
    asked = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: asked.setdefault("device", device))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        distributed.dist, "init_process_group", lambda backend, timeout: asked.setdefault("backend", backend)
    )
    monkeypatch.setattr(distributed.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda *a: 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.init_distributed() == (0, 1)
    assert asked == {"backend": "cpu:gloo,cuda:nccl", "device": 0}


def test_default_group_is_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.default_backend() == "gloo"


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # small CPU values go through gloo beside NCCL
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
        ("nccl", "cpu", "cuda"),  # an NCCL-only group: CPU tensors must move to the GPU
        ("nccl", "cuda", "cuda"),
        ("gloo", "cuda", "cpu"),  # a gloo-only group: CUDA tensors go through the host
    ],
)
def test_comm_device_per_backend(monkeypatch, backend, device, expected):
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert distributed.comm_device(object(), torch.device(device)).type == expected


def test_single_process_collectives_are_identities():
    t = torch.arange(3.0)
    assert distributed.all_reduce_(t, "sum", None) is t
    assert distributed.all_gather_strings("abc") == ["abc"]
    assert distributed.broadcast_json({"a": [1, 2]}) == {"a": [1, 2]}
    assert distributed.all_gather_floats(2.5) == [2.5]
    assert distributed.ranks_with_flag(True) == [0] and distributed.ranks_with_flag(False) == []


def _small_value_collectives() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    text = "é" * (rank + 1) + f"-rank{rank}"  # different lengths, non-ASCII
    return {
        "strings": distributed.all_gather_strings(text),
        "json": distributed.broadcast_json({"from": rank, "list": [rank]}, src=1),
        "flags": distributed.ranks_with_flag(rank == 1),
        "floats": distributed.all_gather_floats(float(rank) + 0.5),
        "max": distributed.all_reduce_(
            torch.tensor([float(rank), -float(rank)]), "max", distributed.dp_group()
        ).tolist(),
    }


def test_small_value_collectives_on_two_ranks():
    from _dist import run_on_ranks

    results = run_on_ranks(2, _small_value_collectives)
    for r in results:
        assert r["strings"] == ["é-rank0", "éé-rank1"]
        assert r["json"] == {"from": 1, "list": [1]}
        assert r["flags"] == [1]
        assert r["floats"] == [0.5, 1.5]
        assert r["max"] == [1.0, 0.0]


def test_a_one_process_group_leaves_the_environment_alone():
    """Without torchrun's variables, init_distributed forms a one-rank group on a store that binds its own port and
    sets no RANK/MASTER_PORT: a command started afterwards from the same process is not taken for a torchrun rank."""
    import subprocess
    import sys

    code = (
        "import os; from shardcal.runtime.distributed import init_distributed, world; print(init_distributed(), world(), "
        "sorted(k for k in os.environ if k in ('RANK', 'WORLD_SIZE', 'MASTER_PORT', 'MASTER_ADDR')))"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "(0, 1) (0, 1) []"


_LEAVING = """
import atexit, os, sys, time
import torch.distributed as dist

rank, out, raising, sleeping = int(os.environ["RANK"]), sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def record():  # registered first, so it runs last: after shardcal's handler
    from shardcal.runtime.distributed import _EXIT_BARRIERS

    kept = ",".join(str(work.is_completed()) for work in _EXIT_BARRIERS) or "none"
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{dist.is_initialized()} {time.time()} {kept}")


atexit.register(record)
from shardcal.runtime.distributed import broadcast_json, init_distributed

init_distributed()
broadcast_json({"last": "a temporary tensor in flight when the exit barrier starts"})
with open(f"{out}.{rank}.joined", "w") as f:
    f.write(str(time.time()))
if rank == sleeping:  # registered after shardcal's handler, so it runs before it: this rank comes late
    atexit.register(time.sleep, 3)
if rank == raising:
    raise RuntimeError("failed on purpose")
"""


@pytest.mark.parametrize(("raising", "sleeping"), [(-1, 1), (1, 0)], ids=["clean-exit", "a-rank-raised"])
def test_a_group_formed_under_torchrun_is_left_together_at_exit(tmp_path, raising, sleeping):
    """Under torchrun, the group shardcal formed is destroyed at exit, before the interpreter's teardown (which
    aborts a rank whose gloo threads still run): after a barrier on a clean exit (rank 0 waits for rank 1, 3 s
    late), with none after an uncaught exception (rank 1 raised and leaves while rank 0 is still 3 s away; torchrun
    then stops rank 0). The barrier's work is kept for the teardown to free on the main thread: freed last by a gloo
    thread, the broadcast it holds would need the GIL after the teardown began, and abort the rank (SIGABRT)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "job.py").write_text(_LEAVING)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"SHARDCAL_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    argv = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(tmp_path / "job.py"), str(tmp_path / "left")]
    done = subprocess.run([*argv, str(raising), str(sleeping)], capture_output=True, text=True, timeout=300, env=env)
    assert (done.returncode != 0) == (raising >= 0), done.stderr[-3000:]
    assert "failed on purpose" in done.stderr or raising < 0
    assert "SIGABRT" not in done.stderr and "terminate called" not in done.stderr, done.stderr[-3000:]
    joined = [float((tmp_path / f"left.{r}.joined").read_text()) for r in (0, 1)]
    if raising < 0:
        left = [(tmp_path / f"left.{r}").read_text().split() for r in (0, 1)]
        assert [initialized for initialized, _, _ in left] == ["False", "False"]  # destroyed before the teardown
        assert float(left[0][1]) >= joined[1] + 3  # rank 0 waited at the barrier for rank 1
        # the barrier's work (and the broadcast it may hold) is freed by the teardown on the main thread
        assert [kept for _, _, kept in left] == ["True", "True"]
    else:
        initialized, at, kept = (tmp_path / "left.1").read_text().split()
        assert initialized == "False" and float(at) < joined[0] + 2  # rank 1 did not wait for rank 0
        assert kept == "none"


def test_a_barrier_waits_on_the_group_it_is_given(monkeypatch):
    """barrier(group) is torch's barrier over that group (a user's subgroup is not the world), waited on, and its
    work returned; without a group of several ranks, nothing is called."""
    import torch.distributed as dist

    calls = []

    class Work:
        waited = False

        def wait(self):
            self.waited = True

    def spy(group=None, async_op=False):
        calls.append((group, async_op))
        return Work()

    sub = object()
    monkeypatch.setattr(dist, "barrier", spy)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    work = distributed.barrier(sub)
    assert calls == [(sub, True)] and isinstance(work, Work) and work.waited
    assert distributed.barrier(None) is None and len(calls) == 1


def test_leave_together_destroys_the_group_when_the_barrier_raises(monkeypatch):
    """A barrier that fails (a peer gone) still leaves the group destroyed, not to the interpreter's teardown, and
    the failure comes through."""
    import torch.distributed as dist

    from _dist import restored_process_group

    with restored_process_group():
        distributed.init_distributed()
        assert dist.is_initialized()

        def barrier(*args, **kwargs):
            raise RuntimeError("peer gone")

        monkeypatch.setattr(distributed, "barrier", barrier)
        with pytest.raises(RuntimeError, match="peer gone"):
            distributed.leave_together()
        assert not dist.is_initialized()


def _cli_in_the_callers_group(model_dir: str, data: str, out: str) -> list[float]:
    """On a rank of a group the caller (the test pool) formed, under torchrun's variables: the calibrate command,
    then a collective on the caller's group, which must still be there."""
    import torch.distributed as dist

    from shardcal.cli.main import main

    group = dist.group.WORLD
    status = main(["calibrate", model_dir, "--recipe", "fp8", "--out", out, "--data", data, "--num-samples", "4"])
    assert status == 0 and dist.is_initialized() and dist.group.WORLD is group
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return [value.item()]


def test_a_command_run_inside_the_callers_group_leaves_it_usable(tmp_path):
    """A command run inside a process group its caller formed (torchrun's variables set) leaves that group alone:
    it is the caller's to use after and to destroy."""
    import numpy as np

    from _dist import run_on_ranks
    from _tiny_models import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=1)
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, size=(4, 16)))
    got = run_on_ranks(2, _cli_in_the_callers_group, str(model_dir), str(tmp_path / "ids.npy"), str(tmp_path / "out"))
    assert got == [[3.0], [3.0]] and (tmp_path / "out" / "config.json").is_file()
