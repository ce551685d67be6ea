"""The fused-layer rule (shardcal.quant.fused): which Linears vLLM fuses, which of their ranges it takes as one, and
sharing them — against vLLM's ``packed_modules_mapping`` and scale handling written out by hand (the sources:
docs/reference/vllm-conventions.md)."""

from __future__ import annotations

import pytest
import torch

from shardcal.quant.fused import fused_groups, fused_layer, mixed_schemes, share_ranges, shares_range, unshared_ranges
from shardcal.quant.quantizer import TensorQuantizer
from shardcal.quant.spec import QuantizerSpec


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.qkv_proj"),
        ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.qkv_proj"),
        ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.qkv_proj"),
        ("model.layers.3.mlp.gate_proj", "model.layers.3.mlp.gate_up_proj"),
        ("model.layers.3.mlp.up_proj", "model.layers.3.mlp.gate_up_proj"),
        ("model.layers.1.mlp.experts.7.up_proj", "model.layers.1.mlp.experts.7.gate_up_proj"),
        ("model.layers.1.mlp.shared_expert.gate_proj", "model.layers.1.mlp.shared_expert.gate_up_proj"),
        ("model.layers.1.block_sparse_moe.experts.2.w1", "model.layers.1.block_sparse_moe.experts.2.w13"),
        ("model.layers.1.block_sparse_moe.experts.2.w3", "model.layers.1.block_sparse_moe.experts.2.w13"),
        ("model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.fused_qkv_a_proj"),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.0.self_attn.fused_qkv_a_proj"),
        ("q_proj", "qkv_proj"),
        ("model.layers.0.self_attn.o_proj", None),
        ("model.layers.0.mlp.down_proj", None),
        ("model.layers.1.block_sparse_moe.experts.2.w2", None),
        ("model.layers.0.self_attn.q_b_proj", None),
        ("lm_head", None),
        ("model.layers.0.self_attn.xq_proj", None),
    ],
)
def test_fused_layer_is_vllms_packed_modules_mapping(name, fused):
    assert fused_layer(name) == fused


def test_fused_groups_keep_siblings_together_and_drop_single_members():
    names = [
        "a.self_attn.q_proj",
        "a.mlp.gate_proj",
        "a.self_attn.k_proj",
        "b.self_attn.q_proj",  # its k / v are not among the names: no group
        "a.self_attn.o_proj",
        "a.self_attn.v_proj",
        "a.mlp.up_proj",
    ]
    assert fused_groups(names) == [
        ["a.self_attn.q_proj", "a.self_attn.k_proj", "a.self_attn.v_proj"],
        ["a.mlp.gate_proj", "a.mlp.up_proj"],
    ]


NVFP4 = QuantizerSpec("nvfp4")
FP8_TENSOR = QuantizerSpec("fp8_e4m3")
FP8_CHANNEL = QuantizerSpec("fp8_e4m3", "channel", axis=0)
INT8_TENSOR = QuantizerSpec("int8")
INT8_CHANNEL = QuantizerSpec("int8", "channel", axis=0)
INT4_GROUP = QuantizerSpec("int4", "group", group_size=16)
FP8_TOKEN = QuantizerSpec("fp8_e4m3", "token", dynamic=True)


@pytest.mark.parametrize(
    ("spec", "role", "shared"),
    [
        (NVFP4, "weight", True),  # one weight_global_scale per fused layer (the largest is taken)
        (FP8_TENSOR, "weight", True),  # requantized to the largest weight_scale
        (FP8_CHANNEL, "weight", False),  # per-row scales, concatenated
        (INT8_TENSOR, "weight", False),  # expanded per channel (convert_to_channelwise), no requantization
        (INT8_CHANNEL, "weight", False),
        (INT4_GROUP, "weight", False),
        (INT8_TENSOR, "input", True),  # one input_scale: the largest
        (FP8_TENSOR, "input", True),
        (NVFP4, "input", True),  # one input_global_scale
        (FP8_TOKEN, "input", False),  # dynamic: nothing stored
    ],
)
def test_which_ranges_a_fused_layer_shares(spec, role, shared):
    assert shares_range(spec, role) is shared


