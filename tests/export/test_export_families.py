"""transformers (with compressed-tensors) loads the export of every model family shardcal has, with the calibrated
model's logits: exactly for the dense families, to float32 rounding for the MoE ones (fused gate_up matmuls).

Dense families with static int8 and fp8 activations; MoE families weight-only: transformers 5 keeps MoE experts
fused, applies their dequantized weights but no input scales (docs/reference/export-format.md, "Fused experts"), and cannot
convert int8 per-expert weights into fused ones at all (the strict xfail below turns into a failure the day it can).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant.session import quantizer_mode

from _numerics import FLOAT_RTOL
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
W4A16_G16 = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 16\n'  # hidden 64, experts' 32
IDS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(11))


def test_every_family_is_covered():
    assert set(DENSE + MOE) == set(TINY_CONFIGS)


def _exported(tmp_path, family: str, recipe):
    model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS[family]))
    randomize_(model)
    model.eval()
    calibrate(model, IDS, recipe, batch_size=2, progress=False)
    with torch.no_grad():
        want = model(IDS[:2])
        with quantizer_mode(model, "disabled"):
            unquantized = model(IDS[:2])
    return export_checkpoint(model, tmp_path / "out"), want, unquantized


def _transformers_logits(folder) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(IDS[:2]).logits


@pytest.mark.parametrize(
    ("family", "recipe"),
    [(f, r) for f in DENSE for r in ("w8a8-int8", "fp8")] + [(f, "w4a16-g16") for f in MOE],
)
def test_transformers_loads_the_export_with_the_same_logits(tmp_path, family, recipe):
    pytest.importorskip("compressed_tensors")
    spec = parse_recipe(W4A16_G16, "w4a16-g16.toml") if recipe == "w4a16-g16" else recipe
    folder, want, unquantized = _exported(tmp_path, family, spec)
    got = _transformers_logits(folder)
    if family in DENSE:
        assert torch.equal(got, want)
        return
    # transformers multiplies each expert's fused gate_up weight, shardcal the gate and up halves apart: the same
    # products summed in another kernel's order, bit-equal on some CPUs only, so MoE logits agree to float32
    # rounding — a thousandth of what quantization changes.
    tolerance = FLOAT_RTOL * float(want.abs().max())
    assert float((got - want).abs().max()) <= tolerance
    assert float((unquantized - want).abs().max()) > 1000 * tolerance


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="transformers 5 cannot fuse int8 per-expert weights")
def test_transformers_loads_a_w8a8_int8_moe_export(tmp_path):
    pytest.importorskip("compressed_tensors")
    folder, *_ = _exported(tmp_path, "qwen3_moe", "w8a8-int8")
    _transformers_logits(folder)
