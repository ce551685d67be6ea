"""Number formats: hand-computed values, torch's own FP8 cast, round-trip bounds, compressed-tensors parity,
and fake_quantize == decode(encode(...)) bit for bit."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardcal.quant import (
    QuantizerSpec,
    TensorQuantizer,
    decode,
    encode,
    fake_quantize,
    formats,
    pack_int4_to_int32,
    unpack_int4_from_int32,
)
from shardcal.quant.formats import (
    e2m1_codes,
    e2m1_values,
    nvfp4_global_scale,
    pack_fp4_to_uint8,
    round_e2m1,
    round_e2m1_,
    scales_from_amax,
)
from shardcal.quant.granularity import Layout

INT8 = QuantizerSpec("int8")
INT4 = QuantizerSpec("int4")
FP8 = QuantizerSpec("fp8_e4m3")
NVFP4 = QuantizerSpec("nvfp4")


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True, params=["whole", "by-rows"])
def chunking(request, monkeypatch):
    """Every test here runs twice: tensors quantized whole, and (a chunk of 100 elements) a few rows at a time, the
    last chunk ragged: how a large CPU weight is quantized. Both must meet the same independent references."""
    if request.param == "by-rows":
        monkeypatch.setattr(formats, "CPU_CHUNK_ELEMENTS", 100)


# ------------------------------------------------------------------------------------------ hand-computed


def test_int8_per_tensor_hand_computed():
    x = t(1.0, -2.0, 0.5, 1.5, 2.5, -0.5, 126.6, 200.0, -200.0)
    # scale 127 / 127 = 1: round half to even, clamp to [-128, 127]
    assert torch.equal(fake_quantize(x, t(127.0), INT8), t(1, -2, 0, 2, 2, -0.0, 127, 127, -128))
    # scale 2: 3 / 2 = 1.5 -> 2 -> 4; 1 / 2 = 0.5 -> 0
    assert torch.equal(fake_quantize(t(3.0, 1.0, -255.0), t(254.0), INT8), t(4.0, 0.0, -256.0))
    enc = encode(x, t(127.0), INT8)
    assert enc["values"].dtype == torch.int8 and enc["values"].tolist() == [1, -2, 0, 2, 2, 0, 127, 127, -128]
    assert enc["scale"].dtype == torch.float32 and enc["scale"].tolist() == [1.0]


def test_int4_per_tensor_hand_computed():
    x = t(0.4, 0.6, 2.5, 3.5, 7.4, -8.6, -7.5, -7.4)
    assert torch.equal(fake_quantize(x, t(7.0), INT4), t(0, 1, 2, 4, 7, -8, -8, -7))
    assert torch.equal(fake_quantize(t(1.2, -3.6), t(3.5), INT4), t(1.0, -3.5))  # scale 0.5


def test_int8_per_channel_and_int4_per_group_hand_computed():
    spec = QuantizerSpec("int8", "channel", axis=0)
    w = torch.tensor([[1.4, -127.0], [3.0, 254.0]])
    amax = torch.tensor([[127.0], [254.0]])  # scales 1 and 2
    assert torch.equal(fake_quantize(w, amax, spec), torch.tensor([[1.0, -127.0], [4.0, 254.0]]))
    enc = encode(w, amax, spec)
    assert enc["values"].tolist() == [[1, -127], [2, 127]] and enc["scale"].shape == (2, 1)

    g = QuantizerSpec("int4", "group", group_size=2)
    w = torch.tensor([[0.6, 7.0, 1.0, -14.0], [0.0, 0.0, 3.1, -0.2]])
    amax = torch.tensor([[7.0, 14.0], [0.0, 3.5]])  # scales 1, 2 | eps (zero amax), 0.5
    assert torch.equal(fake_quantize(w, amax, g), torch.tensor([[1.0, 7.0, 0.0, -14.0], [0.0, 0.0, 3.0, -0.0]]))
    assert encode(w, amax, g)["scale"].shape == (2, 2)


def test_fp8_hand_computed_and_saturating():
    x = t(1.0, 1.0625, 1.1875, 240.0, 248.0, 500.0, -1000.0, 0.0)
    # E4M3: step 0.125 in [1, 2) (ties to even), step 16 in [128, 256), saturate at +-448
    assert torch.equal(fake_quantize(x, t(448.0), FP8), t(1.0, 1.0, 1.25, 240.0, 256.0, 448.0, -448.0, 0.0))
    assert torch.equal(fake_quantize(t(900.0, 3.0), t(896.0), FP8), t(896.0, 3.0))  # scale 2
    enc = encode(x, t(448.0), FP8)
    assert enc["values"].dtype == torch.float8_e4m3fn and enc["scale"].tolist() == [1.0]


def test_fp8_matches_torch_cast():
    torch.manual_seed(0)
    x = torch.randn(4096) * 100
    inside = x.clamp(-448, 448)
    assert torch.equal(fake_quantize(inside, t(448.0), FP8), inside.to(torch.float8_e4m3fn).float())
    # with a scale: x / s cast by torch, times s
    amax = t(37.5)
    s = 37.5 / 448
    expected = (
        torch.clamp(x / torch.tensor(s, dtype=torch.float32), -448, 448).to(torch.float8_e4m3fn).float()
    ) * torch.tensor(s)
    assert torch.equal(fake_quantize(x, amax, FP8), expected)
    # torch's own cast of out-of-range values is NaN; ours saturates
    assert not torch.isnan(fake_quantize(x, t(1.0), FP8)).any()


def test_nvfp4_hand_computed():
    # global amax 2688 = 448 * 6 -> global scale 1; block amax 6 -> block scale 1
    block = t(0, 0.25, 0.3, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, -6, -0.2, 4.4, 6)
    want = t(0, 0, 0.5, 1, 1, 1.5, 2, 2, 3, 4, 4, 6, -6, -0.0, 4, 6)
    assert torch.equal(fake_quantize(block, t(2688.0), NVFP4), want)
    # global amax 5376 -> global scale 0.5, block scale 0.5 in FP8, effective scale 1: same values
    enc = encode(block[None], t(5376.0), NVFP4)
    assert enc["global_scale"].tolist() == [0.5] and enc["scale"].float().tolist() == [[0.5]]
    assert (
        enc["scale"].dtype == torch.float8_e4m3fn
        and enc["packed"].dtype == torch.uint8
        and enc["packed"].shape == (1, 8)
    )
    # codes: 0 -> 0, 0.5 -> 1, ..., 6 -> 7; sign in bit 3; low nibble first
    assert enc["packed"][0, 0].item() == 0x00 and enc["packed"][0, 1].item() == (2 << 4) | 1
    assert torch.equal(decode(enc, NVFP4)[0], want)
    # a second block with amax 3: block scale 0.5, values step 0.25 near 1
    two = torch.cat([block, block / 2])
    assert torch.equal(fake_quantize(two, t(2688.0), NVFP4), torch.cat([want, want / 2]))


def test_nvfp4_block_scale_is_rounded_to_fp8():
    # block amax 6.375 -> scale 1.0625, not an E4M3 value: rounds (tie to even) to 1.0; 6.375 then saturates at 6
    x = torch.zeros(16)
    x[0], x[1] = 6.375, 3.2
    out = fake_quantize(x, t(2688.0), NVFP4)
    assert out[0].item() == 6.0 and out[1].item() == 3.0
    assert encode(x[None], t(2688.0), NVFP4)["scale"].float().item() == 1.0


def test_zero_amax_does_not_divide_by_zero():
    z = torch.zeros(2, 32)
    for spec in (INT8, INT4, FP8, NVFP4, QuantizerSpec("int4", "group", group_size=16)):
        amax = torch.zeros(Layout(spec, z.shape).amax_shape)
        out = fake_quantize(z, amax, spec)
        assert torch.equal(out, z), spec
        assert torch.isfinite(fake_quantize(torch.ones(2, 32), amax, spec)).all(), spec
    assert nvfp4_global_scale(t(0.0)).tolist() == [1.0]
    assert scales_from_amax(t(0.0), INT8)["scale"].item() == torch.finfo(torch.float32).eps


# ------------------------------------------------------------------------------------------ bounds, dtype, encode


@pytest.mark.parametrize(
    "spec", [QuantizerSpec("int4", "group", group_size=32), QuantizerSpec("int8", "channel", axis=0)]
)
def test_int_round_trip_bound(spec):
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    lay = Layout(spec, w.shape)
    amax = lay.amax_of(w)
    enc = encode(w, amax, spec)
    err = (decode(enc, spec) - w).abs()
    half_step = lay.restore(lay.broadcast(enc["scale"]).expand(lay.arrange(w).shape)) / 2
    assert (err <= half_step * (1 + 1e-6)).all()
    qmax = 7 if spec.format == "int4" else 127
    assert enc["values"].abs().max().item() == qmax  # the max element maps to qmax exactly


def test_nvfp4_round_trip_bound():
    torch.manual_seed(2)
    w = torch.randn(8, 64) * torch.linspace(0.01, 3, 64)
    amax = w.abs().amax().reshape(1)
    enc = encode(w, amax, NVFP4)
    eff = (enc["scale"].float() / enc["global_scale"]).repeat_interleave(16, dim=-1)
    err = (decode(enc, NVFP4) - w).abs()
    assert (err <= eff).all()  # half the largest E2M1 step (2) times the block's effective scale
    assert e2m1_values(e2m1_codes(t(*[0.5 * i for i in range(5)], 3, 4, 6, -6, -0.5))).tolist() == [
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
        -6,
        -0.5,
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "spec",
    [
        INT8,
        QuantizerSpec("int8", "channel", axis=0),
        QuantizerSpec("int4", "group", group_size=16),
        FP8,
        QuantizerSpec("fp8_e4m3", "channel", axis=0),
        NVFP4,
    ],
    ids=str,
)
def test_fake_quantize_equals_decode_of_encode(spec, dtype):
    torch.manual_seed(3)
    w = (torch.randn(12, 48) * 2).to(dtype)
    amax = Layout(spec, w.shape).amax_of(w) * 0.9  # some clipping too
    fq = fake_quantize(w, amax, spec)
    assert fq.dtype == dtype
    assert torch.equal(fq, decode(encode(w, amax, spec), spec, dtype))
    assert torch.equal(fq, fake_quantize(w.float(), amax, spec).to(dtype))  # computed in float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_input_is_quantized_as_its_float32_copy(dtype):
    """bf16 / fp16 inputs give the results of their float32 copy (fake quantization and the encoded codes), for an
    asymmetric range, a 0-dim amax and a per-token dynamic amax as well."""
    torch.manual_seed(5)
    w = (torch.randn(6, 64) * 3).to(dtype)
    asym = QuantizerSpec("int4", "group", group_size=16, symmetric=False)
    lay = Layout(asym, w.shape)
    amax, amin = lay.amax_of(w) * 0.9, -lay.amax_of(-w) * 0.8  # the range [amin, amax], narrowed
    got = fake_quantize(w, amax, asym, amin=amin)
    assert torch.equal(got, fake_quantize(w.float(), amax, asym, amin=amin).to(dtype))
    assert torch.equal(encode(w, amax, asym, amin=amin)["values"], encode(w.float(), amax, asym, amin=amin)["values"])
    zero_dim = w.float().abs().amax() * 0.7  # shape []
    for spec in (INT8, FP8):
        assert torch.equal(fake_quantize(w, zero_dim, spec), fake_quantize(w.float(), zero_dim, spec).to(dtype))
        assert torch.equal(encode(w, zero_dim, spec)["values"], encode(w.float(), zero_dim, spec)["values"])
    token = QuantizerSpec("fp8_e4m3", "token", dynamic=True)
    x = w.reshape(2, 3, 64)
    assert torch.equal(
        fake_quantize(x, Layout(token, x.shape).amax_of(x), token),
        fake_quantize(x.float(), Layout(token, x.shape).amax_of(x), token).to(dtype),
    )


def test_group_size_must_divide():
    with pytest.raises(ValueError, match=r"layers.0.q_proj.*group_size 128 does not divide the last dimension 576"):
        Layout(QuantizerSpec("int4", "group", group_size=128), (64, 576), name="layers.0.q_proj")
    with pytest.raises(ValueError, match="nvfp4 blocks of 16 do not divide"):
        Layout(NVFP4, (8, 40), name="x")


# ------------------------------------------------------------------------------------------ compressed-tensors parity

ct = pytest.importorskip("compressed_tensors")


def _ct_args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kw)


def test_matches_compressed_tensors_fake_quantize():
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq

    torch.manual_seed(4)
    w = torch.randn(16, 256) * 3
    cases = [
        (QuantizerSpec("int8", "channel", axis=0), _ct_args(num_bits=8, type="int", strategy="channel")),
        (QuantizerSpec("int8"), _ct_args(num_bits=8, type="int", strategy="tensor")),
        (
            QuantizerSpec("int4", "group", group_size=128),
            _ct_args(num_bits=4, type="int", strategy="group", group_size=128),
        ),
        (FP8, _ct_args(num_bits=8, type="float", strategy="tensor")),
        (QuantizerSpec("fp8_e4m3", "channel", axis=0), _ct_args(num_bits=8, type="float", strategy="channel")),
    ]
    for spec, args in cases:
        amax = Layout(spec, w.shape).amax_of(w) * 0.95
        scale = scales_from_amax(amax, spec)["scale"]
        assert torch.equal(fake_quantize(w, amax, spec), ct_fq(w, scale, None, args)), spec


def test_matches_compressed_tensors_nvfp4():
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4, unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    torch.manual_seed(5)
    w = torch.randn(8, 64) * torch.logspace(-3, 1, 64)
    w[0, :16] = 0.0  # an all-zero block: its FP8 scale underflows to 0 and becomes 0.125
    w[1, 3] = -1e-4  # rounds to -0.0 (code 8), as compressed-tensors packs it
    args = _ct_args(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn)
    gs = generate_gparam(w.min(), w.max())
    blocks = w.unflatten(-1, (4, 16))
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
    amax = w.abs().amax().reshape(1)
    enc = encode(w, amax, NVFP4)
    assert torch.equal(enc["global_scale"], gs)
    assert torch.equal(enc["scale"].float(), scale)
    assert torch.equal(fake_quantize(w, amax, NVFP4), ct_fq(w, scale, None, args, global_scale=gs))
    assert torch.equal(enc["packed"], quantize_and_pack_fp4(w, scale, global_scale=gs, group_size=16))
    assert torch.equal(
        e2m1_values(torch.stack((enc["packed"] & 15, enc["packed"] >> 4), -1).flatten(-2)),
        unpack_fp4_from_uint8(enc["packed"], 8, 64, torch.float32),
    )


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_int4_matches_compressed_tensors(rows, cols, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
    packed = pack_int4_to_int32(values)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, pack_to_int32(values, 4))
    assert torch.equal(unpack_int4_from_int32(packed, cols), values)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size((rows, cols))), values)


@settings(max_examples=40, deadline=None)
@example(rows=1, cols=8, bits=8, seed=0, transposed=True, wide=False)  # a zero point row: strides (1, 1), no padding
@example(rows=1, cols=16, bits=4, seed=0, transposed=True, wide=False)
@given(rows=st.integers(1, 5), cols=st.integers(1, 40), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16),
       transposed=st.booleans(), wide=st.booleans())  # fmt: skip
def test_pack_to_int32_matches_compressed_tensors(rows, cols, bits, seed, transposed, wide):
    """Weights and zero points (packed transposed: a size-1 dim whose stride is not the row length), int8 values
    and wider integer types holding the same values."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as reference

    from shardcal.quant.formats import pack_to_int32

    g = torch.Generator().manual_seed(seed)
    half = 2 ** (bits - 1)
    values = torch.randint(-half, half, (cols, rows) if transposed else (rows, cols), generator=g, dtype=torch.int8)
    if transposed:
        values = values.T.contiguous()
    ours = pack_to_int32(values.to(torch.int32) if wide else values, bits)
    assert ours.dtype == torch.int32 and torch.equal(ours, reference(values, bits))