def _quantizer(spec: QuantizerSpec, amax: float | list[float], shape=(32, 64)) -> TensorQuantizer:
    q = TensorQuantizer(spec, shape)
    q.set_amax(torch.tensor(amax, dtype=torch.float32).reshape(q.amax.shape))
    return q


def test_share_ranges_sets_each_group_to_its_largest_range():
    qkv = {f"l.self_attn.{p}_proj": _quantizer(NVFP4, a) for p, a in zip("qkv", (3.0, 5.5, 0.25), strict=True)}
    gate_up = {f"l.mlp.{p}_proj": _quantizer(INT8_CHANNEL, [float(i + k) for i in range(32)]) for k, p in enumerate(("gate", "up"))}  # fmt: skip
    others = {"l.self_attn.o_proj": _quantizer(NVFP4, 9.0)}
    quantizers = {**qkv, **gate_up, **others}
    before = {n: q.amax.clone() for n, q in quantizers.items()}
    assert share_ranges(quantizers, "weight") == [list(qkv)]
    for q in qkv.values():
        assert torch.equal(q.amax, torch.tensor([5.5]))
    for n in (*gate_up, *others):  # per-channel scales and Linears vLLM does not fuse keep their own
        assert torch.equal(quantizers[n].amax, before[n])
    assert unshared_ranges(quantizers, "weight") == []


def test_share_ranges_leaves_groups_it_cannot_share():
    uncalibrated = TensorQuantizer(NVFP4, (32, 64))
    mixed = {"m.self_attn.q_proj": _quantizer(NVFP4, 1.0), "m.self_attn.k_proj": _quantizer(FP8_TENSOR, 2.0)}
    partial = {"p.mlp.gate_proj": _quantizer(NVFP4, 1.0), "p.mlp.up_proj": uncalibrated}
    assert share_ranges({**mixed, **partial}, "weight") == []
    assert float(mixed["m.self_attn.q_proj"].amax) == 1.0 and float(partial["p.mlp.gate_proj"].amax) == 1.0


def test_unshared_ranges_names_the_groups_vllm_would_compute_otherwise():
    quantizers = {
        f"l.self_attn.{p}_proj": _quantizer(FP8_TENSOR, a) for p, a in zip("qkv", (1.0, 1.0, 2.0), strict=True)
    }
    quantizers["l.mlp.gate_proj"] = _quantizer(FP8_TENSOR, 1.0)
    quantizers["l.mlp.up_proj"] = _quantizer(FP8_TENSOR, 1.0)
    assert unshared_ranges(quantizers, "weight") == [["l.self_attn.q_proj", "l.self_attn.k_proj", "l.self_attn.v_proj"]]
    assert unshared_ranges({**quantizers, "l.self_attn.v_proj": None}, "weight") == []  # two members left, equal


def test_unshared_ranges_sees_ranges_one_ulp_apart():
    """vLLM computes a fused layer with one global scale: q/k/v ranges that differ in the last bit (far inside
    ``allclose``'s tolerance) are not one range, and are named."""
    one = torch.tensor(1.0)
    next_up = torch.nextafter(one, torch.tensor(2.0))
    assert next_up != one and torch.allclose(next_up, one)
    quantizers = {f"l.self_attn.{p}_proj": _quantizer(FP8_TENSOR, 1.0) for p in "qkv"}
    quantizers["l.self_attn.k_proj"].set_amax(next_up.reshape(1))
    assert unshared_ranges(quantizers, "weight") == [["l.self_attn.q_proj", "l.self_attn.k_proj", "l.self_attn.v_proj"]]


def test_mixed_schemes_are_groups_whose_members_differ():
    a, b = ("int8", "channel"), ("int4", "group")
    schemes = {
        "x.self_attn.q_proj": a,
        "x.self_attn.k_proj": a,
        "x.self_attn.v_proj": None,  # not quantized: vLLM refuses a partly ignored fused layer
        "x.mlp.gate_proj": a,
        "x.mlp.up_proj": a,
        "y.mlp.gate_proj": a,
        "y.mlp.up_proj": b,  # vLLM would load both with the first member's scheme
        "x.self_attn.o_proj": b,
    }
    assert mixed_schemes(schemes) == [
        ["x.self_attn.q_proj", "x.self_attn.k_proj", "x.self_attn.v_proj"],
        ["y.mlp.gate_proj", "y.mlp.up_proj"],
    ]
