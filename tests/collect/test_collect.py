"""Activation collection against independent references: plain torch hooks on the unsharded model's own forward.

Statistics (absmax exact, mean / meansq to float tolerance, histograms exact) and raw activations read back through
ActivationDataset, on 1 and 2 real gloo ranks (bit-identical); resume after an interrupt on any number of ranks (killed
commits, failed writes, another run's checkpoint); one-line errors for bad targets with nothing written; transformers' classes; what calibrate takes from a collected report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardcal import ActivationDataset, ActivationReport, collect_activations
from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import CalibrationCheckpointError, CollectionError
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant.session import iter_quantizers
from shardcal.runtime.faults import armed
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

LLAMA = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
MOE = dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=2)
TARGETS = [
    "model.layers.*:output",
    "model.layers.*.mlp.down_proj:input",
    "model.layers.*.input_layernorm:output",
    "model.layers.0:input",
]
ROWS = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 7, 10, 12, 5, 9, 11)]
BATCH = 3
BINS = 64


class Interrupted(RuntimeError):
    pass


def _model(cfg: dict = LLAMA, seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=seed)
    with torch.no_grad():  # one outlier channel in the residual stream, as real models have
        model.model.embed_tokens.weight[:, 5] *= 40.0
    return model.eval()


def _data() -> list[dict]:
    """The rows in batches of ``BATCH``, right-padded with a token whose embedding is huge (it must never count)."""
    out = []
    for s in range(0, len(ROWS), BATCH):
        chunk = ROWS[s : s + BATCH]
        length = max(r.numel() for r in chunk)
        ids = torch.full((len(chunk), length), 255, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, : r.numel()], mask[i, : r.numel()] = r, 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


# ------------------------------------------------------------ the reference: hooks on the model's own forward
def _reference_rows(
    model: nn.Module, data: list[dict], names: list[str], mask: bool = True
) -> dict[str, list[torch.Tensor]]:
    """Per target, per sample: the real tokens' rows of what the module saw / returned in ``model(ids, mask)``
    (``model(ids)`` without ``mask``)."""
    modules = dict(model.named_modules())
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    current: dict[str, torch.Tensor] = {}

    def keep(name: str, x: torch.Tensor) -> None:
        mask = current["mask"].bool()
        for row in range(x.shape[0]):
            seen[name].append(x[row][mask[row]].detach().clone())

    hooks = []
    for name in names:
        module, _, tensor = name.rpartition(":")
        if tensor == "input":
            hooks.append(modules[module].register_forward_pre_hook(lambda m, a, name=name: keep(name, a[0])))
        else:
            out = lambda m, a, o, name=name: keep(name, o[0] if isinstance(o, tuple) else o)
            hooks.append(modules[module].register_forward_hook(out))
    with torch.no_grad():
        for batch in data:
            current["mask"] = batch["attention_mask"]
            model(batch["input_ids"], **({"attention_mask": batch["attention_mask"]} if mask else {}))
    for h in hooks:
        h.remove()
    return seen


def _reference_stats(rows: list[torch.Tensor], bins: int = BINS) -> dict[str, torch.Tensor]:
    x = torch.cat(rows)
    absmax = x.abs().amax(dim=0).float()
    top = absmax.max()
    index = torch.clamp(torch.floor(x.abs().float() / top * bins), 0, bins - 1).long()
    return {
        "absmax": absmax,
        "mean": x.double().mean(dim=0),
        "meansq": x.double().square().mean(dim=0),
        "histogram": torch.bincount(index.reshape(-1), minlength=bins),
        "tokens": torch.tensor(x.shape[0]),
    }


def _stats_of(report: ActivationReport) -> dict[str, dict[str, torch.Tensor]]:
    return {
        n: {"absmax": t.absmax, "mean": t.mean, "meansq": t.meansq, "histogram": t.histogram, "tokens": t.tokens}
        for n, t in report.targets.items()
    }


# ------------------------------------------------------------ runs on ranks
def _collect_run(save_dir: str | None, wrap: bool, checkpoint_dir: str | None = None, stop_at: int | None = None):
    model = _model()
    if wrap:
        fsdp2_wrap(model)

    def stop(completed_layers: int) -> None:
        if completed_layers == stop_at:
            raise Interrupted(f"stopped after {completed_layers} layers")

    try:
        with armed("collect.committed", stop):
            report = collect_activations(
                model, _data(), TARGETS, save_dir=save_dir, batch_size=BATCH, bins=BINS, top_k=3,
                checkpoint_dir=checkpoint_dir, progress=False,
            )  # fmt: skip
    except Interrupted:
        return None
    return {"stats": _stats_of(report), "top": {n: t.top_channels for n, t in report.targets.items()}, "report": report}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix == ".safetensors"}


def test_statistics_and_raw_activations_equal_the_plain_forward_on_1_and_2_ranks(tmp_path):
    model = _model()
    report = collect_activations(model, _data(), TARGETS, batch_size=BATCH, bins=BINS, progress=False)
    names = list(report.targets)
    assert len(names) == 3 * 3 + 1 and names[0] == "model.layers.0:input"
    rows = _reference_rows(model, _data(), names)
    for name in names:
        want, got = _reference_stats(rows[name]), report[name]
        assert got.tokens == int(want["tokens"]) == sum(r.numel() for r in ROWS), name  # padding never counts
        assert torch.equal(got.absmax, want["absmax"]), name
        assert torch.equal(got.histogram, want["histogram"]), name
        torch.testing.assert_close(got.mean, want["mean"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.meansq, want["meansq"], rtol=1e-5, atol=1e-7)
        assert got.top_channels[0][0] == int(want["absmax"].argmax())
    assert report["model.layers.0:input"].top_channels[0][0] == 5  # the planted outlier channel
    # the same on 1 and 2 FSDP2 ranks, bit for bit, with raw activations saved
    (single,) = run_on_ranks(1, _collect_run, str(tmp_path / "one"), True)
    double = run_on_ranks(2, _collect_run, str(tmp_path / "two"), True)
    for result in (single, *double):
        for name in names:
            for stat, value in _stats_of(report)[name].items():
                got = result["stats"][name][stat]
                assert (got == value) if stat == "tokens" else torch.equal(got, value), (name, stat)
        assert result["top"] == double[0]["top"]
    assert _files(tmp_path / "one") == _files(tmp_path / "two")  # batches are global: the same files
    for directory in ("one", "two"):
        ds = ActivationDataset(tmp_path / directory)
        assert len(ds) == len(ROWS) and ds.targets == names and ds.num_tokens == sum(r.numel() for r in ROWS)
        samples = list(ds)
        for name in names:
            for i, want in enumerate(rows[name]):
                assert torch.equal(samples[i][name], want), (directory, name, i)
            assert torch.equal(ds.tokens(name), torch.cat(rows[name]))
        assert torch.equal(ds[4][names[1]], rows[names[1]][4])


def _assert_same(want: dict, got: dict, resumed_from: int | None = 2) -> None:
    if resumed_from is not None:
        assert got["report"].resumed_from_layer == resumed_from
    assert want["stats"].keys() == got["stats"].keys()
    for name in want["stats"]:
        for stat, value in want["stats"][name].items():
            other = got["stats"][name][stat]
            assert (other == value) if stat == "tokens" else torch.equal(other, value), (name, stat)
    assert want["top"] == got["top"]


def _checkpoint_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _listed(directory: Path) -> set[str]:
    return {"collect-manifest.json", *json.loads((directory / "collect-manifest.json").read_text())["files"]}


def test_resume_after_interrupt_gives_the_same_report_and_files_on_any_number_of_ranks(tmp_path):
    full = run_on_ranks(2, _collect_run, str(tmp_path / "a-acts"), True, str(tmp_path / "a-ckpt"))
    assert run_on_ranks(2, _collect_run, str(tmp_path / "b-acts"), True, str(tmp_path / "b-ckpt"), 2) == [None, None]
    manifest = json.loads((tmp_path / "b-ckpt" / "collect-manifest.json").read_text())
    assert manifest["completed_layers"] == 2 and not (tmp_path / "b-acts" / "activations.json").exists()
    assert sorted(manifest["batches"]) == ["0", "1", "2"] and "world_size" not in manifest["fingerprint"]
    for kind in ("acts", "ckpt"):  # the same interrupted run, to resume on 1 rank
        shutil.copytree(tmp_path / f"b-{kind}", tmp_path / f"c-{kind}")
    # what killed commits leave: a temporary, a later commit's inputs and statistics (no manifest lists them)
    ckpt = tmp_path / "b-ckpt"
    for stray in (".inputs-L00002-B000001.safetensors.x1y2", "inputs-L00003-B000000.safetensors", "stats-L00002.safetensors",
                  ".collect-manifest.json.a7b8"):  # fmt: skip
        (ckpt / stray).write_bytes(b"left by a killed commit")
    (ckpt / "notes.txt").write_text("not the checkpoint's")
    resumed = run_on_ranks(2, _collect_run, str(tmp_path / "b-acts"), True, str(ckpt))
    assert _checkpoint_files(ckpt) == _listed(ckpt) | {"notes.txt"}
    assert not any(n.startswith("inputs-") for n in _checkpoint_files(ckpt))  # finished: no inputs are kept
    resumed += run_on_ranks(1, _collect_run, str(tmp_path / "c-acts"), True, str(tmp_path / "c-ckpt"))
    # and the other way round: interrupted on 1 rank, resumed on 2
    assert run_on_ranks(1, _collect_run, str(tmp_path / "d-acts"), True, str(tmp_path / "d-ckpt"), 2) == [None]
    resumed += run_on_ranks(2, _collect_run, str(tmp_path / "d-acts"), True, str(tmp_path / "d-ckpt"))
    for want, got in zip(full + full[:1] + full, resumed):
        _assert_same(want, got)
    runs = ("a-acts", "b-acts", "c-acts", "d-acts")
    assert all(_files(tmp_path / "a-acts") == _files(tmp_path / d) for d in runs)
    manifests = [json.loads((tmp_path / d / "activations.json").read_text()) for d in runs]
    assert all(m == manifests[0] for m in manifests)
    again = run_on_ranks(2, _collect_run, str(tmp_path / "b-acts"), True, str(ckpt))  # finished
    assert again[0]["report"].resumed_from_layer == 3 and again[0]["top"] == full[0]["top"]
    assert _files(tmp_path / "a-acts") == _files(tmp_path / "b-acts")
    # another run's checkpoint is refused naming what differs, before anything runs
    cases = [
        (dict(bins=32), "another run (different histogram bins: checkpoint 64, this run 32)"),
        (dict(batch_size=2), "different data or batch size"),
        (dict(targets=TARGETS[:2]), "different targets"),
        (dict(stats=("absmax",)), "different statistics"),
        (dict(save_dir=None), "different raw activations"),
    ]
    for change, message in cases:
        args = dict(targets=TARGETS, save_dir=tmp_path / "e-acts", batch_size=BATCH, bins=BINS, top_k=3) | change
        with pytest.raises(CalibrationCheckpointError) as info:
            collect_activations(_model(), _data(), args.pop("targets"), checkpoint_dir=ckpt, progress=False, **args)
        assert message in str(info.value) and "collect-manifest.json" in str(info.value), str(info.value)
    assert not (tmp_path / "e-acts").exists()


def _stop_at(where: str, commits: int):
    """A ``collect.commit`` action raising at the ``commits``-th time the commit reaches step ``where``."""
    seen = []

    def stop(step: str, rank: int) -> None:
        seen.append(step)
        if step == where and seen.count(where) == commits:
            raise Interrupted(step)

    return stop


def test_a_commit_killed_midway_resumes_exactly(tmp_path):
    """In one process: a commit stopped after writing its inputs (no manifest yet), or after the manifest (the older
    files not yet removed), resumes to the uninterrupted result and leaves only what the manifest lists."""
    want = collect_activations(_model(), _data(), TARGETS, batch_size=BATCH, bins=BINS, top_k=3, progress=False)
    want = {"stats": _stats_of(want), "top": {n: t.top_channels for n, t in want.targets.items()}}
    for step, commits, resumed_from in (("inputs written", 2, 1), ("manifest written", 2, 2), ("inputs written", 1, 0)):
        ckpt = tmp_path / f"{step.split()[0]}-{commits}"
        with armed("collect.commit", _stop_at(step, commits)), pytest.raises(Interrupted):
            collect_activations(_model(), _data(), TARGETS, batch_size=BATCH, bins=BINS, top_k=3, checkpoint_dir=ckpt,
                                progress=False)  # fmt: skip
        names = _checkpoint_files(ckpt)
        if step == "manifest written":
            assert any(n.startswith("inputs-L00001") for n in names) and names > _listed(ckpt)
        got = collect_activations(_model(), _data(), TARGETS, batch_size=BATCH, bins=BINS, top_k=3,
                                  checkpoint_dir=ckpt, progress=False)  # fmt: skip
        _assert_same(want, {"stats": _stats_of(got), "top": {n: t.top_channels for n, t in got.targets.items()}, "report": got},
                     resumed_from)  # fmt: skip
        assert _checkpoint_files(ckpt) == _listed(ckpt), step


def test_a_failed_checkpoint_write_stops_with_the_error_and_keeps_the_previous_commit(tmp_path, monkeypatch):
    import errno

    from shardcal.layerwise import layer_checkpoint as collect_checkpoint  # where every checkpoint file is written

    real, calls = collect_checkpoint.save_file, []

    def full_disk(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 6:  # the second commit: after its first batch (3 batches, then layer 0's statistics)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(collect_checkpoint, "save_file", full_disk)
    with pytest.raises(CalibrationCheckpointError, match="cannot write the checkpoint .*No space left on device"):
        collect_activations(_model(), _data(), TARGETS, batch_size=BATCH, bins=BINS, checkpoint_dir=tmp_path,
                            progress=False)  # fmt: skip
    manifest = json.loads((tmp_path / "collect-manifest.json").read_text())
    assert manifest["completed_layers"] == 1 and _checkpoint_files(tmp_path) == _listed(tmp_path)
    monkeypatch.setattr(collect_checkpoint, "save_file", real)
    got = collect_activations(_model(), _data(), TARGETS, batch_size=BATCH, bins=BINS, checkpoint_dir=tmp_path,
                              progress=False)  # fmt: skip
    assert got.resumed_from_layer == 1


def _rank_without_batches() -> tuple[dict, list[str]]:
    import warnings

    model = _model()
    fsdp2_wrap(model)
    data = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = collect_activations(model, data, "model.layers.*.mlp.down_proj:input", batch_size=4, progress=False)
    return _stats_of(report), [str(w.message) for w in caught if "get none" in str(w.message)]


def test_a_rank_without_batches_takes_every_merge_and_one_warning():
    ((single, quiet),) = run_on_ranks(1, _rank_without_batches)
    assert quiet == []
    results = run_on_ranks(2, _rank_without_batches)  # one batch: rank 1 has none
    assert [r[1] for r in results] == [
        [
            "1 batch(es) of up to 4 sequences for 2 ranks: rank(s) 1 get none and only take part in the gathers (a "
            "smaller batch size, or more samples, gives every rank work)"
        ],
        [],
    ]
    for result, _ in results:
        for name, stats in single.items():
            assert all(
                (v == result[name][k]) if k == "tokens" else torch.equal(v, result[name][k]) for k, v in stats.items()
            )


# ------------------------------------------------------------ bad input
def test_bad_targets_are_one_line_errors_naming_the_pattern_and_nothing_is_written(tmp_path):
    model = _model()
    for layer in model.model.layers:
        layer.unused = nn.Linear(64, 64)  # a module the forward never runs
    out, ckpt = tmp_path / "acts", tmp_path / "ckpt"
    cases = [
        ("model.layers.*.mlp.nothing:input", "matches no module"),
        ("model.layers.*:weights", "unknown tensor selector ':weights'"),
        ("model.norm:output", "outside the decoder layers"),
        ("model.layers.*.unused:input", "model.layers.0.unused never ran in the model's forward"),
        ("model.layers.*.mlp.act_fn:weight", "unknown tensor selector"),
    ]
    for pattern, message in cases:
        with pytest.raises(CollectionError) as info:
            collect_activations(model, _data(), ["model.layers.*:output", pattern], save_dir=out, checkpoint_dir=ckpt,
                                batch_size=BATCH, progress=False)  # fmt: skip
        text = str(info.value)
        assert message in text and repr(pattern) in text and "\n" not in text, text
    with pytest.raises(CollectionError, match="unknown statistic 'median'"):
        collect_activations(model, _data(), "model.layers.*:output", stats=("median",), save_dir=out, progress=False)
    assert not out.exists() and not ckpt.exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(CollectionError, match="holds other files"):
        collect_activations(model, _data(), "model.layers.*:output", save_dir=tmp_path / "taken", progress=False)


def test_moe_experts_see_their_routed_real_tokens_and_cannot_be_saved_raw(tmp_path):
    model = _model(MOE)
    name = "model.layers.1.mlp.experts.2.down_proj:input"
    report = collect_activations(model, _data(), "model.layers.*.mlp.experts.*.down_proj:input", bins=BINS,
                                 batch_size=BATCH, progress=False)  # fmt: skip
    # reference: the expert's routed tokens, real ones only (routing recomputed by the block's own function)
    block, expert = model.model.layers[1].mlp, model.model.layers[1].mlp.experts[2].down_proj
    seen, real = [], {}
    block_hook = block.register_forward_pre_hook(
        lambda m, a: real.update(sel=torch.where(m.route(a[0].reshape(-1, a[0].shape[-1]))[1] == 2)[0])
    )
    hook = expert.register_forward_pre_hook(lambda m, a: seen.append(a[0][real["mask"][real["sel"]]]))
    with torch.no_grad():
        for batch in _data():
            real["mask"] = batch["attention_mask"].reshape(-1).bool()
            model(batch["input_ids"], attention_mask=batch["attention_mask"])
    block_hook.remove()
    hook.remove()
    want = _reference_stats(seen)
    assert report[name].tokens == int(want["tokens"]) > 0
    assert torch.equal(report[name].absmax, want["absmax"]) and torch.equal(report[name].histogram, want["histogram"])
    with pytest.raises(CollectionError, match="cannot save raw activations of .*experts.*routed tokens only"):
        collect_activations(model, _data(), "model.layers.*.mlp.experts.*.down_proj:input", save_dir=tmp_path / "x",
                            progress=False)  # fmt: skip
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------ transformers' classes
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_transformers_models(family, tmp_path):
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    model = hf_model(family)
    data = _data()
    targets = ["model.layers.*:output", "model.layers.*.mlp.down_proj:input", "model.layers.*.self_attn.o_proj:input"]
    report = collect_activations(model, data, targets, bins=BINS, batch_size=BATCH, save_dir=tmp_path, progress=False)
    rows = _reference_rows(model, data, list(report.targets))
    ds = ActivationDataset(tmp_path)
    for name, got in report.targets.items():
        want = _reference_stats(rows[name])
        assert got.tokens == int(want["tokens"]) and torch.equal(got.absmax, want["absmax"]), name
        assert torch.equal(got.histogram, want["histogram"]), name
        torch.testing.assert_close(got.meansq, want["meansq"], rtol=1e-5, atol=1e-7)
        assert torch.equal(ds.tokens(name), torch.cat(rows[name])), name


def test_a_users_own_module():
    """A causal LM of its own layout and call convention (blocks return a tuple), registered with the registry."""
    from _hf_models import register_tiny_lm, tiny_lm

    register_tiny_lm()
    model = tiny_lm()
    ids = torch.randint(0, 64, (5, 10), generator=torch.Generator().manual_seed(4))
    report = collect_activations(model, ids, ["stack.blocks.*:output", "stack.blocks.*.ff_out:input"], bins=BINS,
                                 batch_size=2, progress=False)  # fmt: skip
    data = [{"input_ids": ids[s : s + 2], "attention_mask": torch.ones_like(ids[s : s + 2])} for s in range(0, 5, 2)]
    rows = _reference_rows(model, data, list(report.targets), mask=False)
    assert len(report.targets) == 6
    for name, got in report.targets.items():
        want = _reference_stats(rows[name])
        assert got.tokens == 50 and torch.equal(got.absmax, want["absmax"]), name
        assert torch.equal(got.histogram, want["histogram"]), name


# ------------------------------------------------------------ the report: files, plot; calibrate takes it
def test_report_save_load_and_plot(tmp_path):
    report = collect_activations(_model(), _data(), TARGETS[:2], bins=BINS, batch_size=BATCH, progress=False)
    report.save(tmp_path)
    loaded = ActivationReport.load(tmp_path)
    assert loaded.to_dict() == report.to_dict()
    for name, t in report.targets.items():
        assert all(torch.equal(v, loaded[name].tensors()[k]) for k, v in t.tensors().items())
    saved = json.loads((tmp_path / "activation_report.json").read_text())
    assert saved["targets"][0]["top_channels"][0] == list(report[saved["targets"][0]["name"]].top_channels[0])
    plot = report.save_plot(tmp_path / "activations.png")
    if plot is not None:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_second_pass_histogram_equals_the_kept_rows_and_saved_dtype(tmp_path):
    model = _model()
    kept = collect_activations(model, _data(), TARGETS[:2], bins=BINS, batch_size=BATCH, progress=False)
    rerun = collect_activations(model, _data(), TARGETS[:2], bins=BINS, batch_size=BATCH, progress=False, keep_mb=0)
    assert all(torch.equal(kept[n].histogram, rerun[n].histogram) for n in kept.targets)
    odd = collect_activations(model, _data(), TARGETS[:2], bins=100, batch_size=BATCH, progress=False)  # not 2**k
    rows = _reference_rows(model, _data(), list(odd.targets))
    assert all(torch.equal(odd[n].histogram, _reference_stats(rows[n], bins=100)["histogram"]) for n in odd.targets)
    only = collect_activations(model, _data(), TARGETS[0], stats=(), save_dir=tmp_path, save_dtype="bfloat16",
                               batch_size=BATCH, progress=False)  # fmt: skip
    name = "model.layers.1:output"
    assert only.stats == ["absmax"] and only[name].mean is None and only[name].histogram is None
    assert torch.equal(only[name].absmax, kept[name].absmax)
    ds = ActivationDataset(tmp_path)
    rows = _reference_rows(model, _data(), [name])[name]
    assert ds.dtype == torch.bfloat16 and torch.equal(ds.tokens(name), torch.cat(rows).bfloat16())


PERCENTILE = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\nobserver = { name = "percentile", bins = 64 }\n'


def _amax(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}


def test_calibrate_takes_a_collected_report(tmp_path):
    targets = ["model.layers.*.*.*_proj:input", "model.layers.*.*_layernorm:output"]
    report = collect_activations(_model(), _data(), targets, bins=BINS, batch_size=BATCH, progress=False)
    report.save(tmp_path)
    for recipe in ("w8a8-int8", parse_recipe(PERCENTILE, "percentile.toml")):
        plain, fed = _model(), _model()
        calibrate(plain, _data(), recipe, batch_size=BATCH, progress=False)
        layers = calibrate(fed, _data(), recipe, batch_size=BATCH, progress=False, activation_report=tmp_path).layers
        a, b = _amax(plain), _amax(fed)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to observing
        counts = [{n: q.num_observed for n, q in iter_quantizers(m)} for m in (plain, fed)]
        assert counts[0] == counts[1]
        assert "model.layers.0.mlp.down_proj:input" in layers[0].from_activation_report
        assert len(layers[0].from_activation_report) == 7
    plain, fed = _model(), _model()
    calibrate(plain, _data(), "w8a8-int8-sq", batch_size=BATCH, progress=False)
    layers = calibrate(fed, _data(), "w8a8-int8-sq", batch_size=BATCH, progress=False, activation_report=report).layers
    assert sorted(layers[0].from_activation_report) == sorted(
        f"model.layers.0.{n}" for n in ("input_layernorm:output", "post_attention_layernorm:output",
                                        "self_attn.o_proj:input", "mlp.down_proj:input")
    )  # fmt: skip
    p, f = dict(plain.named_parameters()), dict(fed.named_parameters())
    assert all(torch.equal(p[n], f[n]) for n in p if n.startswith("model.layers.0."))  # layer 0: the same scales
    assert all(torch.allclose(p[n], f[n], rtol=1e-4, atol=1e-6) for n in p)
    # MoE experts: fed when they observe their routed tokens, observed when every expert sees every token
    moe = collect_activations(_model(MOE), _data(), "model.layers.*.mlp.experts.*.*_proj:input", batch_size=BATCH,
                              progress=False)  # fmt: skip
    for all_experts in (False, True):
        plain, fed = _model(MOE), _model(MOE)
        options = dict(batch_size=BATCH, progress=False, calibrate_all_experts=all_experts)
        calibrate(plain, _data(), "w8a8-int8", **options)
        layers = calibrate(fed, _data(), "w8a8-int8", activation_report=moe, **options).layers
        a, b = _amax(plain), _amax(fed)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert len(layers[1].from_activation_report) == (0 if all_experts else 4 * 3)
    cases = [
        (dict(data=_data()[:2]), "different data or batch size"),
        (dict(model=_model(seed=3)), "different model weights"),
        (dict(propagate="qdq"), "propagate='qdq'"),
        (dict(recipe="w4a16"), "uses none of its statistics"),
    ]
    for change, message in cases:
        args = {"model": _model(), "data": _data(), "recipe": "w8a8-int8", **change}
        with pytest.raises(CollectionError, match=message.replace("(", r"\(").replace(")", r"\)")):
            calibrate(args.pop("model"), args.pop("data"), args.pop("recipe"), batch_size=BATCH, progress=False,
                      activation_report=report, **args)  # fmt: skip


# ------------------------------------------------------------ the command


@pytest.mark.usefixtures("single_process_group")
def test_collect_command(tmp_path, capsys):
    """The report equals the library's; a rerun with --checkpoint-dir says it resumes and removes the checkpoint
    after; short data is one warning line; bad input is one error line, before data or weights are loaded (no data
    warning) and before anything is written."""
    import numpy as np

    from shardcal.cli import main as cli
    from shardcal.collect.report import DEFAULT_BINS, DEFAULT_TOP_K
    from shardcal.loading.plain import from_pretrained

    from _tiny_models import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    ids = np.random.default_rng(0).integers(0, 256, (5, 16))
    np.save(tmp_path / "ids.npy", ids)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    argv = ["collect", model_dir, "--targets", "model.layers.*:output", "model.layers.*.mlp.down_proj:input", "--out",
            out, "--data", tmp_path / "ids.npy", "--batch-size", 2, "--bins", 32]  # fmt: skip
    parsed = cli.build_parser().parse_args([str(a) for a in argv[:5]] + ["--out", "o"])
    assert (parsed.bins, parsed.top_k) == (DEFAULT_BINS, DEFAULT_TOP_K)  # the command's defaults are the library's
    with armed("collect.committed", lambda completed_layers: _raise(Interrupted())), pytest.raises(Interrupted):
        cli.main([str(a) for a in [*argv, "--save-activations", "--checkpoint-dir", ckpt]])
    interrupted = capsys.readouterr().err
    warning = f"warning: {tmp_path / 'ids.npy'}: holds 5 samples of 16 tokens, fewer than the 32 asked for"
    assert interrupted.count(warning) == 1 and interrupted.endswith("\n"), interrupted  # the bar closed first
    assert cli.main([str(a) for a in [*argv, "--save-activations", "--checkpoint-dir", ckpt]]) == 0
    captured = capsys.readouterr()
    assert "collected 4 targets in 2 layers on 5 x 16 tokens" in captured.out, captured.err
    assert f"resuming after layer 1 of 2 from {ckpt} (committed " in captured.err
    assert f"removed the collection checkpoint {ckpt} (" in captured.out and not ckpt.exists()
    assert {p.name for p in out.iterdir()} >= {"activation_report.json", "activation_stats.safetensors", "activations"}
    saved = ActivationReport.load(out)
    plain = collect_activations(from_pretrained(model_dir), torch.from_numpy(ids), TARGETS[:2], bins=32,
                                batch_size=2, progress=False)  # fmt: skip
    for name, t in plain.targets.items():
        assert all(torch.equal(v, saved[name].tensors()[k]) for k, v in t.tensors().items()), name
    assert len(ActivationDataset(out / "activations")) == 5
    other = tmp_path / "other"
    cases = [
        (["--out", out], "already holds an activation report"),
        (["--out", other, "--stats", "median"], "--stats: unknown statistic 'median'"),
        (["--out", other, "--bins", 0], "--bins must be an integer >= 1, got 0"),
        (["--out", other, "--top-k", -1], "--top-k must be an integer >= 0, got -1"),
        (["--out", other, "--batch-size", 0], "--batch-size must be an integer >= 1, got 0"),
        (["--out", other, "--targets", "model.layers.*:weights"], "unknown tensor selector ':weights'"),
        (["--out", other, "--targets", "model.layers.*.mlp.nothing:input"], "matches no module of"),  # the skeleton
        (["--out", other, "--targets", "model.norm:output"], "outside the decoder layers"),
        (["--out", model_dir], "--out " + str(model_dir) + " is the model directory"),
        (["--out", other, "--checkpoint-dir", Path(model_dir) / "ckpt"], "lies inside the model directory"),
    ]
    for extra, message in cases:
        status = cli.main([str(a) for a in [*argv[:5], *argv[7:], *extra]])
        err = capsys.readouterr().err
        assert status == 2 and message in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert not other.exists() and not (Path(model_dir) / "ckpt").exists()


def _raise(exc: BaseException) -> None:
    raise exc


def test_the_activation_plot_labels_at_most_15_integer_layers_at_30(monkeypatch):
    """A 30-layer report: the line plot's and each heatmap's layer labels are integers, at most 15 of them."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from shardcal.collect.report import thinned_rows

    report = collect_activations(_model(), _data(), TARGETS[:1], bins=BINS, batch_size=BATCH, progress=False)
    layers = list(range(30))
    monkeypatch.setattr(type(report), "layer_absmax", lambda self, pattern: {i: 1.0 + i for i in layers})
    heat = (layers, [3, 1, 2], torch.rand(30, 3) + 0.1)
    monkeypatch.setattr(type(report), "layer_channel_absmax", lambda self, pattern, channels=None: heat)
    figure = report.activation_figure()
    line, heatmap = figure.axes[0], figure.axes[1]
    ticks = [t for t in line.get_xticks() if 0 <= t <= 29]
    assert 2 <= len(ticks) <= 15 and all(float(t).is_integer() for t in ticks)
    labels = [t.get_text() for t in heatmap.get_yticklabels()]
    assert 2 <= len(labels) <= 15 and all(text.isdigit() for text in labels) and labels[0] == "0"
    assert thinned_rows(12) == list(range(12)) and thinned_rows(30) == list(range(0, 30, 3))
    plt.close(figure)
