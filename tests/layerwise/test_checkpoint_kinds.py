"""Each kind of checkpoint refuses what is not its own run's, with its own error naming what differs.

``CalibrationCheckpoint`` and ``CollectionCheckpoint`` share one base (``shardcal.layerwise.layer_checkpoint``); each
raises its own error: :class:`CalibrationCheckpointError` for calibration, :class:`CollectionCheckpointError` (a
subclass, so older ``except CalibrationCheckpointError`` code still catches it) for collection. Through the public
API: a directory holding the other kind's checkpoint, another run's checkpoint (a fingerprinted option changed), and
a corrupt file; and directly on the classes, that the refusal names the fingerprint key that differs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardcal import calibrate, collect_activations
from shardcal.calib.calibration_checkpoint import CalibrationCheckpoint
from shardcal.collect.collection_checkpoint import CollectionCheckpoint
from shardcal.collect.options import CollectionOptions
from shardcal.errors import CalibrationCheckpointError, CollectionCheckpointError
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(2))
TARGETS = ["model.layers.*:output"]
COLLECT = dict(batch_size=2, bins=64, top_k=3, progress=False)


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=2)))
    randomize_(model)
    return model.eval()


def _refusal(kind: type[Exception], action) -> str:
    """The message of the error ``action`` raises, which must be exactly of class ``kind``, on one line."""
    with pytest.raises(CalibrationCheckpointError) as info:
        action()
    assert type(info.value) is kind, repr(info.value)
    message = str(info.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """A finished calibration checkpoint and a finished collection checkpoint of the same model and data."""
    root = tmp_path_factory.mktemp("kinds")
    calibrate(_model(), IDS, "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=root / "calib")
    collect_activations(_model(), IDS, TARGETS, checkpoint_dir=root / "collect", **COLLECT)
    return {"calib": root / "calib", "collect": root / "collect"}


def test_collection_refuses_a_calibration_checkpoint(written):
    message = _refusal(
        CollectionCheckpointError,
        lambda: collect_activations(_model(), IDS, TARGETS, checkpoint_dir=written["calib"], **COLLECT),
    )
    assert f"{written['calib']}: holds a calibration checkpoint (manifest.json), not a collection one" in message


def test_calibration_refuses_a_collection_checkpoint(written):
    message = _refusal(
        CalibrationCheckpointError,
        lambda: calibrate(_model(), IDS, "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=written["collect"]),
    )
    assert (
        f"{written['collect']}: holds a collection checkpoint (collect-manifest.json), not a calibration one" in message
    )


#: A fingerprinted collection option changed, and what the refusal says.
COLLECT_CHANGES = {
    "stats": (
        ("absmax",),
        'different statistics: checkpoint ["absmax", "mean", "meansq", "histogram"], this run ["absmax"]',
    ),
    "bins": (32, "different histogram bins: checkpoint 64, this run 32"),
    "top_k": (4, "different top_k: checkpoint 3, this run 4"),
    "save_dtype": ("float16", "different raw activations (saved or not, and their save_dtype): checkpoint null"),
}


def test_every_fingerprinted_collection_option_is_tried():
    fingerprinted = CollectionOptions().fingerprint()
    assert sorted(COLLECT_CHANGES) == sorted(fingerprinted)


@pytest.mark.parametrize("option", sorted(COLLECT_CHANGES))
def test_collection_refuses_another_runs_checkpoint_naming_the_option(written, tmp_path, option):
    value, expected = COLLECT_CHANGES[option]
    changes = {**COLLECT, option: value} | ({"save_dir": tmp_path / "acts"} if option == "save_dtype" else {})
    message = _refusal(
        CollectionCheckpointError,
        lambda: collect_activations(_model(), IDS, TARGETS, checkpoint_dir=written["collect"], **changes),
    )
    assert f"collect-manifest.json: checkpoint of another run ({expected}" in message, message
    assert not (tmp_path / "acts").exists()  # refused before anything is written


def test_calibration_refuses_another_runs_checkpoint_naming_what_differs(written):
    for changes, expected in (
        (dict(recipe="fp8"), "checkpoint is from a different recipe"),
        (dict(sqnr_tokens=8), "checkpoint is from a different options (propagate, batch_size, calibrate_all_experts, "),
    ):
        recipe = changes.pop("recipe", "w8a8-int8")
        run = dict(batch_size=2, progress=False, checkpoint_dir=written["calib"], **changes)
        message = _refusal(CalibrationCheckpointError, lambda r=recipe, kw=run: calibrate(_model(), IDS, r, **kw))
        assert f"manifest.json: {expected}" in message, message


@pytest.mark.parametrize("kind", ["calib", "collect"])
def test_a_corrupt_file_is_refused_with_the_kinds_error(written, tmp_path, kind):
    folder = tmp_path / kind
    shutil.copytree(written[kind], folder)
    victim = next(p for p in sorted(folder.iterdir()) if p.suffix == ".safetensors")
    victim.write_bytes(victim.read_bytes()[:-3] + b"xyz")
    if kind == "calib":
        error = CalibrationCheckpointError
        action = lambda: calibrate(_model(), IDS, "w8a8-int8", batch_size=2, progress=False, checkpoint_dir=folder)
    else:
        error = CollectionCheckpointError
        action = lambda: collect_activations(_model(), IDS, TARGETS, checkpoint_dir=folder, **COLLECT)
    assert f"{victim}: contents do not match the manifest's SHA-256" in _refusal(error, action)


# ------------------------------------------------------------ the classes themselves


def _committed(kind: str, folder: Path, fingerprint: dict) -> None:
    hidden = {0: torch.ones(1, 2, 4)}
    if kind == "calib":
        CalibrationCheckpoint(folder, fingerprint, 0, 1).commit(1, 2, hidden, {"q.amax": torch.ones(1)}, [])
    else:
        CollectionCheckpoint(folder, fingerprint).commit(1, hidden, [])


def _opened(kind: str, folder: Path, fingerprint: dict):
    if kind == "calib":
        return CalibrationCheckpoint(folder, fingerprint, 0, 1).load([0])
    return CollectionCheckpoint(folder, fingerprint).load([0])


KINDS = {"calib": CalibrationCheckpointError, "collect": CollectionCheckpointError}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_refusal_names_the_first_key_that_differs(tmp_path, kind):
    fingerprint = {"model": "a" * 64, "data": "d", "stats": ["absmax"]}
    _committed(kind, tmp_path, fingerprint)
    assert _opened(kind, tmp_path, fingerprint).completed_layers == 1
    message = _refusal(KINDS[kind], lambda: _opened(kind, tmp_path, {**fingerprint, "data": "e"}))
    label = "data or batching" if kind == "calib" else "data or batch size"
    assert f"different {label}" in message and "d" in message and "e" in message
    message = _refusal(KINDS[kind], lambda: _opened(kind, tmp_path, {**fingerprint, "model": "b" * 64}))
    assert "a" * 12 in message and "b" * 12 in message and "a" * 13 not in message  # digests shortened
    message = _refusal(KINDS[kind], lambda: _opened(kind, tmp_path, {**fingerprint, "stats": ["mean"]}))
    assert "different stat" in message and '["absmax"]' in message and '["mean"]' in message


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_refuses_the_others_directory(tmp_path, kind):
    other = "collect" if kind == "calib" else "calib"
    _committed(other, tmp_path, {"data": "d"})
    message = _refusal(KINDS[kind], lambda: _opened(kind, tmp_path, {"data": "d"}))
    assert "holds a " + ("collection" if kind == "calib" else "calibration") + " checkpoint" in message
