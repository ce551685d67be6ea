"""``shardcal.calibrate_to_checkpoint``: the library call gives what ``shardcal calibrate`` gives (every exported byte,
the report up to timings, on one rank and on two), what the primitives composed by hand give, and refuses before
loading anything what the command refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_tokenizer import byte_level_tokenizer_json

import shardcal
from shardcal.cli import calibrate_command
from shardcal.cli import main as cli
from shardcal.errors import ConfigError, ExportError, TokenizerError
from shardcal.layerwise.options import CalibrationOptions
from shardcal.models.checkpoint import CheckpointReader
from shardcal.pipeline import calibrate as pipeline_calibrate

from _dist import run_on_ranks
from _tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "w8a8-int8"
#: Written beside the export by rank 0; its PNG bytes depend on the matplotlib build, so only its presence counts.
PLOT = "calibration_sqnr.png"
REPORT = "calibration_report.json"


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    model_dir = make_tiny_checkpoint(root, "llama", seed=3)
    ids = np.random.default_rng(0).integers(0, 256, size=(6, 16))
    np.save(root / "ids.npy", ids)
    return model_dir, root / "ids.npy"


def _files(folder: Path) -> dict[str, bytes]:
    """Every file of an export, by name; the report's timings and the plot's bytes left out (and so the report's
    size and digest in the export's manifest)."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in (PLOT, REPORT)}
    manifest = json.loads(files.pop("shardcal_export.json"))
    assert REPORT in manifest["files"] and REPORT in manifest["sha256"]
    manifest["files"][REPORT] = manifest["sha256"][REPORT] = None
    return {**files, "shardcal_export.json": manifest}


def _untimed(value):
    """A report dict without its ``seconds`` fields (wall-clock times differ from run to run)."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _report(folder: Path) -> dict:
    import json

    return _untimed(json.loads((folder / REPORT).read_text()))


def _cli_argv(model_dir: Path, data: Path, out: Path) -> list[str]:
    argv = ["calibrate", model_dir, "--recipe", RECIPE, "--data", data, "--batch-size", 2, "--num-samples", 6]
    return [str(a) for a in [*argv, "--out", out]]


def _library(model_dir: Path, data: Path, out: Path, **kwargs) -> shardcal.PipelineResult:
    return shardcal.calibrate_to_checkpoint(
        model_dir,
        out,
        RECIPE,
        data=data,
        num_samples=6,
        options=CalibrationOptions(batch_size=2, progress=False),
        **kwargs,
    )


@pytest.mark.usefixtures("single_process_group")
def test_one_rank_library_call_equals_the_command_and_the_primitives(model_and_data, tmp_path, capsys):
    """On one rank: the library call's export is byte for byte the CLI's and that of load_pretrained + calibrate +
    export_checkpoint composed by hand (the independent reference); the reports agree up to timings."""
    from shardcal.calib.runner import calibrate
    from shardcal.data.token_data import load_token_data
    from shardcal.export import export_checkpoint
    from shardcal.loading.sharded import load_pretrained

    model_dir, data = model_and_data
    assert cli.main(_cli_argv(model_dir, data, tmp_path / "cli")) == 0
    printed = capsys.readouterr().out
    result = _library(model_dir, data, tmp_path / "lib")
    model = load_pretrained(model_dir)
    report = calibrate(model, load_token_data(data), RECIPE, batch_size=2, progress=False)
    export_checkpoint(model, tmp_path / "ref", recipe=RECIPE, report=report, tokenizer_dir=model_dir, source=model_dir)

    assert _files(tmp_path / "lib") == _files(tmp_path / "cli") == _files(tmp_path / "ref")
    assert _report(tmp_path / "lib") == _report(tmp_path / "cli") == _report(tmp_path / "ref")
    assert _untimed(result.report.to_dict()) == _report(tmp_path / "lib")
    assert (result.out_dir, result.rank, result.world_size) == (tmp_path / "lib", 0, 1)
    assert result.data_shape == (6, 16) and result.data_source == str(data) and result.recipe.name == RECIPE
    assert len(result.peak_memory_mb) == 1 and result.peak_memory_mb[0] > 0
    assert result.plot == (tmp_path / "lib" / PLOT if (tmp_path / "cli" / PLOT).exists() else None)
    said = (
        "\n".join(calibrate_command.calibrate_summary(result)) + "\n"
    )  # what the command prints for it, up to times and paths
    assert _masked(said, tmp_path / "lib") == _masked(printed, tmp_path / "cli")
    assert "calibrated 2 layers on 6 x 16 tokens of " in said and "over 1 rank(s)" in said
    phases = result.phases
    assert min(phases.load, phases.calibration, phases.export) > 0
    assert result.wall_seconds > phases.load + phases.calibration + phases.export
    assert result.seconds == phases.load + phases.calibration
    assert (
        f"in {result.wall_seconds:.1f} s (load {phases.load:.1f} s, calibration {phases.calibration:.1f} s, "
        f"export {phases.export:.1f} s); mean layer SQNR " in said
    )


@pytest.mark.usefixtures("single_process_group")
def test_unquantized_tensors_are_exported_in_the_checkpoints_dtype(tmp_path, capsys):
    """A bf16 checkpoint's export stores its unquantized tensors (embeddings, norms, head) in bf16 and a float32
    one's in float32 (``--export-dtype auto``), whatever dtype the model was calibrated in; ``--export-dtype``
    chooses another, config.json says which, and the quantized tensors are the same bytes either way."""
    from safetensors.torch import load_file

    data = tmp_path / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, 256, size=(6, 16)))

    def export(model_dir: Path, out: str, *flags: str) -> tuple[dict, dict]:
        argv = ["calibrate", model_dir, "--recipe", RECIPE, "--data", data, "--batch-size", 2, "--out", tmp_path / out]
        assert cli.main([str(a) for a in [*argv, *flags]]) == 0, capsys.readouterr().err
        tensors = {}
        for file in sorted((tmp_path / out).glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        return tensors, json.loads((tmp_path / out / "config.json").read_text())

    f32 = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    bf16 = make_tiny_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, seed=3)
    plain, config = export(f32, "auto")
    as_bf16, config_bf16 = export(f32, "bf16", "--export-dtype", "bfloat16")
    from_bf16, config_from_bf16 = export(bf16, "from-bf16")
    assert (
        config["torch_dtype"] == "float32"
        and config_bf16["torch_dtype"] == config_from_bf16["torch_dtype"] == "bfloat16"
    )
    unquantized = [k for k, v in plain.items() if v.dtype == torch.float32 and not k.endswith("_scale")]
    assert "model.embed_tokens.weight" in unquantized and "model.norm.weight" in unquantized
    for key, value in plain.items():
        if key in unquantized:
            assert as_bf16[key].dtype == from_bf16[key].dtype == torch.bfloat16, key
            assert torch.equal(as_bf16[key], value.to(torch.bfloat16)), key
        else:  # weights, scales: what the calibration gave, in the format's own dtypes
            assert torch.equal(as_bf16[key], value) and as_bf16[key].dtype == value.dtype, key
    capsys.readouterr()
    assert cli.main([str(a) for a in ["calibrate", f32, "--recipe", RECIPE, "--data", data, "--out", tmp_path / "x",
                                      "--export-dtype", "int8"]]) == 2  # fmt: skip
    assert capsys.readouterr().err == (
        "error: --export-dtype 'int8': unquantized tensors are stored as bfloat16, float16, float32\n"
    )


def _masked(text: str, out: Path) -> str:
    import re

    text = re.sub(
        r"in [0-9.]+ s \(load [0-9.]+ s, calibration [0-9.]+ s, export [0-9.]+ s\);",
        "in T s;",
        text.replace(str(out), "OUT"),
    )
    return re.sub(r"peak memory per rank: .*", "peak memory per rank: M", text)


@pytest.mark.usefixtures("single_process_group")
def test_the_growth_reported_is_the_high_water_mark_over_the_baseline_after_imports(
    model_and_data, tmp_path, monkeypatch
):
    """The growth is ``VmHWM`` at the end less ``VmRSS`` when the call began (the high-water mark restarted there),
    the process peak their sum, the plan's figure beside them; the printed line names all three, in MiB."""
    from shardcal.runtime import hostmem

    model_dir, data = model_and_data
    result = _library(model_dir, data, tmp_path / "real")
    (growth,), (base,), (peak,) = result.memory_growth_mib, result.memory_baseline_mib, result.process_peak_mib
    assert 0 < growth and 0 < base and peak == base + growth
    assert peak <= hostmem.peak_rss_bytes() / 2**20  # the mark only rises after its restart at the baseline
    assert result.planned_growth_mib is not None and result.planned_growth_mib[0] > 0

    resets = []
    monkeypatch.setattr(hostmem, "rss_bytes", lambda: 300 << 20)  # the size when the call begins
    monkeypatch.setattr(hostmem, "peak_rss_bytes", lambda: 384 << 20)  # the high-water mark at the end
    monkeypatch.setattr(hostmem, "reset_peak_rss", lambda: resets.append(1) or True)
    result = _library(model_dir, data, tmp_path / "fake")
    assert resets and result.memory_growth_mib == [84.0] and result.memory_baseline_mib == [300.0]
    planned = result.planned_growth_mib[0]
    line = calibrate_command.memory_summary(result)
    assert line == f"peak memory per rank: growth 84 MiB (planned {planned:.0f} MiB), process peak 384 MiB"
    assert line in calibrate_command.calibrate_summary(result)


def _on_rank(model_dir: str, data: str, out: str, via: str) -> dict:
    if via == "cli":
        assert cli.main(_cli_argv(Path(model_dir), Path(data), Path(out))) == 0
        return {}
    result = _library(Path(model_dir), Path(data), Path(out))
    return {"rank": result.rank, "world": result.world_size, "peaks": len(result.peak_memory_mb)}


def test_two_rank_library_call_equals_the_command(model_and_data, tmp_path):
    """On two ranks (a gloo group, as torchrun starts them): the same files, byte for byte, and the same report."""
    model_dir, data = (str(p) for p in model_and_data)
    run_on_ranks(2, _on_rank, model_dir, data, str(tmp_path / "cli"), "cli")
    got = run_on_ranks(2, _on_rank, model_dir, data, str(tmp_path / "lib"), "lib")
    assert got == [{"rank": 0, "world": 2, "peaks": 2}, {"rank": 1, "world": 2, "peaks": 2}]
    files = _files(tmp_path / "lib")
    assert sum(name.endswith(".safetensors") for name in files) == 2  # each rank wrote its own shard
    assert files == _files(tmp_path / "cli")
    assert _report(tmp_path / "lib") == _report(tmp_path / "cli")


@pytest.mark.usefixtures("single_process_group")
def test_the_calibration_checkpoint_is_removed_unless_kept(model_and_data, tmp_path):
    model_dir, data = model_and_data
    options = CalibrationOptions(batch_size=2, progress=False, checkpoint_dir=tmp_path / "ckpt")
    kept = shardcal.calibrate_to_checkpoint(
        model_dir, tmp_path / "a", RECIPE, data=data, num_samples=6, options=options, keep_checkpoint=True
    )
    assert kept.checkpoint_removed_bytes is None and (tmp_path / "ckpt" / "manifest.json").is_file()
    removed = shardcal.calibrate_to_checkpoint(
        model_dir, tmp_path / "b", RECIPE, data=data, num_samples=6, options=options
    )
    assert removed.checkpoint_removed_bytes > 0 and not (tmp_path / "ckpt").exists()
    assert removed.checkpoint_dir == tmp_path / "ckpt"
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_no_directory_the_run_created_is_left_empty(model_and_data, tmp_path):
    """A checkpoint directory two levels below what exists: once it is removed after the export, so are the parents
    the run created for it; a failed export leaves none of the parents it created for ``out_dir``; a directory that
    existed before, or holds anything, stays."""
    from _injected import ExportInterrupted, fail_export_at

    model_dir, data = model_and_data
    (tmp_path / "runs").mkdir()
    options = CalibrationOptions(batch_size=2, progress=False, checkpoint_dir=tmp_path / "runs" / "a" / "b" / "ckpt")
    shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "out", RECIPE, data=data, num_samples=6, options=options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs"] and list((tmp_path / "runs").iterdir()) == []
    (tmp_path / "runs" / "a").mkdir()
    (tmp_path / "runs" / "a" / "notes.txt").write_text("mine")
    shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "out2", RECIPE, data=data, num_samples=6, options=options)
    assert [p.name for p in (tmp_path / "runs" / "a").iterdir()] == ["notes.txt"]
    with pytest.raises(ExportInterrupted), fail_export_at(1):
        shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "x" / "y" / "out", RECIPE, data=data, num_samples=6)
    assert not (tmp_path / "x").exists()