def test_pack_fp4_order():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert pack_fp4_to_uint8(codes).tolist() == [[0x21, 0x8F]]
    with pytest.raises(ValueError, match="int8"):
        pack_int4_to_int32(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4_to_int32(torch.full((1, 8), 9, dtype=torch.int8))


# ------------------------------------------------------------------------------------- asymmetric int


def _asymmetric_reference(w: torch.Tensor, group: int, qmin: int, qmax: int) -> torch.Tensor:
    """A plain per-group loop over Python floats rounded to float32 step by step (the documented rule)."""
    import numpy as np

    f32 = np.float32
    rows = []
    for row in w.tolist():
        out = []
        for g0 in range(0, len(row), group):
            vals = [f32(v) for v in row[g0 : g0 + group]]
            hi, lo = max(max(vals), f32(0)), min(min(vals), f32(0))
            s = f32(f32(hi - lo) / f32(qmax - qmin))
            s = s if s != 0 else np.finfo(np.float32).eps
            zp = min(max(f32(qmin) - np.round(f32(lo / s)), qmin), qmax)
            out += [f32(f32(min(max(np.round(f32(v / s)) + zp, qmin), qmax) - zp) * s) for v in vals]
        rows.append(out)
    return torch.tensor(np.array(rows, dtype=np.float32))


@pytest.mark.parametrize("fmt, qmin, qmax", [("int4", -8, 7), ("int8", -128, 127)])
def test_asymmetric_int_matches_a_plain_loop_and_round_trips(fmt, qmin, qmax):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(6, 64, generator=g) * 0.05 + torch.rand(6, 1, generator=g) * 0.1  # off-centre rows
    w[0] = torch.rand(64, generator=g)  # all positive: the range still includes 0
    spec = QuantizerSpec(fmt, "group", group_size=16, symmetric=False)
    hi, lo = Layout(spec, w.shape).range_of(w)
    fq = fake_quantize(w, hi, spec, amin=lo)
    assert torch.equal(fq, _asymmetric_reference(w, 16, qmin, qmax))
    enc = encode(w, hi, spec, amin=lo)
    assert enc["values"].dtype == torch.int8 and enc["zero_point"].dtype == torch.int8
    assert enc["zero_point"].shape == (6, 4) and int(enc["zero_point"][0].min()) == qmin  # min 0: zp at qmin
    assert torch.equal(decode(enc, spec), fq)
    assert torch.equal(fake_quantize(torch.zeros(6, 64), hi, spec, amin=lo), torch.zeros(6, 64))  # zero is exact
    sym = QuantizerSpec(fmt, "group", group_size=16)
    sym_err = (fake_quantize(w, Layout(sym, w.shape).amax_of(w), sym) - w).pow(2).sum()
    assert (fq - w).pow(2).sum() < 0.6 * sym_err  # off-centre groups: the full range of codes is used


def test_asymmetric_int_matches_compressed_tensors_fake_quantize():
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq

    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 256, generator=g) * 3 + 1.0
    spec = QuantizerSpec("int4", "group", group_size=128, symmetric=False)
    hi, lo = Layout(spec, w.shape).range_of(w)
    enc = encode(w, hi, spec, amin=lo)
    args = _ct_args(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False)
    assert torch.equal(fake_quantize(w, hi, spec, amin=lo), ct_fq(w, enc["scale"], enc["zero_point"], args))


