"""CalibrationOptions: one typed object for calibrate, the CLI and the checkpoint fingerprint."""

import dataclasses
import inspect

import pytest

from shardcal.calib.runner import calibrate
from shardcal.errors import UsageError
from shardcal.export import export_checkpoint
from shardcal.layerwise.options import CalibrationOptions


def test_fingerprint_holds_exactly_the_result_changing_options():
    options = CalibrationOptions(propagate="qdq", batch_size=4, checkpoint_dir="/x", progress=False)
    assert options.fingerprint() == {
        "propagate": "qdq",
        "batch_size": 4,
        "calibrate_all_experts": True,
        "sqnr_tokens": 1024,
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": True}, "batch_size must be an integer >= 1"),
        ({"checkpoint_every": 0}, "checkpoint_every must be an integer >= 1"),
        ({"sqnr_tokens": -1}, "sqnr_tokens must be an integer >= 0"),
        ({"propagate": "int8"}, "propagate must be one of fp, qdq or None, got 'int8'"),
        ({"progress": "yes"}, "progress must be True or False"),
        ({"batchsize": 4}, "unknown calibration option 'batchsize' (known: "),
    ],
)
def test_bad_options_name_the_option(changes, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CalibrationOptions().replace(**changes)


def test_options_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        CalibrationOptions("fp")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CalibrationOptions().batch_size = 2  # type: ignore[misc]


def test_no_test_hooks_in_public_signatures():
    for fn in (calibrate, export_checkpoint):
        hidden = [p for p in inspect.signature(fn).parameters if p.startswith("_")]
        assert not hidden, (fn.__name__, hidden)