def test_each_phase_is_timed_on_its_own(model_and_data, tmp_path, monkeypatch):
    """Calibration made 1 s longer and the export 0.5 s longer (by the test): each phase's time grows by that, and
    neither counts the other's."""
    import time as clock

    model_dir, data = model_and_data
    real_calibrate, real_export = pipeline_calibrate.calibrate, pipeline_calibrate.export_checkpoint

    def slow(real, seconds):
        def call(*args, **kwargs):
            clock.sleep(seconds)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(pipeline_calibrate, "calibrate", slow(real_calibrate, 1.0))
    monkeypatch.setattr(pipeline_calibrate, "export_checkpoint", slow(real_export, 0.5))
    result = shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "out", RECIPE, data=data, num_samples=6)
    phases = result.phases
    assert 1.0 <= phases.calibration < 1.0 + 0.5 * phases.calibration
    assert 0.5 <= phases.export < 1.0 and phases.load < 1.0


@pytest.fixture
def nothing_read(monkeypatch) -> list[str]:
    """What the run read: the data, or any tensor of the checkpoint (headers are fine)."""
    touched: list[str] = []
    monkeypatch.setattr(pipeline_calibrate, "read_token_data", lambda *a, **k: touched.append("data"))
    monkeypatch.setattr(CheckpointReader, "get", lambda *a, **k: touched.append("tensor"))
    monkeypatch.setattr(CheckpointReader, "get_rows", lambda *a, **k: touched.append("tensor"))
    return touched


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {},
            ExportError,
            "{out}: holds 'keep.txt', which shardcal did not write; overwrite=True replaces only an earlier shardcal "
            "output or an empty directory, so choose another output directory",
        ),
        (
            {"overwrite": True},
            ExportError,
            "{out}: holds 'keep.txt', which shardcal did not write; overwrite=True replaces only an earlier shardcal "
            "output or an empty directory, so choose another output directory",
        ),
        ({"format": "gguf"}, ExportError, "format 'gguf': unknown export format (known: compressed-tensors)"),
        ({"model_impl": "mine"}, ConfigError, "model_impl must be one of auto, shardcal, transformers, got 'mine'"),
        (
            {"overwrite": True, "out": "model"},
            ExportError,
            "out_dir {model} is the model directory {model}; write it elsewhere (refused even when overwriting is "
            "allowed)",
        ),
    ],
)
def test_pre_checks_refuse_before_anything_is_read(model_and_data, tmp_path, nothing_read, kwargs, error, message):
    """An existing export without overwrite, an unknown format or model class, an output over an input: refused
    with the parameter's name before the data or any weight is read; the existing export is left as it was."""
    model_dir, data = model_and_data
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    target = model_dir if kwargs.pop("out", None) == "model" else out
    with pytest.raises(error) as info:
        _library(model_dir, data, target, **kwargs)
    assert str(info.value) == message.format(out=out, model=model_dir)
    assert nothing_read == [] and (out / "keep.txt").read_text() == "mine"


