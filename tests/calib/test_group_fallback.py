"""Grouped weights on Linears whose in_features the recipe's group size does not divide: the size vLLM's kernels
accept that fits (per Linear, reported, exported as their own config groups), or an error naming the Linear."""

from __future__ import annotations

import json

import pytest
import torch

from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import RecipeError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import quantized_modules

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.numerics

# SmolLM2-135M's widths: hidden 576 (9 heads of 64, 3 kv heads), intermediate 1536
CFG = dict(
    TINY_CONFIGS["llama"],
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    num_hidden_layers=1,
)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model, seed=0)
    return model.eval()


def _data(n: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("in_features", "expected"),
    [(1536, 128), (576, 64), (96, 32), (4096, 128), (100, "channel"), (48, "channel")],
)
def test_documented_sizes(in_features, expected):
    spec = load_recipe("w4a16").weight_spec("m", in_features)
    got = spec.group_size if spec.granularity == "group" else spec.granularity
    assert got == expected
    assert spec.format == "int4" and spec.observer == "mse"  # only the group size changes


def test_recipe_group_size_is_an_upper_bound():
    recipe = parse_recipe('[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 64\n', "g64.toml")
    assert recipe.weight_spec("m", 576).group_size == 64
    assert recipe.weight_spec("m", 96).group_size == 32  # never larger than asked for, although 96 % 96 == 0


def test_w4a16_on_widths_576_and_1536(tmp_path):
    """g128: the 576-wide Linears get 64, down_proj (1536) keeps 128; reported, exported as two config groups that
    compressed-tensors parses; the reload (shardcal and transformers) computes the same logits."""
    model = _model()
    report = calibrate(model, _data(), "w4a16", batch_size=2, progress=False)
    sizes = {n: m.weight_quantizer.spec.group_size for n, m in quantized_modules(model)}
    assert sizes == {**{f"model.layers.0.{p}": 64 for p in PROJ}, "model.layers.0.mlp.down_proj": 128}
    assert report.group_sizes == {f"model.layers.0.{p}": 64 for p in PROJ}
    assert report.layers[0].group_sizes == report.group_sizes
    out = export_checkpoint(model, tmp_path / "w4a16", report=report)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["group_size"]: g["targets"] for g in qc["config_groups"].values()}
    assert groups == {128: ["model.layers.0.mlp.down_proj"], 64: [f"model.layers.0.{p}" for p in PROJ]}
    saved = json.loads((out / "calibration_report.json").read_text())
    assert saved["layers"][0]["group_sizes"] == report.group_sizes
    data = _data(seed=4)
    with torch.no_grad():
        want = model(data)
        assert torch.equal(from_pretrained(out)(data), want)
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(qc)
    assert sorted(s.weights.group_size for s in parsed.config_groups.values()) == [64, 128]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(hf(data).logits, want)


def test_fallback_off_is_an_error_naming_the_linear():
    text = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 128\n'
    recipe = parse_recipe("group_size_fallback = false\n" + text, "strict.toml")
    with pytest.raises(
        RecipeError,
        match=r"strict\.toml: .*'model\.layers\.0\.self_attn\.q_proj': group_size 128 does not divide in_features 576",
    ):
        calibrate(_model(), _data(), recipe, batch_size=2, progress=False)
    with pytest.raises(RecipeError, match=r"key 'group_size_fallback'"):
        parse_recipe('group_size_fallback = "no"\n' + text, "bad.toml")


def test_export_time_quantization_fits_too(tmp_path):
    """A plain model exported with the weight-only recipe (quantized at export) equals calibrate + export."""
    recipe = parse_recipe('[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 128\n', "g128.toml")
    calibrated = _model()
    calibrate(calibrated, _data(), recipe, batch_size=2, progress=False)
    a = export_checkpoint(calibrated, tmp_path / "a")
    b = export_checkpoint(_model(), tmp_path / "b", recipe=recipe)
    config = lambda p: json.loads((p / "config.json").read_text())["quantization_config"]
    assert config(a) == config(b)
    data = _data(seed=4)
    with torch.no_grad():
        assert torch.equal(from_pretrained(a)(data), from_pretrained(b)(data))


# ----------------------------------------------------------------------------------------------- MoE experts

G64 = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 64\n'
G32 = G64.replace("group_size = 64", "group_size = 32")
MIXED = (
    r"recipe 'g64' gives the projections of 'model\.layers\.0\.{block}\.experts' different weight group sizes "
    r"\({gate} group 64 of in_features 64, .*{down} group 32 of in_features 32.*\); transformers and vLLM load one "
    r"quantization scheme for all of a model's experts, so this export would not load; fix: group_size = 32, which "
    r"divides every projection's width"
)


def _moe(family: str) -> CausalLM:
    cfg = dict(TINY_CONFIGS[family], num_hidden_layers=1)
    cfg["intermediate_size" if family == "mixtral" else "moe_intermediate_size"] = 32
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=0)
    return model.eval()


@pytest.mark.parametrize(
    ("family", "block", "gate", "down"),
    [("qwen3_moe", "mlp", "gate_proj", "down_proj"), ("mixtral", "block_sparse_moe", "w1", "w2")],
)
def test_experts_with_mixed_group_sizes_are_refused_before_calibrating(family, block, gate, down):
    model = _moe(family)
    with pytest.raises(RecipeError, match=MIXED.format(block=block, gate=gate, down=down)):
        calibrate(model, _data(), parse_recipe(G64, "g64.toml", "g64"), batch_size=2, progress=False)
    assert quantized_modules(model) == []  # refused before any quantizer was attached or calibrated


def test_transformers_fused_experts_with_mixed_group_sizes_are_refused():
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    model = hf_model("qwen3_moe", num_hidden_layers=1)
    match = MIXED.format(block="mlp", gate="gate_proj", down="down_proj")
    with pytest.raises(RecipeError, match=match):
        calibrate(model, _data(), parse_recipe(G64, "g64.toml", "g64"), batch_size=2, progress=False)


@pytest.mark.usefixtures("one_thread")
def test_experts_with_one_group_size_reload_in_transformers(tmp_path):
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    from _numerics import FLOAT_RTOL

    model = _moe("qwen3_moe")
    calibrate(model, _data(), parse_recipe(G32, "g32.toml"), batch_size=2, progress=False)
    data = _data(seed=4)
    with torch.no_grad():
        want = model(data)
    out = export_checkpoint(model, tmp_path / "g32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(data).logits
    assert float((got - want).abs().max()) <= FLOAT_RTOL * float(want.abs().max())
