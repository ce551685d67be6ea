"""A streamed run (``stream="on"``, ``--stream``): the decoder layers read in for their step and exported at its end
give the resident run's export byte for byte (every file but the timed report), on one rank and on two; it streams by
itself when the resident run does not fit the memory; a recipe whose layers may fall back lays them out as they are
written, to the same files; what cannot stream is refused with the reason; a failure or Ctrl-C leaves nothing; each
rank reads the layers whole or only its own rows (counted from the files' headers, outside the reader)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _injected import ExportInterrupted, fail_export_at

from shardcal.errors import CalibrationInterrupted, InsufficientMemoryError, RunInterrupted, UsageError
from shardcal.layerwise.options import CalibrationOptions
from shardcal.pipeline import calibrate as pipeline_calibrate
from shardcal.runtime.faults import armed

from _dist import run_on_ranks
from _tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: Written by rank 0 beside the export with timings (the report) or matplotlib's bytes (the plot), and the manifest
#: that records the report's size.
TIMED = ("calibration_report.json", "calibration_sqnr.png", "shardcal_export.json")


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("streamed")
    model_dir = make_tiny_checkpoint(root, "llama", seed=5)
    np.save(root / "ids.npy", np.random.default_rng(1).integers(0, 256, size=(6, 16)))
    return model_dir, root / "ids.npy"


def _without_seconds(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def _files(folder: Path) -> dict[str, tuple[int, Any]]:
    """Every file of an export with its permissions, and its bytes — but for the timed ones: the report without its
    times, the manifest without the report's size and digest, the plot (matplotlib's bytes) only as there."""
    out: dict[str, tuple[int, Any]] = {}
    for path in sorted(folder.iterdir()):
        if path.name == TIMED[0]:
            content: Any = _without_seconds(json.loads(path.read_text()))
        elif path.name == TIMED[2]:
            content = json.loads(path.read_text())
            content = {k: {n: v for n, v in sub.items() if n != TIMED[0]} if isinstance(sub, dict) else sub
                       for k, sub in content.items()}  # fmt: skip
        elif path.name == TIMED[1]:
            content = "a plot"
        else:
            content = path.read_bytes()
        out[path.name] = (path.stat().st_mode & 0o777, content)
    return out


def _tensors(folder: Path) -> dict[str, tuple[str, bytes]]:
    """Every stored tensor's dtype and bytes by name, whichever file holds it (float8 too)."""
    import torch
    from safetensors import safe_open

    out: dict[str, tuple[str, bytes]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = (str(t.dtype), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def _run(model_dir: Path, data: Path, out: Path, recipe: str, stream: str, **kwargs) -> list[float]:
    result = pipeline_calibrate.calibrate_to_checkpoint(model_dir, out, recipe, data=data, stream=stream, **kwargs)
    return [layer.sqnr_db for layer in result.report.layers]


AUTOROUND = """name = "autoround"
[weight]
format = "int4"
granularity = "group"
group_size = 32
[algorithm]
name = "autoround"
iters = 4
"""


@pytest.mark.parametrize(
    "recipe",
    [
        "fp8-dynamic-kv",
        "w8a8-int8-sq",
        "w4a16-gptq-rot",
        "nvfp4-sq-gptq",
        "w4a16-awq",
        pytest.param(AUTOROUND, id="autoround"),
    ],
)
def test_streamed_export_is_the_resident_export(model_and_data, tmp_path, recipe):
    """Observers, SmoothQuant, GPTQ, AWQ, AutoRound, online rotations, the KV cache: the same files, the same
    SQNRs."""
    model_dir, data = model_and_data
    if recipe == AUTOROUND:
        (tmp_path / "autoround.toml").write_text(recipe)
        recipe = str(tmp_path / "autoround.toml")
    resident = _run(model_dir, data, tmp_path / "resident", recipe, "off")
    streamed = _run(model_dir, data, tmp_path / "streamed", recipe, "on")
    assert streamed == resident
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")


def test_streamed_moe_export_is_the_resident_export(tmp_path):
    """Fused experts: their 3-D parameters read by rows like any other."""
    model_dir = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=2)
    np.save(tmp_path / "ids.npy", np.random.default_rng(2).integers(0, 256, size=(4, 16)))
    _run(model_dir, tmp_path / "ids.npy", tmp_path / "resident", "fp8", "off")
    _run(model_dir, tmp_path / "ids.npy", tmp_path / "streamed", "fp8", "on")
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")


def _on_rank(model_dir: str, data: str, out: str, stream: str, gathered: bool = False) -> dict[str, int]:
    """Run on one rank; ``gathered``: each rank reads its rows and the ranks gather them, as on GPUs."""
    from shardcal.loading import streamed

    seen: dict[str, int] = {}
    original, whole = streamed.StreamedLayers.close, streamed.reads_layers_whole

    def counting(self) -> None:  # what this rank read of the decoder layers in the whole run
        original(self)
        seen["bytes_read"] = self.bytes_read

    streamed.StreamedLayers.close = counting
    if gathered:
        streamed.reads_layers_whole = lambda device_type, world_size: False
    try:
        _run(Path(model_dir), Path(data), Path(out), "w4a16-gptq", stream)
    finally:
        streamed.StreamedLayers.close, streamed.reads_layers_whole = original, whole
    return seen


def test_two_ranks_stream_the_resident_export_and_one_ranks_tensors(model_and_data, tmp_path):
    """2 ranks streamed: the 2-rank resident export's files, the 1-rank export's tensors, whether each rank reads
    every layer whole (CPU) or its own rows of it and the ranks gather them (GPUs); what each rank read is counted
    against the files' headers: the layers, or half of them."""
    model_dir, data = model_and_data
    run_on_ranks(2, _on_rank, str(model_dir), str(data), str(tmp_path / "resident2"), "off")
    whole = run_on_ranks(2, _on_rank, str(model_dir), str(data), str(tmp_path / "streamed2"), "on")
    rows = run_on_ranks(2, _on_rank, str(model_dir), str(data), str(tmp_path / "gathered2"), "on", True)
    assert "bytes_read" not in run_on_ranks(1, _on_rank, str(model_dir), str(data), str(tmp_path / "r1"), "off")[0]
    _run(model_dir, data, tmp_path / "one", "w4a16-gptq", "on")
    assert _files(tmp_path / "streamed2") == _files(tmp_path / "gathered2") == _files(tmp_path / "resident2")
    assert _tensors(tmp_path / "streamed2") == _tensors(tmp_path / "one")
    layers = _layer_bytes_on_disk(model_dir)
    assert [r["bytes_read"] for r in whole] == [layers, layers]
    assert [r["bytes_read"] for r in rows] == [layers // 2, layers // 2]  # the tiny model's tensors split evenly


def _layer_bytes_on_disk(model_dir: Path) -> int:
    """The decoder layers' bytes from the safetensors header, read here (not by shardcal's reader)."""
    path = next(model_dir.glob("*.safetensors"))
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    spans = [entry["data_offsets"] for key, entry in header.items() if key.startswith("model.layers.")]
    return sum(stop - start for start, stop in spans)


def test_auto_streams_when_the_resident_run_does_not_fit(model_and_data, tmp_path, monkeypatch):
    """A budget between the streamed and the resident plan's needs: auto streams (one warning says so), off is
    refused by the planner, and the export is the resident one's."""
    from shardcal.plan import planner

    model_dir, data = model_and_data
    _run(model_dir, data, tmp_path / "resident", "fp8", "off", force=True)
    ids_shape = tuple(np.load(data).shape)
    need = {}
    for streamed in (False, True):
        settings = planner.PlanSettings(num_samples=ids_shape[0], seq_len=ids_shape[1], streamed=streamed)
        plan = planner.plan_source(planner.read_source(model_dir), _recipe("fp8"), settings, model_dir)
        need[streamed] = plan.ranks[0].required
    assert need[True] < need[False]
    budget = (need[True] + need[False]) // 2
    monkeypatch.setattr(planner, "local_budget", lambda device: planner.Budget(None, budget))
    with pytest.raises(InsufficientMemoryError):
        _run(model_dir, data, tmp_path / "off", "fp8", "off")
    assert not (tmp_path / "off").exists()
    with pytest.warns(UserWarning, match="streaming its decoder layers from disk"):
        _run(model_dir, data, tmp_path / "auto", "fp8", "auto")
    assert _files(tmp_path / "auto") == _files(tmp_path / "resident")
    monkeypatch.setattr(planner, "local_budget", lambda device: planner.Budget(None, need[True] // 2))
    with pytest.raises(InsufficientMemoryError) as neither:  # neither fits: the resident refusal, unchanged
        _run(model_dir, data, tmp_path / "neither", "fp8", "auto")
    assert "streaming cannot help" not in str(neither.value) and not (tmp_path / "neither").exists()


def test_auto_keeps_the_refusal_of_a_run_that_cannot_stream(model_and_data, tmp_path, monkeypatch):
    """The resident run does not fit, and the run cannot stream (the residual rotation): auto refuses before loading
    with the planner's message and the reason streaming cannot help — it does not try to stream."""
    from shardcal.plan import planner

    model_dir, data = model_and_data
    (tmp_path / "res.toml").write_text(RESIDUAL)
    ids_shape = tuple(np.load(data).shape)
    settings = planner.PlanSettings(num_samples=ids_shape[0], seq_len=ids_shape[1], streamed=True)
    streamed_need = planner.plan_source(planner.read_source(model_dir), _recipe("fp8"), settings, model_dir)
    monkeypatch.setattr(planner, "local_budget", lambda device: planner.Budget(None, streamed_need.ranks[0].required))
    with pytest.raises(InsufficientMemoryError, match=r"; streaming cannot help: recipe 'res' rotates the residual"):
        _run(model_dir, data, tmp_path / "out", str(tmp_path / "res.toml"), "auto")
    assert not (tmp_path / "out").exists()


def _recipe(name: str):
    from shardcal.calib.recipes import load_recipe

    return load_recipe(name)


RESIDUAL = """name = "res"
[weight]
format = "int8"
granularity = "channel"
[rotation]
residual = "hadamard"
"""


@pytest.mark.parametrize(
    ("recipe", "kwargs", "reason"), [(RESIDUAL, {}, r"residual stream")], ids=["residual-rotation"]
)
def test_what_cannot_stream_is_refused_with_the_reason(model_and_data, tmp_path, recipe, kwargs, reason):
    model_dir, data = model_and_data
    if recipe.startswith("name"):
        (tmp_path / "r.toml").write_text(recipe)
        recipe = str(tmp_path / "r.toml")
    if kwargs.get("model_impl") == "transformers":
        pytest.importorskip("transformers")
    with pytest.raises(UsageError, match=rf"stream on: cannot stream this run: .*{reason}"):
        _run(model_dir, data, tmp_path / "out", recipe, "on", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_bad_stream_mode_is_named(model_and_data, tmp_path):
    model_dir, data = model_and_data
    with pytest.raises(UsageError, match=r"stream 'yes': expected one of auto, on, off"):
        _run(model_dir, data, tmp_path / "out", "fp8", "yes")


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".out", "out")))


def test_a_failed_streamed_export_leaves_nothing(model_and_data, tmp_path):
    """A failure while a layer is written at the end of its step: the error comes through, no out_dir, no staging."""
    model_dir, data = model_and_data
    with fail_export_at(1), pytest.raises(ExportInterrupted, match="unit 1"):
        _run(model_dir, data, tmp_path / "out", "fp8", "on")
    assert _leftovers(tmp_path) == []


def test_ctrl_c_in_a_streamed_run_leaves_nothing_and_says_so(model_and_data, tmp_path):
    model_dir, data = model_and_data

    def interrupt(unit: int, unit_name: str) -> None:  # while layer 0, calibrated, is written
        if unit == 0:
            raise KeyboardInterrupt

    with armed("export.unit", interrupt), pytest.raises(RunInterrupted) as caught:
        _run(model_dir, data, tmp_path / "out", "fp8", "on")
    assert str(caught.value) == (
        f"interrupted at layer 1 of 2 of a streamed run: {tmp_path / 'out'} was not written and the calibration is "
        "lost; pass checkpoint_dir to keep it next time"
    )
    assert _leftovers(tmp_path) == []
    # with a checkpoint directory: how far it got and what is committed (the command says it: interrupted_message)
    options = CalibrationOptions(checkpoint_dir=str(tmp_path / "ckpt"))
    with armed("export.unit", interrupt), pytest.raises(CalibrationInterrupted) as stopped:
        _run(model_dir, data, tmp_path / "out", "fp8", "on", options=options)
    assert (stopped.value.done, stopped.value.total, stopped.value.committed) == (1, 2, 0)  # layer 0 not committed
    assert stopped.value.checkpoint_dir == str(tmp_path / "ckpt")
    assert _leftovers(tmp_path) == []


def test_plan_of_a_streamed_run_holds_no_layer_shards_and_no_checkpoint_pages(model_and_data):
    """The streamed plan: the decoder layers read whole (on CPU; the other half of them more than the resident
    rank reads), no checkpoint page kept, less held between steps."""
    from shardcal.plan import planner

    model_dir, _ = model_and_data
    plans = {
        streamed: planner.plan_source(
            planner.read_source(model_dir), _recipe("fp8"),
            planner.PlanSettings(world_size=2, num_samples=6, seq_len=16, streamed=streamed), model_dir,
        ).ranks[0]
        for streamed in (False, True)
    }  # fmt: skip
    resident, streamed = plans[False], plans[True]
    layers = _layer_bytes_on_disk(model_dir)
    assert streamed.bytes_read == resident.bytes_read + layers // 2 and resident.bytes_read > 0
    assert streamed.parts["checkpoint_pages"] == 0 < resident.parts["checkpoint_pages"]
    assert resident.parts["param_shards"] - streamed.parts["param_shards"] == pytest.approx(layers / 2, rel=0.05)


def test_plan_of_a_streamed_run_reading_rows_reads_and_holds_half_a_layer_less(model_and_data, monkeypatch):
    """Where each rank reads its rows and the ranks gather them (GPUs; forced here on CPU), the plan reads half of
    the layers fewer and, during the layers, holds half a layer less: the next layer's rows, not all of it."""
    from shardcal.plan import planner, prepared

    model_dir, _ = model_and_data

    def rank0() -> Any:
        settings = planner.PlanSettings(world_size=2, num_samples=6, seq_len=16, streamed=True)
        return planner.plan_source(planner.read_source(model_dir), _recipe("fp8"), settings, model_dir).ranks[0]

    whole = rank0()
    monkeypatch.setattr(prepared, "reads_layers_whole", lambda device_type, world_size: False)
    rows = rank0()
    layers = _layer_bytes_on_disk(model_dir)  # two layers
    assert whole.bytes_read - rows.bytes_read == layers // 2
    assert whole.phases["layers"] - rows.phases["layers"] == layers // 4


def test_one_rank_holds_each_streamed_layer_as_read(model_and_data, tmp_path, monkeypatch):
    """Alone, a rank's rows are the whole layer: held as read, never copied into a gathered one (on a GPU too);
    with several ranks each reads the whole layer on CPU, its rows on GPUs."""
    from shardcal.loading import streamed

    cases = [("cpu", 1), ("cuda", 1), ("cpu", 2), ("cuda", 2)]
    assert [streamed.reads_layers_whole(*case) for case in cases] == [True, True, True, False]

    def gather(*args: Any) -> None:
        raise AssertionError("a rank alone gathered a layer")

    monkeypatch.setattr(streamed, "all_gather_rows_", gather)
    model_dir, data = model_and_data
    assert _run(model_dir, data, tmp_path / "out", "fp8", "on")


def test_plan_of_a_resumable_streamed_run_counts_the_rows_kept_until_the_commit(model_and_data, tmp_path):
    """With a checkpoint directory and an algorithm that changes weights, a finished layer's rows (this rank's half)
    stay until the next commit: the streamed layers phase grows by that much per layer between commits; with
    weights left as they are (observers only) nothing is kept."""
    from shardcal.plan import planner

    model_dir, _ = model_and_data

    def layers_phase(recipe: str, **options) -> int:
        settings = planner.PlanSettings(world_size=2, num_samples=6, seq_len=16, streamed=True,
                                        options=CalibrationOptions(**options))  # fmt: skip
        plan = planner.plan_source(planner.read_source(model_dir), _recipe(recipe), settings, model_dir)
        return plan.ranks[0].phases["layers"]

    half_a_layer = _layer_bytes_on_disk(model_dir) / 2 / 2  # two layers in the file, each rank holds half a layer
    plain = layers_phase("w4a16-gptq")
    assert layers_phase("w4a16-gptq", checkpoint_dir=str(tmp_path)) - plain == pytest.approx(half_a_layer, rel=0.05)
    every_2 = layers_phase("w4a16-gptq", checkpoint_dir=str(tmp_path), checkpoint_every=2) - plain
    assert every_2 == pytest.approx(2 * half_a_layer, rel=0.05)
    assert layers_phase("fp8", checkpoint_dir=str(tmp_path)) == layers_phase("fp8")


def test_planned_checkpoint_dir_of_a_streamed_run_holds_each_layers_weights_once(model_and_data, tmp_path):
    """A streamed GPTQ run's commits add the new layer's weights beside the earlier ones' instead of rewriting them:
    the planned size is at least the directory's real size after each commit (its files summed) and less than the
    resident run's plan, which counts two full copies of the weights at the last commit."""
    from shardcal.plan import planner
    from shardcal.runtime.faults import armed

    model_dir, data = model_and_data
    directory = tmp_path / "ckpt"
    sizes: list[int] = []

    def measure(completed_layers: int) -> None:
        sizes.append(sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()))

    options = CalibrationOptions(checkpoint_dir=str(directory), batch_size=2)
    with armed("calibrate.committed", measure):
        _run(model_dir, data, tmp_path / "out", "w4a16-gptq", "on", options=options, keep_checkpoint=True)
    measure(2)  # the last commit (no fault point after it)
    assert len(sizes) == 2 and sizes[0] < sizes[1], sizes
    planned = {
        streamed: planner.plan_source(
            planner.read_source(model_dir), _recipe("w4a16-gptq"),
            planner.PlanSettings(num_samples=6, seq_len=16, streamed=streamed, options=options), model_dir,
        ).disk["checkpoint_dir_bytes"]
        for streamed in (False, True)
    }  # fmt: skip
    assert max(sizes) <= planned[True] < planned[False], (sizes, planned)


def test_plan_shows_the_streamed_run_beside_the_resident_one(model_and_data, capsys):
    from shardcal.cli import main as cli

    model_dir, _ = model_and_data
    assert cli.main(["plan", str(model_dir), "--recipe", "fp8", "--host-memory", "10GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "fits: 10.0 GiB host (--host-memory)" or lines[-2].startswith("fits: ")
    assert re.fullmatch(
        r"streamed \(--stream on\): peak [\d.]+ [KMG]iB per rank \(rank 0, while \w+\), reads [\d.]+ KiB", lines[-1]
    )
    assert cli.main(["plan", str(model_dir), "--recipe", "fp8", "--host-memory", "1MB"]) == 0
    assert "does not fit either" in capsys.readouterr().out.splitlines()[-1]
    (model_dir.parent / "res.toml").write_text(RESIDUAL)
    assert cli.main(["plan", str(model_dir), "--recipe", str(model_dir.parent / "res.toml")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("streamed (--stream on): cannot stream this run: recipe")


def test_the_command_says_it_streamed(model_and_data, tmp_path, capsys):
    from shardcal.cli import main as cli

    model_dir, data = model_and_data
    args = ["calibrate", str(model_dir), "--recipe", "fp8", "--data", str(data), "--out", str(tmp_path / "o")]
    assert cli.main([*args, "--stream", "on"]) == 0
    said = capsys.readouterr().out
    assert "over 1 rank(s) streamed from disk in " in said
    assert re.search(r" in [0-9.]+ s \(load [0-9.]+ s, calibration [0-9.]+ s, export [0-9.]+ s\); mean", said)
    result = pipeline_calibrate.calibrate_to_checkpoint(model_dir, tmp_path / "o2", "fp8", data=data, stream="on")
    phases = result.phases
    assert result.streamed and min(phases.load, phases.calibration, phases.export) > 0
    assert result.wall_seconds > phases.load + phases.calibration + phases.export
    assert cli.main([*args, "--stream", "off", "--overwrite"]) == 0
    assert "streamed from disk" not in capsys.readouterr().out


def test_decoder_layer_buffers_stay_resident_or_are_named(model_and_data, monkeypatch):
    """Streaming materialises parameters only: a decoder layer's computed buffer stays resident with its values, on
    the run's device; one that is neither computed nor in the checkpoint is named, not streamed missing."""
    import torch

    from shardcal.errors import CheckpointError
    from shardcal.loading import streamed
    from shardcal.runtime.distributed import init_distributed

    built = streamed.build_on_meta

    def with_buffers(real: bool):
        def build(cfg, dtype):
            model = built(cfg, dtype)
            table = torch.arange(3.0) if real else torch.zeros(3, device="meta")
            model.model.layers[1].register_buffer("table", table)
            return model

        return build

    init_distributed()
    monkeypatch.setattr(streamed, "build_on_meta", with_buffers(real=True))
    model = streamed.load_streamed(model_and_data[0])
    kept = model.model.layers[1].table
    assert kept.device.type == "cpu" and kept.tolist() == [0.0, 1.0, 2.0]
    monkeypatch.setattr(streamed, "build_on_meta", with_buffers(real=False))
    with pytest.raises(
        CheckpointError, match=r"the decoder layer buffer model\.layers\.1\.table is not in the checkpoint"
    ):
        streamed.load_streamed(model_and_data[0])


# ---------------------------------------------------------------------------- resume


def _resumable(model_dir: str, data: str, out: str, recipe: str, ckpt: str, stop_after: int | None) -> dict:
    """A streamed run with a checkpoint directory, stopped once ``stop_after`` layers are committed (None: to the
    end); whether it stopped, else where it resumed and its SQNRs."""
    from _injected import CalibrationInterrupted, interrupt_after

    options = CalibrationOptions(checkpoint_dir=ckpt, batch_size=2)
    try:
        with interrupt_after(stop_after):
            result = pipeline_calibrate.calibrate_to_checkpoint(
                model_dir, out, recipe, data=data, stream="on", options=options, keep_checkpoint=True
            )
    except CalibrationInterrupted:
        return {"stopped": True}
    return {
        "stopped": False,
        "resumed": result.report.resumed_from_layer,
        "sqnr": [x.sqnr_db for x in result.report.layers],
    }


@pytest.mark.parametrize(
    ("recipe", "written_on", "resumed_on"),
    [("w4a16-gptq", 2, 2), ("w8a8-int8-sq", 2, 1), ("fp8", 1, 2)],
    ids=["gptq-2-then-2", "smoothquant-2-then-1", "observers-1-then-2"],
)
def test_a_stopped_streamed_run_resumes_to_the_uninterrupted_export(tmp_path, recipe, written_on, resumed_on):
    """Stopped after 2 of 4 committed layers (weights changed by GPTQ or SmoothQuant, or only observed), then
    resumed on the same or another number of ranks: the committed layers are read in again and exported from the
    checkpoint, the rest calibrated, and every tensor is the uninterrupted run's; nothing of the stopped run's
    export is left."""
    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=3, num_hidden_layers=4)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(4).integers(0, 256, size=(8, 16)))
    args = (str(model_dir), str(data))
    (want,) = run_on_ranks(1, _resumable, *args, str(tmp_path / "full" / "out"), recipe, str(tmp_path / "c0"), None)
    (tmp_path / "run").mkdir()
    ckpt = str(tmp_path / "ckpt")
    stopped = run_on_ranks(written_on, _resumable, *args, str(tmp_path / "run" / "out"), recipe, ckpt, 2)
    assert all(r["stopped"] for r in stopped) and _leftovers(tmp_path / "run") == []
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["completed_layers"] == 2
    got = run_on_ranks(resumed_on, _resumable, *args, str(tmp_path / "run" / "out"), recipe, ckpt, None)[0]
    assert got["resumed"] == 2 and got["sqnr"] == want["sqnr"]
    assert _tensors(tmp_path / "run" / "out") == _tensors(tmp_path / "full" / "out")


def test_a_streamed_checkpoint_and_a_resident_one_are_not_each_others(model_and_data, tmp_path):
    """A checkpoint of a resident run is refused by a streamed one, naming how the layers are held, and the other
    way round."""
    from shardcal.errors import CalibrationCheckpointError

    model_dir, data = model_and_data
    for first, second in (("off", "on"), ("on", "off")):
        ckpt = tmp_path / f"ckpt-{first}"
        options = CalibrationOptions(checkpoint_dir=str(ckpt))
        _run(model_dir, data, tmp_path / f"a-{first}", "fp8", first, options=options, keep_checkpoint=True)
        with pytest.raises(CalibrationCheckpointError, match="different way of holding the decoder layers"):
            _run(model_dir, data, tmp_path / f"b-{first}", "fp8", second, options=options)


def test_a_streamed_checkpoint_is_not_resumed_after_a_model_file_is_rewritten(tmp_path):
    """Stopped after 2 of 4 layers; then model.safetensors is written again with other decoder-layer weights of the
    same shapes (the same size, a later modification time, as any rewrite has): the resume is refused, naming the
    model files, and nothing is exported."""
    import os

    from safetensors.torch import load_file, save_file

    from shardcal.errors import CalibrationCheckpointError

    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=3, num_hidden_layers=4)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(4).integers(0, 256, size=(8, 16)))
    (tmp_path / "run").mkdir()
    args = (str(model_dir), str(data), str(tmp_path / "run" / "out"), "fp8", str(tmp_path / "ckpt"))
    assert _resumable(*args, 2)["stopped"]
    path = model_dir / "model.safetensors"
    size, stamp = path.stat().st_size, path.stat().st_mtime_ns
    weights = load_file(str(path))
    weights["model.layers.3.mlp.down_proj.weight"] *= 2
    save_file(weights, str(path), metadata={"format": "pt"})
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a rewrite a second later (coarse clocks: not the same tick)
    assert path.stat().st_size == size
    with pytest.raises(
        CalibrationCheckpointError,
        match=r"checkpoint is from a different set of model files \(the decoder layers. names, sizes and modification",
    ):
        _resumable(*args, None)
    assert _leftovers(tmp_path / "run") == []


# ---------------------------------------------------------------------------- [fallback]

W8A8 = 'name = "w8a8"\n[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
FALLBACKS = {
    "full-precision": "[fallback]\nmin_layer_sqnr_db = {floor}\nfull_precision = true\n",
    "int8-weight-only": '[fallback]\nmin_layer_sqnr_db = {floor}\n[fallback.weight]\nformat = "int8"\n'
    'granularity = "channel"\n',
}


@pytest.fixture(scope="module")
def sensitive_layer(tmp_path_factory) -> tuple[Path, Path, float]:
    """A 3-layer checkpoint whose layer 1 has outlier channels (per-tensor int8 inputs wreck it), its data, and a
    floor between layer 1's SQNR under plain W8A8 and the others' (a resident run measures them)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("fallback")
    model_dir = make_tiny_checkpoint(root, "llama", seed=5, num_hidden_layers=3)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.1.input_layernorm.weight"][:2] *= 60.0
    weights["model.layers.1.post_attention_layernorm.weight"][3:5] *= 60.0
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    np.save(root / "ids.npy", np.random.default_rng(1).integers(0, 256, size=(6, 16)))
    (root / "w8a8.toml").write_text(W8A8)
    sqnr = _run(model_dir, root / "ids.npy", root / "plain", str(root / "w8a8.toml"), "off")
    assert sqnr[1] + 6 < min(sqnr[0], sqnr[2]), sqnr
    return model_dir, root / "ids.npy", (sqnr[1] + min(sqnr[0], sqnr[2])) / 2


def _fallback_recipe(folder: Path, kind: str, floor: float) -> str:
    (folder / f"{kind}.toml").write_text(W8A8 + FALLBACKS[kind].format(floor=floor))
    return str(folder / f"{kind}.toml")


def _with_shard_size(max_shard_bytes: int | None):
    """Every export's shard files cut at ``max_shard_bytes`` (None: the default), for a block."""
    import contextlib

    from shardcal.export import export

    functions = (export.export_checkpoint, export.ExportSession.__init__, export.plan_streamed_export)
    stack = contextlib.ExitStack()
    if max_shard_bytes is not None:
        for f in functions:
            saved = dict(f.__kwdefaults__)
            f.__kwdefaults__["max_shard_bytes"] = max_shard_bytes
            stack.callback(f.__kwdefaults__.update, saved)
    return stack


def _fallback_on_ranks(model_dir: str, data: str, out: str, recipe: str, stream: str, max_shard_bytes: int | None):
    with _with_shard_size(max_shard_bytes):
        result = pipeline_calibrate.calibrate_to_checkpoint(model_dir, out, recipe, data=data, stream=stream)
    return result.report.fallback_layers


@pytest.mark.parametrize(
    ("kind", "max_shard_bytes"), [("full-precision", None), ("int8-weight-only", 20_000)],
    ids=["full-precision", "int8-weight-only-in-small-files"],
)  # fmt: skip
def test_a_streamed_run_whose_layer_falls_back_exports_the_resident_files(sensitive_layer, tmp_path, kind,
                                                                          max_shard_bytes):  # fmt: skip
    """Layer 1 falls back (to full precision, or to int8 weight-only) after its step: the streamed export lays it
    out then, and writes the resident run's files byte for byte — in one file, or in files of at most 20 KB whose
    cuts move with layer 1's tensors."""
    model_dir, data, floor = sensitive_layer
    recipe = _fallback_recipe(tmp_path, kind, floor)
    args = (str(model_dir), str(data))
    resident = _fallback_on_ranks(*args, str(tmp_path / "resident"), recipe, "off", max_shard_bytes)
    streamed = _fallback_on_ranks(*args, str(tmp_path / "streamed"), recipe, "on", max_shard_bytes)
    assert resident == streamed == ["model.layers.1"]
    files = _files(tmp_path / "streamed")
    assert files == _files(tmp_path / "resident")
    shard_files = [f for f in files if f.endswith(".safetensors")]
    assert len(shard_files) == 1 if max_shard_bytes is None else len(shard_files) > 5
    assert not [p for p in (tmp_path / "streamed").iterdir() if p.name.startswith(".")]


FALLBACK_WITH = {
    "kv-cache": ({}, '[kv_cache]\nformat = "fp8_e4m3"\n'),
    "export-dtype": ({"export_dtype": "bfloat16"}, ""),
}


@pytest.mark.parametrize("combined", list(FALLBACK_WITH))
def test_a_streamed_fallback_with_a_kv_cache_or_an_export_dtype_is_the_resident_export(
    sensitive_layer, tmp_path, combined
):
    """A [fallback] recipe with a [kv_cache] (the fallen-back layer keeps its KV-cache scales), or exported in bf16:
    streamed in files of at most 20 KB, the resident run's files, permissions, report and manifest; the run's
    umask is honoured by every file and the directory."""
    import os

    model_dir, data, floor = sensitive_layer
    kwargs, extra = FALLBACK_WITH[combined]
    (tmp_path / "r.toml").write_text(W8A8 + extra + FALLBACKS["int8-weight-only"].format(floor=floor))
    recipe = str(tmp_path / "r.toml")
    old = os.umask(0o027)
    try:
        with _with_shard_size(20_000):
            results = {
                stream: pipeline_calibrate.calibrate_to_checkpoint(
                    model_dir, tmp_path / stream, recipe, data=data, stream=stream, **kwargs
                )
                for stream in ("off", "on")
            }
    finally:
        os.umask(old)
    assert [r.report.fallback_layers for r in results.values()] == [["model.layers.1"]] * 2
    files = _files(tmp_path / "on")
    assert files == _files(tmp_path / "off") and len([f for f in files if f.endswith(".safetensors")]) > 5
    assert {mode for mode, _ in files.values()} == {0o640} and (tmp_path / "on").stat().st_mode & 0o777 == 0o750
    if combined == "kv-cache":
        scales = [k for k in _tensors(tmp_path / "on") if k.endswith((".k_scale", ".v_scale"))]
        assert {k.split(".")[2] for k in scales} == {"0", "1", "2"}
    else:
        stored = {dtype for key, (dtype, _) in _tensors(tmp_path / "on").items() if key.endswith("norm.weight")}
        assert stored == {"torch.bfloat16"}


def test_two_ranks_streaming_a_layer_that_falls_back_export_the_resident_files(sensitive_layer, tmp_path):
    """2 ranks, small files: each rank lays out and seals its own files as the layers come; the 2-rank resident
    run's files, and the 1-rank run's tensors."""
    model_dir, data, floor = sensitive_layer
    recipe = _fallback_recipe(tmp_path, "int8-weight-only", floor)
    args = (str(model_dir), str(data))
    resident = run_on_ranks(2, _fallback_on_ranks, *args, str(tmp_path / "resident"), recipe, "off", 20_000)
    streamed = run_on_ranks(2, _fallback_on_ranks, *args, str(tmp_path / "streamed"), recipe, "on", 20_000)
    assert resident == streamed == [["model.layers.1"]] * 2
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")
    _fallback_on_ranks(*args, str(tmp_path / "one"), recipe, "on", None)
    assert _tensors(tmp_path / "streamed") == _tensors(tmp_path / "one")


def test_a_layer_laid_out_unlike_the_calibrated_model_fails_the_export(sensitive_layer, tmp_path, monkeypatch):
    """The export checks the files it laid out layer by layer against the plan made from the calibrated model at the
    end: a layer laid out without its last tensor fails the export, naming why, and leaves nothing."""
    from shardcal.errors import ExportError
    from shardcal.export import export

    model_dir, data, floor = sensitive_layer
    recipe = _fallback_recipe(tmp_path, "full-precision", floor)
    laid_out = export.laid_out_layer

    def short(*args, **kwargs):
        unit = laid_out(*args, **kwargs)
        unit.entries, unit.owners = unit.entries[:-1], unit.owners[:-1]
        return unit

    monkeypatch.setattr(export, "laid_out_layer", short)
    (tmp_path / "run").mkdir()
    with pytest.raises(ExportError, match="do not hold the tensors of the calibrated model's layout"):
        _fallback_on_ranks(str(model_dir), str(data), str(tmp_path / "run" / "out"), recipe, "on", None)
    assert list((tmp_path / "run").iterdir()) == []


def test_a_stopped_streamed_run_resumes_its_fallback_layer(sensitive_layer, tmp_path):
    """Stopped on 2 ranks after layers 0 and 1 are committed (layer 1 fell back), resumed on 1: layer 1 is read in
    again with its fallback quantizers and written as it fell back; every tensor is the uninterrupted run's."""
    model_dir, data, floor = sensitive_layer
    recipe = _fallback_recipe(tmp_path, "full-precision", floor)
    args = (str(model_dir), str(data))
    (want,) = run_on_ranks(1, _resumable, *args, str(tmp_path / "full" / "out"), recipe, str(tmp_path / "c0"), None)
    (tmp_path / "run").mkdir()
    ckpt = str(tmp_path / "ckpt")
    stopped = run_on_ranks(2, _resumable, *args, str(tmp_path / "run" / "out"), recipe, ckpt, 2)
    assert all(r["stopped"] for r in stopped) and _leftovers(tmp_path / "run") == []
    got = run_on_ranks(1, _resumable, *args, str(tmp_path / "run" / "out"), recipe, ckpt, None)[0]
    assert got["resumed"] == 2 and got["sqnr"] == want["sqnr"] and want["sqnr"][1] == float("inf")
    assert _tensors(tmp_path / "run" / "out") == _tensors(tmp_path / "full" / "out")


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_plan_of_a_fallback_recipe_holds_one_more_copy_of_the_layer(sensitive_layer, tmp_path, streamed, world_size):
    """A [fallback] keeps a copy of the layer as it came through its step (to put back when it falls back): the
    planned layers phase is the plain recipe's and one whole layer more (its bytes from the file's header), on every
    rank of one or two (the copy is of the gathered layer, not of a rank's rows)."""
    from shardcal.calib.recipes import load_recipe
    from shardcal.plan import planner

    model_dir, _, floor = sensitive_layer

    def layers_phase(recipe: str) -> int:
        settings = planner.PlanSettings(world_size=world_size, num_samples=6, seq_len=16, streamed=streamed)
        plan = planner.plan_source(planner.read_source(model_dir), load_recipe(recipe), settings, model_dir)
        return plan.ranks[0].phases["layers"]

    (tmp_path / "w8a8.toml").write_text(W8A8)
    one_layer = _layer_bytes_on_disk(model_dir) // 3
    with_copy = layers_phase(_fallback_recipe(tmp_path, "full-precision", floor))
    assert with_copy - layers_phase(str(tmp_path / "w8a8.toml")) == one_layer


def test_plan_of_a_streamed_run_holds_a_layers_largest_encoding_during_the_layers(model_and_data, monkeypatch):
    """A streamed layer is encoded for export at the end of its step: its largest Linear's encoding (the weight's
    element count from the file's header, times the bytes per element encoding takes) is held in the layers phase of
    a streamed run, and not in a resident run's (whose export encodes later). Made large here, it is the only
    difference."""
    from shardcal.plan import planner, quantizers

    model_dir, _ = model_and_data
    raw = (model_dir / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    largest = max(
        int(np.prod(entry["shape"]))
        for key, entry in header.items()
        if key.startswith("model.layers.") and key.endswith("proj.weight")
    )

    def layers_phase(streamed: bool) -> int:
        settings = planner.PlanSettings(world_size=2, num_samples=6, seq_len=16, streamed=streamed)
        return (
            planner.plan_source(planner.read_source(model_dir), _recipe("fp8"), settings, model_dir)
            .ranks[0]
            .phases["layers"]
        )

    before = {streamed: layers_phase(streamed) for streamed in (False, True)}
    monkeypatch.setitem(quantizers.ENCODE_BYTES, "fp8", quantizers.ENCODE_BYTES["fp8"] + 1000)
    after = {streamed: layers_phase(streamed) for streamed in (False, True)}
    assert after[False] == before[False]
    assert after[True] - before[True] == 1000 * largest


# ---------------------------------------------------------------------------- transformers' classes


def _hf_checkpoint(root: Path, family: str) -> Path:
    """A tiny transformers model of ``family`` saved by transformers (its own layout: fused experts and all)."""
    from _hf_models import hf_model

    folder = root / family
    hf_model(family).save_pretrained(folder)
    return folder


def _hf_on_ranks(
    model_dir: str, data: str, out: str, recipe: str, stream: str, batch_size: int = 8
) -> list[float | None]:
    result = pipeline_calibrate.calibrate_to_checkpoint(
        model_dir, out, recipe, data=data, stream=stream, model_impl="transformers",
        options=CalibrationOptions(batch_size=batch_size),
    )  # fmt: skip
    return [layer.sqnr_db for layer in result.report.layers]


HF_STREAMED = [("llama", "w8a8-int8-sq"), ("gemma3", "w4a16-awq"), ("deepseek_v3", "fp8"), ("gpt_oss", "fp8-dynamic")]


@pytest.mark.parametrize(("family", "recipe"), HF_STREAMED, ids=[f for f, _ in HF_STREAMED])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_transformers_class_streams_to_its_resident_export(tmp_path, family, recipe, ranks):
    """transformers' classes stream: each decoder layer read in for its step (fused experts from the checkpoint's own
    layout, MLA's projections, a router's correction bias kept resident) and its inputs recorded from the model's own
    forward with the layers standing by (sliding and full attention: each layer its mask) — the resident run's
    export, file for file, and its SQNRs, on 1 and on 2 ranks."""
    pytest.importorskip("transformers")
    model_dir = _hf_checkpoint(tmp_path, family)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(3).integers(0, 250, size=(4, 16)))
    args = (str(model_dir), str(data))
    resident = run_on_ranks(ranks, _hf_on_ranks, *args, str(tmp_path / "resident"), recipe, "off")
    streamed = run_on_ranks(ranks, _hf_on_ranks, *args, str(tmp_path / "streamed"), recipe, "on")
    assert streamed == resident
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")


INT4_GROUPS = """name = "int4-groups"
[weight]
format = "int4"
granularity = "group"
group_size = 16
observer = "max"
"""


def _fused_stores(model_dir: str, data: str, out: str, recipe: str, stream: str, sqnr_tokens: int) -> int:
    """A transformers-class run; how many fused expert projections had their weights stored fake-quantized."""
    from shardcal.calib import layer_calibration

    original, stored = layer_calibration.store_quantized_weights, []
    layer_calibration.store_quantized_weights = lambda module: stored.append(original(module)) or stored[-1]
    try:
        pipeline_calibrate.calibrate_to_checkpoint(
            model_dir, out, recipe, data=data, stream=stream, model_impl="transformers",
            options=CalibrationOptions(batch_size=4, sqnr_tokens=sqnr_tokens),
        )  # fmt: skip
    finally:
        layer_calibration.store_quantized_weights = original
    return sum(stored)


@pytest.mark.parametrize("recipe", ["fp8", "int4-groups"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_streamed_layer_that_never_runs_quantized_keeps_its_experts_weights_as_read(tmp_path, recipe, ranks):
    """DeepSeek-V3's fused experts, no SQNR sample and nothing propagated quantized: streamed, no layer runs
    quantized after its weights are calibrated and none stays in memory, so their weights are not fake-quantized
    (the export encodes them as read) — the resident run, whose model stays quantized, stores them; both give the
    same files. With the SQNR sample, the streamed run stores them too."""
    pytest.importorskip("transformers")
    model_dir = _hf_checkpoint(tmp_path, "deepseek_v3")
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(3).integers(0, 250, size=(4, 16)))
    if recipe == "int4-groups":
        (tmp_path / "int4.toml").write_text(INT4_GROUPS)
        recipe = str(tmp_path / "int4.toml")
    args = (str(model_dir), str(data))
    resident = run_on_ranks(ranks, _fused_stores, *args, str(tmp_path / "resident"), recipe, "off", 0)
    streamed = run_on_ranks(ranks, _fused_stores, *args, str(tmp_path / "streamed"), recipe, "on", 0)
    sampled = run_on_ranks(ranks, _fused_stores, *args, str(tmp_path / "sampled"), recipe, "on", 64)
    assert min(resident) > 0 and streamed == [0] * ranks and sampled[0] == resident[0]
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")


def _hf_resumable(model_dir: str, data: str, out: str, recipe: str, ckpt: str, kill_after: int | None) -> dict:
    """A streamed transformers-class run with a checkpoint directory; with ``kill_after``, the last rank SIGKILLs
    itself once that many layers are committed (a real signal: nothing of the run's own cleanup runs there)."""
    import os
    import signal

    import torch.distributed as dist

    def kill(completed_layers: int) -> None:
        if completed_layers == kill_after and dist.get_rank() == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    options = CalibrationOptions(checkpoint_dir=ckpt, batch_size=4)
    with armed("calibrate.committed", kill):
        result = pipeline_calibrate.calibrate_to_checkpoint(
            model_dir, out, recipe, data=data, stream="on", options=options, model_impl="transformers"
        )
    return {"resumed": result.report.resumed_from_layer, "sqnr": [x.sqnr_db for x in result.report.layers]}


@pytest.mark.parametrize(
    ("recipe", "resumed_on"), [("fp8", 1), ("fp8-dynamic-gptq", 2)], ids=["observers-then-1", "gptq-then-2"]
)
def test_a_sigkilled_transformers_class_stream_resumes(tmp_path, recipe, resumed_on):
    """DeepSeek-V3's class (MLA, shared and routed experts, a router's correction bias) streamed on 2 ranks, one rank
    SIGKILLed after 3 of 5 layers are committed: the run fails naming the signal and leaves no export; resumed
    streamed — on 1 rank where the statistics merge exactly in any order (observers' ranges), on 2 where GPTQ changes
    the weights (a Hessian summed over another rank count differs in its last bits) — it reads the committed layers
    in again and ends with the uninterrupted resident 2-rank run's export, tensor for tensor."""
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    from shardcal.errors import DistributedError
    from shardcal.runtime.launcher import launch

    model_dir = tmp_path / "deepseek_v3"
    hf_model("deepseek_v3", num_hidden_layers=5).save_pretrained(model_dir)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(5).integers(0, 250, size=(8, 16)))
    args = (str(model_dir), str(data))
    (tmp_path / "run").mkdir()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "run" / "out")
    with pytest.raises(DistributedError, match="killed by signal 9"):
        launch(_hf_resumable, 2, *args, out, recipe, ckpt, 3)
    assert _leftovers(tmp_path / "run") == []
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["completed_layers"] == 3
    got = run_on_ranks(resumed_on, _hf_resumable, *args, out, recipe, ckpt, None)[0]
    want = run_on_ranks(2, _hf_on_ranks, *args, str(tmp_path / "resident"), recipe, "off", batch_size=4)[0]
    assert got["resumed"] == 3 and got["sqnr"] == pytest.approx(want, rel=1e-8)  # SQNR sums in rank order
    assert _tensors(tmp_path / "run" / "out") == _tensors(tmp_path / "resident")


