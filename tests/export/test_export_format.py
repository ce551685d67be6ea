"""The export format seam: the registry, and a format object is all the streaming export asks about the format.

A format that delegates everything to compressed-tensors but writes its config under another key shows that the
shared code takes the tensors, their encoding and the config from the format object: its shards are byte for byte
the default export's, and config.json differs only in the key. The sizes the planner reads from the format
(``module_sizes``) are checked against the written safetensors headers, read by the safetensors package.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from shardcal.calib.recipes import load_recipe
from shardcal.errors import ExportError
from shardcal.export import export_checkpoint
from shardcal.export.compressed_tensors.format import COMPRESSED_TENSORS
from shardcal.export.format import DEFAULT_FORMAT, ExportFormat, formats, get_format, module_sizes
from shardcal.models import from_pretrained

from _tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_registry_holds_compressed_tensors_only():
    assert formats() == {"compressed-tensors": COMPRESSED_TENSORS} and DEFAULT_FORMAT == "compressed-tensors"
    assert get_format() is get_format("compressed-tensors") is get_format(COMPRESSED_TENSORS) is COMPRESSED_TENSORS
    assert isinstance(COMPRESSED_TENSORS, ExportFormat) and COMPRESSED_TENSORS.config_key == "quantization_config"
    with pytest.raises(ExportError, match=r"^format 'gguf': unknown export format \(known: compressed-tensors\)$"):
        get_format("gguf")
    with pytest.raises(ExportError, match=r"^--format: expected a format name or an ExportFormat, got int$"):
        get_format(3, "--format")


class RenamedConfig:
    """compressed-tensors in every respect but the name and the config key."""

    name = "renamed"
    config_key = "renamed_config"

    def check_spec(self, spec, role):
        COMPRESSED_TENSORS.check_spec(spec, role)

    def module_format(self, weight, input):
        return COMPRESSED_TENSORS.module_format(weight, input)

    def module_tensors(self, module_format, weight, input, out_features, in_features, input_rotation=None):
        return COMPRESSED_TENSORS.module_tensors(
            module_format, weight, input, out_features, in_features, input_rotation
        )

    def encode_module(self, module_format, weight_quantizer, weight, input_quantizer, input_rotation=None):
        return COMPRESSED_TENSORS.encode_module(
            module_format, weight_quantizer, weight, input_quantizer, input_rotation
        )

    def config(self, schemes, ignore, kv_cache, rotations=None):
        return COMPRESSED_TENSORS.config(schemes, ignore, kv_cache, rotations)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("format"), "llama", seed=5)


def test_the_export_takes_everything_format_specific_from_the_format_object(tiny_model_dir, tmp_path):
    model = from_pretrained(tiny_model_dir)
    default = export_checkpoint(model, tmp_path / "default", recipe="w4a16", config_dir=tiny_model_dir)
    renamed = export_checkpoint(
        model, tmp_path / "renamed", recipe="w4a16", config_dir=tiny_model_dir, format=RenamedConfig()
    )
    shards = sorted(p.name for p in default.glob("*.safetensors"))
    assert shards == sorted(p.name for p in renamed.glob("*.safetensors")) and shards
    for name in [*shards, "model.safetensors.index.json"]:
        assert (default / name).read_bytes() == (renamed / name).read_bytes(), name
    config, other = (json.loads((d / "config.json").read_text()) for d in (default, renamed))
    assert other.pop("renamed_config") == config.pop("quantization_config") and other == config
    with pytest.raises(ExportError, match="unknown export format"):
        export_checkpoint(model, tmp_path / "never", recipe="w4a16", format="gguf")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("recipe", ["w4a16", "w8a8-int8-dynamic", "fp8-dynamic"])
def test_module_sizes_are_the_written_tensors(tiny_model_dir, tmp_path, recipe):
    """What the planner counts per quantized Linear is what the export writes: names, dtypes, shapes and bytes."""
    model = from_pretrained(tiny_model_dir)
    out = export_checkpoint(model, tmp_path / "out", recipe=recipe, config_dir=tiny_model_dir)
    written = {}
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                written[key] = (t.dtype, tuple(t.shape), t.numel() * t.element_size())
    r = load_recipe(recipe)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not r.matches(name):
            continue
        weight = r.weight_spec(name, module.in_features)
        stored = COMPRESSED_TENSORS.module_format(weight, r.input)
        sizes = module_sizes(COMPRESSED_TENSORS, stored, weight, r.input, module.out_features, module.in_features)
        for suffix, (dtype, shape, nbytes) in sizes.items():
            assert written[f"{name}.{suffix}"] == (dtype, shape, nbytes), (name, suffix)
            assert nbytes == math.prod(shape) * dtype.itemsize
        assert f"{name}.weight" not in written or "weight" in sizes
        checked += 1
    assert checked == 14  # 7 Linears in each of the 2 decoder layers (the untied lm_head is not targeted)