def test_a_ragged_last_chunk_of_rows_is_quantized_like_the_others():
    """13 rows of 48: by rows (the fixture's 100 elements) that is chunks of 2 rows and a last one of 1. FP8 per
    channel against its documented formula, asymmetric int4 per group against the plain loop."""
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(13, 48, generator=g) * 2).to(torch.bfloat16)
    fp8 = QuantizerSpec("fp8_e4m3", "channel", axis=0)
    amax = w.float().abs().amax(dim=1, keepdim=True) * 0.9
    codes = (w.float() / (amax / 448)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fake_quantize(w, amax, fp8), (codes.float() * (amax / 448)).to(torch.bfloat16))
    assert torch.equal(encode(w, amax, fp8)["values"].view(torch.uint8), codes.view(torch.uint8))
    asym = QuantizerSpec("int4", "group", group_size=16, symmetric=False)
    hi, lo = Layout(asym, w.shape).range_of(w.float())
    assert torch.equal(fake_quantize(w.float(), hi, asym, amin=lo), _asymmetric_reference(w.float(), 16, -8, 7))


def test_asymmetric_quantizer_needs_its_amin():
    spec = QuantizerSpec("int4", "group", group_size=16, symmetric=False)
    with pytest.raises(ValueError, match="needs its amin"):
        fake_quantize(torch.ones(2, 16), torch.ones(2, 1), spec)