def _llava_style(root: Path) -> Path:
    """A tiny Llava saved by transformers, its tensors renamed to the layout Llava checkpoints are published in
    (``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.lm_head``)."""
    from safetensors.torch import load_file, save_file

    folder = _hf_checkpoint(root, "llava")
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))  # fmt: skip
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key, value in load_file(str(file)).items():
            new = next((new + key[len(old) :] for old, new in renames if key.startswith(old)), key)
            tensors[new] = value
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_vlm_in_its_published_layout_streams_to_its_resident_export(tmp_path, ranks):
    """A Llava checkpoint in its published layout (every module's name differs from its key): the sharded root —
    embeddings, LM head, vision tower — read by each rank from the keys it is stored under, the decoder layers
    streamed; the resident run's export and SQNRs."""
    pytest.importorskip("transformers")
    model_dir = _llava_style(tmp_path)
    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(3).integers(0, 250, size=(4, 16)))
    args = (str(model_dir), str(data))
    resident = run_on_ranks(ranks, _hf_on_ranks, *args, str(tmp_path / "resident"), "fp8", "off")
    streamed = run_on_ranks(ranks, _hf_on_ranks, *args, str(tmp_path / "streamed"), "fp8", "on")
    assert streamed == resident
    assert _files(tmp_path / "streamed") == _files(tmp_path / "resident")


