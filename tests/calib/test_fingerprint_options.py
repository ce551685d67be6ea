"""A checkpoint is resumed only by the run that wrote it: every result-changing option is part of its fingerprint.

Black-box, through ``calibrate``'s public options: a run is interrupted after one committed layer, then rerun on the
same checkpoint directory with one option changed at a time. A change of an option that changes the result
(``CalibrationOptions`` fields marked ``fingerprint``), of the data's padding mask or of the batching is refused with
a :class:`CalibrationCheckpointError` naming what differs; a change of an option that does not (progress, reporting,
how often to commit, where activations are cached) resumes, and gives the uninterrupted run's result.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after

from shardcal.calib.runner import calibrate
from shardcal.errors import CalibrationCheckpointError
from shardcal.layerwise.options import CalibrationOptions
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)
IDS = torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(4))
BASE = dict(propagate="fp", batch_size=2, calibrate_all_experts=True, sqnr_tokens=12, progress=False)


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    return model.eval()


def _amax(model) -> dict[str, torch.Tensor]:
    return {n: q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A checkpoint directory holding the first layer of a run with BASE options."""
    folder = tmp_path_factory.mktemp("ckpt") / "ckpt"
    with pytest.raises(CalibrationInterrupted), interrupt_after(1):
        calibrate(_model(), IDS, "w8a8-int8", checkpoint_dir=folder, **BASE)
    return folder


def _copy(folder, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target


FINGERPRINTED = [f.name for f in dataclasses.fields(CalibrationOptions) if f.metadata.get("fingerprint")]
CHANGED = {"propagate": "qdq", "batch_size": 3, "calibrate_all_experts": False, "sqnr_tokens": 24}


def test_every_fingerprinted_option_is_tried():
    assert sorted(CHANGED) == sorted(FINGERPRINTED)


@pytest.mark.parametrize("option", sorted(CHANGED))
def test_a_changed_result_option_is_refused(interrupted, tmp_path, option):
    folder = _copy(interrupted, tmp_path)
    with pytest.raises(CalibrationCheckpointError) as info:
        calibrate(_model(), IDS, "w8a8-int8", checkpoint_dir=folder, **{**BASE, option: CHANGED[option]})
    # The message names the options (today as a group: "different options"; naming the option itself is welcome).
    # batch_size changes the batches too, which the data fingerprint may see first.
    message = str(info.value)
    named = "different options" in message or option in message or option.replace("_", " ") in message
    assert named or (option == "batch_size" and "different data" in message), message


def test_a_changed_padding_mask_is_refused(interrupted, tmp_path):
    folder = _copy(interrupted, tmp_path)
    mask = torch.ones_like(IDS)
    mask[0, -3:] = 0
    with pytest.raises(CalibrationCheckpointError, match="different data"):
        calibrate(_model(), {"input_ids": IDS, "attention_mask": mask}, "w8a8-int8", checkpoint_dir=folder, **BASE)


@pytest.mark.parametrize(
    "changes",
    [
        {"progress": True},
        {"checkpoint_every": 2, "offload_activations": False},
        {"propagate": None},  # resolved to the recipe's choice (fp for round to nearest) before the fingerprint
    ],
    ids=["progress", "checkpoint-every-offload", "propagate-default"],
)
def test_other_options_resume_to_the_uninterrupted_result(interrupted, tmp_path, changes):
    folder = _copy(interrupted, tmp_path)
    whole = _model()
    uninterrupted = calibrate(whole, IDS, "w8a8-int8", **BASE)
    model = _model()
    report = calibrate(
        model, IDS, "w8a8-int8", checkpoint_dir=folder, report_path=tmp_path / "r.json", **{**BASE, **changes}
    )
    assert report.resumed_from_layer == 1
    want, got = _amax(whole), _amax(model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # the SQNR sample is part of a batch: the resumed run computes the arguments of its rows again
    assert [e.sqnr_db for e in report.layers] == [e.sqnr_db for e in uninterrupted.layers]