def test_fp8_values_read_by_table_are_the_e4m3_definition():
    from shardcal.quant.formats import fp8_e4m3_to_float32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    sign, exp, man = (codes >> 7).double(), ((codes >> 3) & 15).double(), (codes & 7).double()
    want = torch.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * torch.pow(2.0, exp - 7)) * (1 - 2 * sign)
    want[(exp == 15) & (man == 7)] = float("nan")  # e4m3fn: no infinities, one NaN pattern per sign
    for copies in (1, 100):  # 256 codes by torch's cast, 25,600 by the table
        got = fp8_e4m3_to_float32(codes.repeat(copies).view(torch.float8_e4m3fn))
        assert got.dtype == torch.float32
        assert torch.equal(got.double().nan_to_num(7.0), want.repeat(copies).nan_to_num(7.0))


@pytest.mark.parametrize("nan_code", [0x7F, 0xFF], ids=["positive-nan", "negative-nan"])
def test_fp8_values_from_bits_keep_one_kind_of_nan_alone(nan_code):
    """Each of e4m3fn's two NaN codes found on its own among finite codes, in a tensor long enough for the bit path,
    the rest of the values torch's own cast; and the values / 256 before the scale takes the 256 back."""
    from shardcal.quant.formats import E4M3_BY_HALVES_FACTOR, e4m3_values_over_256, fp8_e4m3_to_float32

    g = torch.Generator().manual_seed(nan_code)
    codes = torch.randint(0, 256, (40_000,), dtype=torch.int32, generator=g).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01
    codes[[5, 17_000, 39_999]] = nan_code
    fp8 = codes.view(torch.float8_e4m3fn)
    want = fp8.float()
    assert want.isnan().sum() == 3
    got = fp8_e4m3_to_float32(fp8)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    over = e4m3_values_over_256(fp8[:256].reshape(16, 16).T, out=torch.empty(16, 16))  # strided codes too
    assert torch.equal((over * E4M3_BY_HALVES_FACTOR).nan_to_num(7.0), want[:256].reshape(16, 16).T.nan_to_num(7.0))


