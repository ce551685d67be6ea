"""QuantLinear insertion: forward formula, in-place conversion, state-dict keys, recipe targeting, FSDP2 (2 ranks)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardcal.calib.attach import quantize_modules
from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.errors import RecipeError, ShardcalError
from shardcal.models import CausalLM, DecoderLayer, ModelConfig
from shardcal.models.rope import RotaryEmbedding
from shardcal.quant import (
    CalibrationSession,
    NotCalibratedError,
    QuantizerSpec,
    QuantLinear,
    TensorQuantizer,
    fake_quantize,
    iter_quantizers,
    quantizer_mode,
    set_quantizer_mode,
)

from _dist import run_on_ranks

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
QWEN2_MOE = {
    **LLAMA,
    "model_type": "qwen2_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def _model(raw, seed=0):
    torch.manual_seed(seed)
    return CausalLM(ModelConfig.from_dict(dict(raw)))


def _calibrate_model(model, batches, group=None):
    """What the runner does, on a whole (unsharded) model: weights from themselves, activations from data."""
    for _, m in model.named_modules():
        if isinstance(m, QuantLinear) and m.weight_quantizer is not None:
            m.weight_quantizer.calibrate_from(m.weight)
    acts = [q for n, q in iter_quantizers(model) if not n.endswith("weight_quantizer")]
    for _ in CalibrationSession(acts, group).passes():
        for b in batches:
            model(b)


pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------------------------ one module


def test_forward_equals_manual_fake_quant_formula():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16, bias=True)
    weight_param = lin.weight
    w_spec = QuantizerSpec("int4", "group", group_size=16)
    i_spec = QuantizerSpec("fp8_e4m3")
    o_spec = QuantizerSpec("int8")
    q = QuantLinear.from_linear(lin, weight=w_spec, input=i_spec, output=o_spec, name="proj")
    assert q is lin and type(q) is QuantLinear and q.weight is weight_param
    x = torch.randn(3, 5, 32)
    q.weight_quantizer.calibrate_from(q.weight)
    q.input_quantizer.set_amax(torch.tensor([2.5]))
    q.output_quantizer.set_amax(torch.tensor([1.75]))
    w_amax = q.weight.detach().unflatten(-1, (2, 16)).abs().amax(-1)
    assert torch.equal(q.weight_quantizer.amax, w_amax)
    want = fake_quantize(
        F.linear(fake_quantize(x, torch.tensor([2.5]), i_spec), fake_quantize(q.weight, w_amax, w_spec), q.bias),
        torch.tensor([1.75]),
        o_spec,
    )
    assert torch.equal(q(x), want)
    with quantizer_mode(q, "disabled"):
        assert torch.equal(q(x), F.linear(x, q.weight, q.bias))
    assert q.input_quantizer.mode.value == "quantize"


def test_uncalibrated_quantizer_raises_and_modes():
    lin = QuantLinear.from_linear(
        nn.Linear(16, 8), weight=QuantizerSpec("int8"), input=QuantizerSpec("int8"), name="m.fc"
    )
    with pytest.raises(NotCalibratedError, match=r"m\.fc\.input_quantizer: asked to quantize before it was calibrated"):
        lin(torch.randn(2, 16))
    assert isinstance(NotCalibratedError("x"), ShardcalError)
    set_quantizer_mode(lin, "collect")  # pass-through: no pass begun, nothing recorded
    x = torch.randn(2, 16)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    # a dynamic quantizer needs no calibration
    dyn = TensorQuantizer(QuantizerSpec("int8", dynamic=True), (16,))
    assert torch.equal(dyn(x), fake_quantize(x, x.abs().amax().reshape(1), dyn.spec))
    assert "amax" not in dyn.state_dict()


def test_state_dict_keys_unchanged_and_amax_round_trips():
    recipe = load_recipe("w8a8-int8")
    model = _model(QWEN2_MOE)
    before = set(model.state_dict())
    names = quantize_modules(model, recipe)
    after = set(model.state_dict())
    assert before <= after
    extra = after - before
    assert extra and all(k.endswith(("input_quantizer.amax", "weight_quantizer.amax")) for k in extra)
    assert "model.layers.0.self_attn.q_proj.weight" in after
    assert "model.layers.0.self_attn.q_proj.input_quantizer.amax" in extra
    # excluded by default: lm_head, the router gate, the shared-expert gate
    assert "lm_head" not in names and not any(n.endswith((".mlp.gate", "shared_expert_gate")) for n in names)
    assert "model.layers.1.mlp.experts.3.down_proj" in names and "model.layers.0.mlp.shared_expert.up_proj" in names
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate) is nn.Linear

    data = [torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    _calibrate_model(model, data)
    out = model(data[0])
    fresh = _model(QWEN2_MOE, seed=1)
    quantize_modules(fresh, recipe)
    fresh.load_state_dict(model.state_dict())  # the amax buffers travel with the state dict
    assert all(q.calibrated for _, q in iter_quantizers(fresh))
    assert torch.equal(fresh(data[0]), out)
    # idempotent: a second insertion leaves the quantizers (and their amax) alone
    assert quantize_modules(model, recipe) == names and torch.equal(model(data[0]), out)


def test_quantize_modules_with_prefix_and_patterns():
    recipe = parse_recipe(
        '[targets]\ninclude = ["re:.*\\\\.self_attn\\\\..*"]\nexclude = ["*.o_proj"]\n[weight]\nformat = "int8"\n',
        source="mine.toml",
    )
    layer = DecoderLayer(ModelConfig.from_dict(dict(LLAMA)), 0)
    names = quantize_modules(layer, recipe, prefix="model.layers.0")
    assert names == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert layer.self_attn.q_proj.weight_quantizer.name == "model.layers.0.self_attn.q_proj.weight_quantizer"
    assert layer.self_attn.q_proj.input_quantizer is None and type(layer.mlp.up_proj) is nn.Linear


def test_group_size_that_does_not_divide_names_the_module():
    text = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 48\n'
    model = _model(LLAMA)
    quantize_modules(model, parse_recipe(text, source="g48.toml"))  # fitted: 64 inputs take groups of 32
    assert model.model.layers[0].self_attn.q_proj.weight_quantizer.spec.group_size == 32
    recipe = parse_recipe("group_size_fallback = false\n" + text, source="g48.toml")
    model = _model(LLAMA)
    with pytest.raises(
        RecipeError,
        match=r"g48\.toml: .*'model\.layers\.0\.self_attn\.q_proj': group_size 48 does not divide in_features 64 \(",
    ):
        quantize_modules(model, recipe)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # nothing half-converted


def test_nvfp4_recipe_on_a_model():
    model = _model(LLAMA)
    ref_logits = model(torch.arange(16)[None])
    quantize_modules(model, load_recipe("nvfp4"))
    _calibrate_model(model, [torch.arange(16)[None]])
    logits = model(torch.arange(16)[None])
    assert torch.isfinite(logits).all() and not torch.equal(logits, ref_logits)
    enc = model.model.layers[0].mlp.down_proj.weight_quantizer.encode(model.model.layers[0].mlp.down_proj.weight)
    assert enc["packed"].shape == (64, 64) and enc["scale"].shape == (64, 8)
    assert set(model.model.layers[0].self_attn.q_proj.input_quantizer.export_scales()) == {"global_scale"}


# ------------------------------------------------------------------------------------------ FSDP2, 2 ranks


def _fsdp2_on_ranks():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig.from_dict(dict(LLAMA))
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    ref, plain = copy.deepcopy(layer), copy.deepcopy(layer)
    prefix = "model.layers.0"
    recipe = parse_recipe(
        '[weight]\nformat = "int8"\ngranularity = "channel"\n'
        '[input]\nformat = "int8"\nobserver = { name = "percentile", percentile = 99.9 }\n',
        source="fsdp.toml",
    )
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    assert isinstance(layer.self_attn.q_proj.weight, DTensor)
    keys_before = set(layer.state_dict())
    names = quantize_modules(layer, recipe, prefix=prefix)  # after fully_shard, as the runner does
    quantize_modules(ref, recipe, prefix=prefix)
    keys_after = set(layer.state_dict())

    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(2 * world, 6, cfg.hidden_size, generator=g)
    pos = torch.arange(6)[None].expand(2, -1)
    cos_sin = RotaryEmbedding(cfg)(pos, torch.float32)
    x_local = x_all[2 * rank : 2 * rank + 2]

    # weights: from the full weight, on the unsharded layer (what the runner hands over) ...
    layer.unshard()
    for _n, m in layer.named_modules():
        if isinstance(m, QuantLinear):
            assert not isinstance(m.weight, DTensor)
            m.weight_quantizer.calibrate_from(m.weight)
    layer.reshard()
    # ... or straight from the sharded DTensor (gathered inside calibrate_from); same amax
    dq = TensorQuantizer(recipe.weight, layer.mlp.down_proj.weight.shape)
    dtensor_ok = torch.equal(dq.calibrate_from(layer.mlp.down_proj.weight), layer.mlp.down_proj.weight_quantizer.amax)
    # activations: each rank runs its own data through the sharded layer; two passes merged over the group
    acts = [q for n, q in iter_quantizers(layer) if not n.endswith("weight_quantizer")]
    for _ in CalibrationSession(acts, dist.group.WORLD).passes():
        layer(x_local, position_embeddings=cos_sin)

    # the unsharded reference, calibrated on all the data in this one process
    for _n, m in ref.named_modules():
        if isinstance(m, QuantLinear):
            m.weight_quantizer.calibrate_from(m.weight)
    ref_acts = [q for n, q in iter_quantizers(ref) if not n.endswith("weight_quantizer")]
    for _ in CalibrationSession(ref_acts).passes():
        for i in range(world):
            ref(x_all[2 * i : 2 * i + 2], position_embeddings=cos_sin)

    amax_equal = all(
        torch.equal(a.amax, b.amax) for (_, a), (_, b) in zip(iter_quantizers(layer), iter_quantizers(ref))
    )
    out = layer(x_local, position_embeddings=cos_sin)
    out_ref = ref(x_local, position_embeddings=cos_sin)
    with quantizer_mode(ref, "disabled"):
        out_fp = ref(x_local, position_embeddings=cos_sin)
    # insertion before fully_shard, and a Linear that is its own FSDP unit (class FSDPLinear), also work
    before, units = copy.deepcopy(plain), copy.deepcopy(plain)
    quantize_modules(before, recipe, prefix=prefix)
    fully_shard(before, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(units.mlp.down_proj, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(units, mesh=init_device_mesh("cpu", (world,)))
    quantize_modules(units, recipe, prefix=prefix)
    unit_class = type(units.mlp.down_proj)
    for other in (before, units):
        for (_, a), (_, b) in zip(iter_quantizers(other), iter_quantizers(ref)):
            a.set_amax(b.amax)
    before_diff = (before(x_local, position_embeddings=cos_sin) - out_ref).abs().max().item()
    units_diff = (units(x_local, position_embeddings=cos_sin) - out_ref).abs().max().item()
    return {
        "before_diff": before_diff,
        "units_diff": units_diff,
        "unit_class": (
            unit_class.__name__,
            issubclass(unit_class, QuantLinear),
            type(units.mlp.down_proj).__mro__[2].__name__,
        ),
        "names": names,
        "keys_kept": keys_before <= keys_after,
        "extra": sorted(keys_after - keys_before),
        "amax_equal": amax_equal,
        "dtensor_ok": dtensor_ok,
        "max_diff": (out - out_ref).abs().max().item(),
        "quant_effect": (out_ref - out_fp).abs().max().item(),
    }


def test_insert_after_fully_shard_matches_unsharded_reference():
    for r in run_on_ranks(2, _fsdp2_on_ranks):
        assert len(r["names"]) == 7 and r["names"][0] == "model.layers.0.self_attn.q_proj"
        assert r["keys_kept"]
        assert len(r["extra"]) == 14 and all(
            k.endswith(("input_quantizer.amax", "weight_quantizer.amax")) for k in r["extra"]
        )
        assert r["amax_equal"] and r["dtensor_ok"]
        assert r["max_diff"] == 0.0, r
        assert r["quant_effect"] > 0
        assert r["before_diff"] == 0.0 and r["units_diff"] == 0.0, r
        assert r["unit_class"] == ("QuantFSDPLinear", True, "FSDPLinear"), r["unit_class"]