def test_a_transformers_class_streams_in_the_dtype_asked_for(tmp_path):
    """``load_streamed(..., impl="transformers", dtype=)`` casts every floating parameter, as the resident load does
    (the root as loaded, the decoder layers as they will be read); without ``dtype`` the class's own float32 stays."""
    pytest.importorskip("transformers")
    import torch

    from shardcal.loading.streamed import load_streamed
    from shardcal.runtime.distributed import init_distributed

    init_distributed()
    model_dir = _hf_checkpoint(tmp_path, "llama")
    for dtype, want in ((torch.bfloat16, torch.bfloat16), ("float16", torch.float16), (None, torch.float32)):
        model = load_streamed(model_dir, impl="transformers", dtype=dtype)
        assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {want}, dtype


def _loaded_dtypes(model_dir: str, dtype: str) -> dict[str, set[str]]:
    """The floating dtypes of transformers' llama loaded resident and streamed with ``dtype``, and what the planner
    holds it in."""
    from shardcal.loading.foreign import load_transformers_sharded
    from shardcal.loading.streamed import load_streamed
    from shardcal.plan.source import read_source

    def floating(model) -> set[str]:
        return {str(p.dtype) for p in model.parameters() if p.is_floating_point()}

    planned = read_source(model_dir, dtype=dtype, impl="transformers").model_structure().model
    return {
        "resident": floating(load_transformers_sharded(model_dir, dtype=dtype)),
        "streamed": floating(load_streamed(model_dir, impl="transformers", dtype=dtype)),
        "planned": floating(planned),
    }


def test_auto_is_the_checkpoints_own_dtype_for_a_transformers_class(tmp_path):
    """``dtype="auto"`` means the checkpoint's dtype (as in transformers), for transformers' classes too: a bf16
    checkpoint loads in bf16 resident, streamed and in the plan — not in float32."""
    pytest.importorskip("transformers")
    import torch
    from _hf_models import hf_model

    folder = tmp_path / "llama-bf16"
    hf_model("llama").to(torch.bfloat16).save_pretrained(folder)
    got = run_on_ranks(1, _loaded_dtypes, str(folder), "auto")[0]
    assert got == {"resident": {"torch.bfloat16"}, "streamed": {"torch.bfloat16"}, "planned": {"torch.bfloat16"}}