@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0)])
def test_fp8_values_from_bits_of_no_codes(shape):
    """No codes (a weight with no columns, an empty share of rows): nothing to convert, no error; and the published
    FP8 dequantization of a weight without columns gives its empty rows."""
    from shardcal.models.published import BlockFP8
    from shardcal.quant.formats import e4m3_values_over_256

    out = torch.empty(shape)
    assert e4m3_values_over_256(torch.empty(shape, dtype=torch.float8_e4m3fn), out=out) is out
    if len(shape) == 2:
        got = BlockFP8((128, 128)).dequantize(torch.empty(shape, dtype=torch.float8_e4m3fn), torch.ones(1, 1), 0)
        assert got.shape == shape and got.dtype == torch.float32


def test_fp8_rounding_by_table_equals_torch_cast():
    from shardcal.quant.formats import round_to_fp8_e4m3

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(40_000, generator=g) * 100, torch.randn(10_000, generator=g) * 1e-3]).clamp(-448, 448)
    assert torch.equal(round_to_fp8_e4m3(x), x.to(torch.float8_e4m3fn).float())


def test_e2m1_rounding_ties_signs_and_nan():
    # ties go to the even neighbour (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
    # a small negative keeps its sign (-0.0, code 8, as compressed-tensors' cast_to_fp4 gives), -0.0 and NaN give 0.0
    x = t(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.75, -5.0, 0.26, 2.51, -0.1, -0.0, 0.0, float("nan"), 6.0)
    want = t(0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0, 0.5, 3.0, -0.0, 0.0, 0.0, 0.0, 6.0)
    got = round_e2m1(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit: the sign of zero counts
    assert torch.equal(x[:2], t(0.25, 0.75))  # the input is left as it was
    assert e2m1_codes(got[12:14]).tolist() == [8, 0]
    in_place = x.clone()
    assert round_e2m1_(in_place) is in_place and torch.equal(in_place.view(torch.int32), want.view(torch.int32))


def test_nvfp4_fake_quant_is_the_same_under_autograd():
    torch.manual_seed(4)
    w = torch.randn(4, 64) * 2
    w[0, :3] = torch.tensor([-0.0, -1e-6, 0.0])
    amax = w.abs().amax().reshape(1)
    plain = fake_quantize(w, amax, NVFP4)  # in place on its own buffer
    leaf = w.clone().requires_grad_(True)
    tracked = fake_quantize(leaf, amax, NVFP4)  # new tensors: autograd refuses out= and in-place sign copies
    assert torch.equal(plain.view(torch.int32), tracked.detach().view(torch.int32))
    tracked.sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


# ------------------------------------------------------------------------------------------- FP8 block


def _fp8_block_by_loop(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 per block of ``rows x cols``, block by block: (the dequantized weight, the scales)."""
    out = torch.empty_like(w)
    scales = torch.empty(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            s = block.abs().max() / 448
            scales[i, j] = s
            out[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (block / s).to(torch.float8_e4m3fn).float() * s
    return out, scales


@pytest.mark.parametrize("shape", [(600, 300), (256, 384), (100, 130)])
def test_fp8_block_weights_are_the_per_block_loop(shape):
    """Block scales of a weight large enough to be quantized in row chunks otherwise (600 x 300), exact multiples,
    and smaller than a block (100 x 130): fake quantization, encode and decode equal a plain loop over the blocks."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3.0, shape[1])
    spec = QuantizerSpec(format="fp8_e4m3", granularity="block", block_size=(128, 64))
    q = TensorQuantizer(spec, shape)
    q.calibrate_from(w)
    want, scales = _fp8_block_by_loop(w, 128, 64)
    assert torch.equal(q.amax / 448, scales)
    assert torch.equal(q(w), want)
    enc = q.encode(w)
    assert enc["values"].dtype == torch.float8_e4m3fn and enc["values"].shape == shape
    assert torch.equal(enc["scale"], scales) and torch.equal(decode(enc, spec), want)
    assert torch.equal(q(w.to(torch.bfloat16)), fake_quantize(w.to(torch.bfloat16), q.amax, spec))


def test_fp8_group_inputs_take_each_tokens_groups_at_run_time():
    """A dynamic per-group input (FP8 block's activations): each token's groups of 128 get their own amax / 448."""
    spec = QuantizerSpec(format="fp8_e4m3", granularity="group", group_size=128, dynamic=True)
    q = TensorQuantizer(spec, (384,))
    x = torch.randn(2, 7, 384, generator=torch.Generator().manual_seed(1))
    x[0, 3, 200] = 40.0  # one outlier: only its own token's second group is coarser
    want = torch.empty_like(x)
    for g in range(3):
        part = x[..., g * 128 : (g + 1) * 128]
        s = part.abs().amax(-1, keepdim=True) / 448
        want[..., g * 128 : (g + 1) * 128] = (part / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(q(x), want)
    assert spec.describe() == "fp8_e4m3, groups of 128 per token, dynamic"


def test_block_specs_refuse_what_they_cannot_be():
    from shardcal.runtime.params import SpecError

    for kwargs in (
        {"block_size": (128,)},
        {"block_size": (0, 128)},
        {"block_size": None},
        {"block_size": (128, 128), "dynamic": True},
    ):
        with pytest.raises(SpecError):
            QuantizerSpec(format="fp8_e4m3", granularity="block", **kwargs)
    with pytest.raises(SpecError, match="only valid with granularity 'block'"):
        QuantizerSpec(format="fp8_e4m3", granularity="channel", axis=0, block_size=(128, 128))
    spec = QuantizerSpec(format="fp8_e4m3", granularity="block", block_size=[128, 64])
    assert spec.block_size == (128, 64) and QuantizerSpec.from_dict(spec.to_dict()) == spec
    assert "block_size" not in QuantizerSpec(format="int8").to_dict()  # other specs' dicts unchanged


# ------------------------------------------------------------------------------------------- MX


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_weights_are_compressed_tensors_own(fmt):
    """MXFP4 / MXFP8 weights: compressed-tensors' own qparams and fake quantization of the same weight give our
    values and scales (its E8M0 exponents); rows with zeros, tiny and huge blocks, and a block amax of exactly 1.75
    times a power of two (where the power rounds up) included."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = preset_name_to_scheme(fmt.upper(), ["Linear"]).weights
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(3)) * torch.logspace(-30, 30, 512)
    w[3, :32] = 0.0
    w[5, 32:64] = 1.75 * 2.0**-3
    w[6, 64:96] = 1.7499 * 2.0**-3
    spec = QuantizerSpec(format=fmt)
    q = TensorQuantizer(spec, w.shape)
    q.calibrate_from(w)
    blocks = w.unflatten(-1, (16, 32))
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    assert torch.equal(q(w), ct_fq(w, scale, zp, args))
    enc = q.encode(w)
    assert enc["scale"].dtype == torch.uint8 and torch.equal(
        torch.ldexp(torch.ones(()), enc["scale"].int() - 127), scale
    )
    assert torch.equal(decode(enc, spec), q(w))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_inputs_take_each_tokens_blocks_at_run_time(fmt):
    """Dynamic MX inputs: each token's blocks of 32 get their own power of two, as compressed-tensors' dynamic
    per-group quantization computes it for that token alone."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = preset_name_to_scheme(fmt.upper(), ["Linear"]).input_activations
    x = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(4)) * 5
    q = TensorQuantizer(QuantizerSpec(format=fmt, dynamic=True), (128,))
    ours = q(x)
    for b in range(3):
        for t in range(4):
            row = x[b, t : t + 1]
            blocks = row.unflatten(-1, (4, 32))
            scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
            assert torch.equal(ours[b, t : t + 1], ct_fq(row, scale, zp, args)), (b, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int4", "fp8_e4m3", "nvfp4"])
def test_fake_quantize_into_out_and_in_place(fmt, dtype):
    """``out=`` gets what the plain call returns, also when ``out`` is ``x`` itself (how fused experts store their
    quantized weights); an ``out`` of another shape or dtype is refused."""
    spec = QuantizerSpec(fmt, "group", group_size=16) if fmt == "int4" else QuantizerSpec(fmt)
    w = (torch.randn(24, 64, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    amax = Layout(spec, w.shape).amax_of(w) * 0.9
    want = fake_quantize(w, amax, spec)
    out = torch.full_like(w, float("nan"))
    assert fake_quantize(w, amax, spec, out=out) is out and torch.equal(out, want)
    same = w.clone()
    assert fake_quantize(same, amax, spec, out=same) is same and torch.equal(same, want)
    with pytest.raises(ValueError, match="out= must be"):
        fake_quantize(w, amax, spec, out=torch.empty(24, 63, dtype=dtype))
    with pytest.raises(ValueError, match="out= must be"):
        fake_quantize(w, amax, spec, out=torch.empty(24, 64, dtype=torch.float16))


def test_chunk_buffers_are_reused_and_never_shared_between_results():
    """Consecutive tensors reuse this thread's chunk buffers: no result aliases them (a later call leaves an earlier
    result as it was), a thread keeps a few, and none larger than two chunks."""
    from shardcal.quant import formats

    spec = QuantizerSpec("fp8_e4m3", "channel", axis=0)
    first = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))  # by rows at either chunk size
    second = torch.randn(300, 256, generator=torch.Generator().manual_seed(2)) * 7
    a = fake_quantize(first, Layout(spec, first.shape).amax_of(first), spec)
    kept = a.clone()
    e = encode(first, Layout(spec, first.shape).amax_of(first), spec)
    codes = e["values"].clone()
    fake_quantize(second, Layout(spec, second.shape).amax_of(second), spec)
    encode(second, Layout(spec, second.shape).amax_of(second), spec)
    assert torch.equal(a, kept) and torch.equal(e["values"].view(torch.uint8), codes.view(torch.uint8))
    pool = formats._SCRATCH.free
    assert 0 < len(pool) <= formats._SCRATCH_KEPT and all(b.numel() <= 2 * formats.CPU_CHUNK_ELEMENTS for b in pool)
    huge = torch.randn(3, 3 * formats.CPU_CHUNK_ELEMENTS)  # one row is a chunk: its buffer is freed after
    fake_quantize(huge, Layout(spec, huge.shape).amax_of(huge), spec)
    assert all(b.numel() <= 2 * formats.CPU_CHUNK_ELEMENTS for b in pool)


def test_threads_quantize_with_their_own_chunk_buffers():
    """Two threads quantizing at once (a reader thread beside the calibrating one) each get the values one thread
    alone computes."""
    import threading

    spec = QuantizerSpec("int4", "group", group_size=32)
    tensors = [torch.randn(64, 256, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    amax = [Layout(spec, w.shape).amax_of(w) for w in tensors]
    want = [fake_quantize(w, a, spec) for w, a in zip(tensors, amax)]
    bad = []

    def run(i: int) -> None:
        for _ in range(30):
            bad.append(not torch.equal(fake_quantize(tensors[i], amax[i], spec), want[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bad) == 60 and not any(bad)


def test_int4_packing_refuses_one_value_out_of_range_and_keeps_each_result():
    """One code of 8 or -9 among valid ones is refused; a packed result is not overwritten by the next packing (whose
    temporaries reuse this thread's buffers)."""
    g = torch.Generator().manual_seed(3)
    for bad in (8, -9):
        values = torch.randint(-8, 8, (4, 16), generator=g, dtype=torch.int8)
        values[2, 5] = bad
        with pytest.raises(ValueError, match=r"int4 values must lie in \[-8, 7\]"):
            pack_int4_to_int32(values)
    first = pack_int4_to_int32(torch.randint(-8, 8, (64, 128), generator=g, dtype=torch.int8))
    kept = first.clone()
    second = pack_int4_to_int32(torch.randint(-8, 8, (64, 128), generator=g, dtype=torch.int8))
    assert torch.equal(first, kept) and not torch.equal(first, second)


def test_a_thread_never_gets_another_threads_chunk_buffers():
    """A buffer a thread frees goes back to that thread's pool only: the pool of the thread that looks is unchanged."""
    import threading

    from shardcal.quant import formats

    spec = QuantizerSpec("int8", "channel", axis=0)
    w = torch.randn(1400, 50, generator=torch.Generator().manual_seed(8))  # by rows, pooled, at either chunk size
    fake_quantize(w, Layout(spec, w.shape).amax_of(w), spec)
    mine = [id(b) for b in formats._SCRATCH.free]
    theirs: list[int] = []

    def quantize() -> None:
        fake_quantize(w * 2, Layout(spec, w.shape).amax_of(w * 2), spec)
        theirs.extend(id(b) for b in formats._SCRATCH.free)

    thread = threading.Thread(target=quantize)
    thread.start()
    thread.join()
    assert theirs and [id(b) for b in formats._SCRATCH.free] == mine and not set(theirs) & set(mine)