@pytest.mark.usefixtures("single_process_group")
def test_the_command_names_its_flags_in_the_same_refusals(model_and_data, tmp_path, nothing_read, capsys):
    model_dir, data = model_and_data
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    argv = _cli_argv(model_dir, data, tmp_path / "out")
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'out'}: holds 'keep.txt', which shardcal did not write; --overwrite replaces only an "
        "earlier shardcal output or an empty directory, so choose another output directory\n"
    )
    assert cli.main([*argv, "--overwrite", "--format", "gguf"]) == 2
    assert capsys.readouterr().err == "error: --format 'gguf': unknown export format (known: compressed-tensors)\n"
    assert nothing_read == []


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("data", [None, "docs.jsonl"], ids=["default-text", "jsonl"])
def test_an_unsupported_tokenizer_is_refused_before_anything_is_read(model_and_data, tmp_path, nothing_read, data):
    """Text data (the default summaries, a .jsonl) needs the model's tokenizer.json: one whose normalizer shardcal
    cannot run is refused by the pre-checks, naming the file and the field, before data or weights are read."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(model_and_data[0], model_dir)
    tokenizer = dict(byte_level_tokenizer_json(), normalizer={"type": "Foo"})
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    path = None if data is None else tmp_path / data
    if path is not None:
        path.write_text('{"text": "hello"}\n')
    with pytest.raises(TokenizerError) as info:
        shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "out", RECIPE, data=path)
    assert str(info.value).startswith(f"{model_dir / 'tokenizer.json'}: field 'normalizer': normalizer type 'Foo'")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="model: no tokenizer.json"):
        shardcal.calibrate_to_checkpoint(model_dir, tmp_path / "out", RECIPE, data=path)
    assert nothing_read == []


@pytest.mark.usefixtures("single_process_group")
def test_a_skipped_memory_check_is_said(model_and_data, tmp_path, monkeypatch):
    """When the planner cannot model the run, calibration goes on and a warning says the check was skipped."""
    from shardcal.errors import PlanError
    from shardcal.plan import planner

    def cannot(model_dir, impl="auto"):
        raise PlanError(f"{model_dir}: no decoder layers the planner can find")

    monkeypatch.setattr(planner, "check_plannable", cannot)
    with pytest.warns(UserWarning, match="the memory check before loading was skipped: .*no decoder layers"):
        _library(*model_and_data, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
