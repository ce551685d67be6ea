"""Full disks and failed writes: a file-size limit (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored, so a write past it fails
with EFBIG as on a full disk) set on one rank while the export or the checkpoint writer runs. Every rank stops with a
clear error, staging files are gone, OUT_DIR stays absent (or as it was) and the previous checkpoint stays valid."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from _injected import CalibrationInterrupted, interrupt_after

from shardcal.calib.runner import calibrate
from shardcal.errors import CalibrationCheckpointError, ExportError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

LIMIT = 4096  # bytes per file: below every activation file (8 KiB a batch) and export shard these runs write


@contextlib.contextmanager
def file_size_limit(limit: int | None) -> Iterator[None]:
    """Writes past ``limit`` bytes fail with EFBIG in this process (no-op for None)."""
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=4)))
    randomize_(model, seed=0)
    return model


def _data() -> torch.Tensor:
    return torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))


def _calibrated(checkpoint_dir: str | None = None, limit: int | None = None):
    model = _model()
    fsdp2_wrap(model)
    with file_size_limit(limit):
        report = calibrate(model, _data(), "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=checkpoint_dir)
    return model, report


def _export_on_full_disk(folder: str) -> dict:
    """Rank 1's (or the only rank's) writes fail: into a fresh OUT_DIR, then over an existing one."""
    import torch.distributed as dist

    limited = LIMIT if dist.get_rank() == dist.get_world_size() - 1 else None
    model, report = _calibrated()
    errors = []
    for out, overwrite in ((Path(folder) / "fresh", False), (Path(folder) / "existing", True)):
        try:
            with file_size_limit(limited):
                export_checkpoint(model, out, report=report, overwrite=overwrite, max_shard_bytes=10**6)
            errors.append("no error")
        except ExportError as exc:
            errors.append(str(exc))
    export_checkpoint(model, Path(folder) / "after", report=report)  # nothing stale stands in the way
    return {"errors": errors}


def test_export_on_a_full_disk_leaves_nothing(tmp_path):
    for world_size in (1, 2):
        folder = tmp_path / str(world_size)
        folder.mkdir()
        (folder / "existing").mkdir()
        (folder / "existing" / "old.txt").write_text("the previous export")  # an earlier export, as its manifest says
        (folder / "existing" / "shardcal_export.json").write_text('{"files": {"old.txt": 19}}')
        for r in run_on_ranks(world_size, _export_on_full_disk, str(folder)):
            for error in r["errors"]:
                assert "File too large" in error and "Traceback" not in error, error
                assert len(error.splitlines()) == 1
        assert sorted(p.name for p in folder.iterdir()) == ["after", "existing"]  # no staging, no fresh/
        assert sorted(p.name for p in (folder / "existing").iterdir()) == ["old.txt", "shardcal_export.json"]
        assert (folder / "after" / "config.json").is_file()


def _checkpoint_on_full_disk(folder: str) -> dict:
    """Commit layer 2 normally; then resume with rank 1's (or the only rank's) writes failing at the next commit;
    then resume with room again."""
    import torch.distributed as dist

    limited = LIMIT if dist.get_rank() == dist.get_world_size() - 1 else None
    try:
        with interrupt_after(2):
            _calibrated(folder)
    except CalibrationInterrupted:
        pass
    try:
        _calibrated(folder, limited)
        error = "no error"
    except CalibrationCheckpointError as exc:
        error = str(exc)
    dist.barrier()
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    on_disk = sorted(os.listdir(folder))
    model, report = _calibrated(folder)
    return {
        "error": error,
        "completed": manifest["completed_layers"],
        "stray": sorted(set(on_disk) - set(manifest["files"]) - {"manifest.json"}),
        "resumed": report.resumed_from_layer,
        "amax": {n: q.amax for n, q in iter_quantizers(model) if q.amax is not None},
    }


def _uninterrupted() -> dict:
    model, _ = _calibrated()
    return {n: q.amax for n, q in iter_quantizers(model) if q.amax is not None}


def test_checkpoint_on_a_full_disk_keeps_the_previous_commit(tmp_path):
    (want,) = run_on_ranks(1, _uninterrupted)
    for world_size in (1, 2):
        for r in run_on_ranks(world_size, _checkpoint_on_full_disk, str(tmp_path / str(world_size))):
            assert "cannot write the checkpoint" in r["error"] and "File too large" in r["error"], r["error"]
            assert r["completed"] == 2 and r["stray"] == []
            assert r["resumed"] == 2 and all(torch.equal(want[n], r["amax"][n]) for n in want)
