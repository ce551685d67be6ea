"""``CollectionOptions``: frozen, keyword-only, checked when made; ``collect_activations(model, data, targets,
options=None, **changes)`` takes it as ``calibrate`` takes ``CalibrationOptions``.

A bad value is a one-line :class:`CollectionError` naming the field (before any model or data is looked at); an
unknown option name is a :class:`UsageError`; an options object and the same keyword changes give the same report;
the fingerprinted fields are the ones that change what is collected.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from shardcal import CollectionOptions, collect_activations
from shardcal.collect.report import DEFAULT_BINS, DEFAULT_TOP_K, STATS
from shardcal.errors import CollectionError, UsageError
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(5))

BAD = [
    ("stats", ("median",), "stats: unknown statistic 'median'"),
    ("stats", 3, "stats must be a statistic's name or a sequence of them, got 3"),
    ("bins", 0, "bins must be an integer >= 1, got 0"),
    ("bins", 2.0, "bins must be an integer >= 1, got 2.0"),
    ("top_k", -1, "top_k must be an integer >= 0, got -1"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("batch_size", True, "batch_size must be an integer >= 1, got True"),
    ("checkpoint_every", 0, "checkpoint_every must be an integer >= 1, got 0"),
    ("keep_mb", -1, "keep_mb must be a number >= 0, got -1"),
    ("keep_mb", "4096", "keep_mb must be a number >= 0, got '4096'"),
    ("save_dtype", "int8", "save_dtype 'int8': not one of"),
    ("save_dtype", torch.int32, "save_dtype torch.int32: not one of"),
    ("save_dir", 3, "save_dir must be a path (str or Path) or None, got 3"),
    ("checkpoint_dir", ["a"], "checkpoint_dir must be a path (str or Path) or None, got ['a']"),
    ("offload_activations", 1, "offload_activations must be True, False or None, got 1"),
    ("progress", "yes", "progress must be True or False, got 'yes'"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_field(field, value, message):
    with pytest.raises(CollectionError) as info:
        CollectionOptions(**{field: value})
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(CollectionError) as info:  # as a keyword change: before the model or data are looked at
        collect_activations(None, None, "model.layers.*:output", **{field: value})
    assert message in str(info.value)


def test_an_unknown_option_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown collection option 'bin' "):
        CollectionOptions().replace(bin=3)
    with pytest.raises(UsageError, match="unknown collection option 'histogram_bins' "):
        collect_activations(None, None, "model.layers.*:output", histogram_bins=3)


def test_frozen_keyword_only_typed_and_documented():
    options = CollectionOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bins = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CollectionOptions(STATS)  # type: ignore[misc]
    assert all(f.type for f in dataclasses.fields(CollectionOptions))
    assert all(f"``{f.name}``" in (CollectionOptions.__doc__ or "") for f in dataclasses.fields(CollectionOptions))


def test_defaults_are_the_former_keyword_defaults():
    o = CollectionOptions()
    assert (o.stats, o.bins, o.top_k, o.save_dtype, o.save_dir) == (STATS, DEFAULT_BINS, DEFAULT_TOP_K, None, None)
    assert (o.batch_size, o.checkpoint_dir, o.checkpoint_every, o.offload_activations, o.keep_mb, o.progress) == (
        8,
        None,
        1,
        None,
        4096,
        True,
    )
    params = inspect.signature(collect_activations).parameters
    assert list(params) == ["model", "data", "targets", "options", "changes"]


def test_stats_are_stored_in_order_with_absmax():
    assert CollectionOptions(stats="mean").stats == ("absmax", "mean")
    assert CollectionOptions(stats=["histogram", "meansq"]).stats == ("absmax", "meansq", "histogram")


def test_the_fingerprint_is_the_result_changing_fields_as_json():
    resolved = CollectionOptions(stats=["mean"], save_dir="acts", progress=False, keep_mb=1).resolved(torch.bfloat16)
    assert resolved.fingerprint() == {
        "stats": ["absmax", "mean"],
        "bins": DEFAULT_BINS,
        "top_k": DEFAULT_TOP_K,
        "save_dtype": "bfloat16",
    }
    assert (
        CollectionOptions(save_dtype="float16").resolved(torch.float32).fingerprint()["save_dtype"] is None
    )  # no save_dir
    assert CollectionOptions(save_dtype=torch.float16, save_dir=Path("a")).fingerprint()["save_dtype"] == "float16"


def test_an_options_object_and_keyword_changes_give_the_same_report(tmp_path):
    model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS["llama"]))
    randomize_(model)
    model.eval()
    targets = ["model.layers.*:output", "model.layers.*.mlp.down_proj:input"]
    options = CollectionOptions(stats=("absmax", "histogram"), bins=16, top_k=2, batch_size=2, progress=False)
    by_object = collect_activations(model, IDS, targets, options)
    by_keywords = collect_activations(model, IDS, targets, stats=("absmax", "histogram"), bins=16, top_k=2, batch_size=2,
                                      progress=False)  # fmt: skip
    changed = collect_activations(model, IDS, targets, options, top_k=1)
    for name, got in by_object.targets.items():
        same = by_keywords.targets[name]
        assert torch.equal(got.absmax, same.absmax) and torch.equal(got.histogram, same.histogram)
        assert got.top_channels == same.top_channels and len(changed.targets[name].top_channels) == 1
    assert (by_object.bins, by_object.top_k, by_object.stats, changed.top_k) == (16, 2, ["absmax", "histogram"], 1)
