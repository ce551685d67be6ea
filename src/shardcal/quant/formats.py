"""Number formats: fake quantization (quantize-dequantize) and the real encodings export writes.

Conventions follow compressed-tensors (the checkpoint format vLLM loads); every function here is exact and
deterministic, computed in float32 whatever the input dtype, and fake quantization returns the input's dtype:

- ``int8`` / ``int4`` (symmetric): ``scale = amax / qmax`` (qmax 127 / 7), ``q = clamp(round(x / scale), qmin,
  qmax)`` with qmin -128 / -8 and round-half-to-even (``torch.round``), ``x_hat = q * scale``.
- ``int8`` / ``int4`` asymmetric (weights): the range ``[lo, hi] = [min(amin, 0), max(amax, 0)]`` per slot gives
  ``scale = (hi - lo) / (qmax - qmin)`` and the zero point ``zp = clamp(qmin - round(lo / scale), qmin, qmax)``
  (compressed-tensors' rule, zero points in the signed range); ``q = clamp(round(x / scale) + zp, qmin, qmax)``,
  ``x_hat = (q - zp) * scale``. Zero is represented exactly.
- ``fp8_e4m3``: ``scale = amax / 448``, ``q = float8_e4m3fn(clamp(x / scale, -448, 448))`` (torch's round to
  nearest even; the clamp saturates instead of overflowing to NaN), ``x_hat = q * scale``.
- ``nvfp4``: E2M1 values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) in blocks of 16 along the last dim.
  ``global_scale = 448 * 6 / amax`` (float32; the calibrated amax is per tensor), each block's scale
  ``s = float8_e4m3fn(global_scale * block_amax / 6)`` (block amax taken at run time), effective scale
  ``s / global_scale``, values rounded to the nearest E2M1 value (ties to even), saturating at ±6.
- ``mxfp4`` / ``mxfp8`` (OCP microscaling): E2M1 / E4M3 values in blocks of 32 along the last dim, each block with a
  power-of-two scale ``2 ** (e - 127)`` stored as its E8M0 exponent ``e`` (uint8). compressed-tensors' rule:
  the block amax rounded to a power of two ``p`` (up where its mantissa is at least 1.75, else down), then
  ``e = 127 + log2(p) - k`` with ``k = floor(log2(element max))`` (2 for E2M1's 6, 8 for E4M3's 448), clamped to
  [0, 255]; values ``x / 2 ** (e - 127)`` rounded as E2M1 (saturating at ±6) or E4M3 (at ±448). Weights' block
  amax are calibrated per block; inputs take theirs per token at run time.

A zero scale (amax 0) is replaced by the smallest step of its dtype (float32 eps; 0.125 for FP8 block scales) as
compressed-tensors does, so nothing divides by zero; an all-zero tensor stays all-zero.

``fake_quantize(x, amax, spec) == decode(encode(x, amax, spec), spec, x.dtype)`` bit for bit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from .granularity import Layout
from .spec import NVFP4_BLOCK_SIZE, QuantizerSpec

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_F32_EPS = torch.finfo(torch.float32).eps
_F32_TINY = torch.finfo(torch.float32).tiny
_FP8_SCALE_EPS = 0.125  # compressed-tensors' replacement for a zero FP8 scale
#: The eight non-negative E2M1 magnitudes, by code (bit 3 of a code is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class Format:
    """A number format's range: ``kind`` is ``"int"``, ``"fp8"`` or ``"nvfp4"``; ``qmax`` maps amax to scale."""

    name: str
    kind: str
    bits: int
    qmin: float
    qmax: float


FORMATS: dict[str, Format] = {
    "int8": Format("int8", "int", 8, -128.0, 127.0),
    "int4": Format("int4", "int", 4, -8.0, 7.0),
    "fp8_e4m3": Format("fp8_e4m3", "fp8", 8, -E4M3_MAX, E4M3_MAX),
    "nvfp4": Format("nvfp4", "nvfp4", 4, -E2M1_MAX, E2M1_MAX),
    "mxfp4": Format("mxfp4", "mx", 4, -E2M1_MAX, E2M1_MAX),
    "mxfp8": Format("mxfp8", "mx", 8, -E4M3_MAX, E4M3_MAX),
}
#: ``floor(log2(element max))`` of each MX format's values: the block amax's power of two maps to ``2 ** k``.
MX_ELEMENT_EXPONENT = {"mxfp4": 2, "mxfp8": 8}


def _fp8_valued(fmt: str) -> bool:
    """Whether ``fmt``'s values are float8_e4m3fn (fp8_e4m3, mxfp8)."""
    return fmt in ("fp8_e4m3", "mxfp8")


# ----------------------------------------------------------------------------------------------- scales


#: Below this many elements (or off the CPU) fp8 values are converted by torch's own cast.
_E4M3_BITS_MIN_ELEMENTS = 1 << 14
#: :func:`e4m3_values_over_256` gives each value divided by this; a scale the values are multiplied by takes it back.
E4M3_BY_HALVES_FACTOR = 256.0
_E4M3_SIGNED_BITS = 0x3F80 - (1 << 15)  # bits 13 - 7 and the sign bit (0xBF80), as an int16


def e4m3_values_over_256(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The values of float8_e4m3fn ``codes`` (that dtype, or their bytes as uint8; on the CPU) divided by 256
    (:data:`E4M3_BY_HALVES_FACTOR`), exactly, written into float32 ``out`` of their shape: each code's sign, exponent
    and mantissa bits moved to a float16's, whose exponent bias is 8 above e4m3's (subnormals included), then widened
    by torch's vectorised float16 conversion; the NaN codes give NaN. Several times faster than converting e4m3
    itself, which torch does element by element on the CPU. Multiplying by a power of two is exact, so a scale the
    values are multiplied by anyway can take the 256 back without changing a result."""
    if out.shape != codes.shape or out.dtype != torch.float32:
        raise ValueError(f"e4m3 values out= must be {list(codes.shape)} float32, got {list(out.shape)} {out.dtype}")
    if codes.numel() == 0:
        return out
    signed, unsigned = codes.view(torch.int8), codes.view(torch.uint8)
    # e4m3fn's NaN codes (exponent and mantissa all ones): 0x7F, the largest as int8, and 0xFF, the largest as uint8
    nan = signed.max().item() == 0x7F or unsigned.max().item() == 0xFF
    nan_at = unsigned.bitwise_and(0x7F) == 0x7F if nan else None
    with _scratch(codes.numel(), torch.int16) as halves:
        halves = halves.view(codes.shape)
        # sign-extended, shifted by 7: the sign in bit 15 (and 14, cleared), exponent and mantissa in bits 13 - 7
        halves.copy_(signed).bitwise_left_shift_(7).bitwise_and_(_E4M3_SIGNED_BITS)
        out.copy_(halves.view(torch.float16))
    if nan_at is not None:
        out.masked_fill_(nan_at, float("nan"))
    return out


def fp8_e4m3_to_float32(t: torch.Tensor) -> torch.Tensor:
    """The float32 values of a float8_e4m3fn tensor, the same as ``t.float()``: on the CPU, a large tensor's through
    :func:`e4m3_values_over_256` (faster than torch's cast there)."""
    if t.device.type != "cpu" or t.numel() < _E4M3_BITS_MIN_ELEMENTS:
        return t.float()
    return e4m3_values_over_256(t, torch.empty(t.shape, dtype=torch.float32)).mul_(E4M3_BY_HALVES_FACTOR)


def round_to_fp8_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` (within +-448) rounded to the nearest float8_e4m3fn value (ties to even), in float32."""
    return fp8_e4m3_to_float32(t.to(torch.float8_e4m3fn))


def mx_exponents(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The E8M0 exponents (int32, 0..255, bias 127) of MX block amax values (compressed-tensors' rule, see the module
    docstring): the float32 amax's bits plus half of its mantissa's top-two-bits step, masked to the exponent field
    (a power of two, rounded up from a mantissa of 1.75), minus the element format's ``k``."""
    bits = amax.float().abs().view(torch.int32)
    rounded = (bits + (1 << 21)) & 0x7F800000
    return ((rounded >> 23) - MX_ELEMENT_EXPONENT[fmt]).clamp_(0, 255)


def mx_scales_of_exponents(exponents: torch.Tensor) -> torch.Tensor:
    """``2 ** (e - 127)`` (float32, exact) of E8M0 exponents."""
    return torch.ldexp(
        torch.ones(exponents.shape, dtype=torch.float32, device=exponents.device), exponents.to(torch.int32) - 127
    )


def scale_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """int / fp8 scale ``amax / qmax`` in float32, a zero scale replaced by float32 eps; MX: the block's power of
    two (:func:`mx_exponents`)."""
    f = FORMATS[fmt]
    if f.kind == "mx":
        return mx_scales_of_exponents(mx_exponents(amax, fmt))
    if f.kind == "nvfp4":
        raise ValueError("nvfp4 has a global scale and per-block scales: use nvfp4_global_scale / nvfp4_block_scales")
    scale = amax.float() / f.qmax
    return torch.where(scale == 0, torch.full_like(scale, _F32_EPS), scale)


def asymmetric_qparams(amax: torch.Tensor, amin: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` (float32; the zero point holds integers) of an int format's range ``[amin, amax]``
    (widened to include 0), a zero scale replaced by float32 eps."""
    f = FORMATS[fmt]
    if f.kind != "int":
        raise ValueError(f"asymmetric quantization needs an int format, got {fmt!r}")
    hi = torch.clamp(amax.float(), min=0.0)
    lo = torch.clamp(amin.float(), max=0.0)
    scale = (hi - lo) / (f.qmax - f.qmin)
    scale = torch.where(scale == 0, torch.full_like(scale, _F32_EPS), scale)
    zero_point = torch.clamp(f.qmin - torch.round(lo / scale), f.qmin, f.qmax)
    return scale, zero_point


def qparams(amax: torch.Tensor, amin: torch.Tensor | None, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, zero point or None)`` of an int / fp8 amax (and, asymmetric, an amin)."""
    if amin is None:
        return scale_from_amax(amax, fmt), None
    return asymmetric_qparams(amax, amin, fmt)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax`` (float32, shape [1]); 1.0 where amax is 0 or not finite (compressed-tensors' rule)."""
    a = torch.clamp(amax.float().reshape(-1)[:1], min=_F32_TINY)
    gs = (E4M3_MAX * E2M1_MAX) / a
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def nvfp4_block_scales(xb: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8-representable block scales (float32, ``[..., n_blocks, 1]``) of float32 blocks ``xb`` ``[..., n_blocks, 16]``."""
    return _block_scales(xb.abs().amax(dim=-1, keepdim=True), global_scale)


def _block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    s = global_scale * (block_amax / E2M1_MAX)
    s = round_to_fp8_e4m3(torch.clamp(s, -E4M3_MAX, E4M3_MAX))
    return torch.where(s == 0, torch.full_like(s, _FP8_SCALE_EPS), s)


# ----------------------------------------------------------------------------------------------- E2M1


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values already clamped to [-6, 6] to the nearest E2M1 value, ties to even (a new tensor).

    Same values as compressed-tensors' ``cast_to_fp4`` thresholds and sign handling (a small negative rounds to
    -0.0, -0.0 and NaN give 0.0). The E2M1 step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on, i.e. ``2 ** (e - 1)``
    for ``|x|``'s binary exponent ``e`` taken at least 0: adding ``c = step * 2 ** 23`` (whose float32 ulp is
    that step) rounds ``|x|`` to a multiple of its step, ties to even, and subtracting ``c`` again is exact.
    Differentiable as the identity on ``x`` (autograd sees ``|x| + c - c`` times ``sign(x)``).
    """
    a = x.abs()
    c = _e2m1_rounding_constant(a)
    return a.add_(c).sub_(c).mul_(torch.sign(x)).nan_to_num_(nan=0.0)  # torch.sign(NaN) = 0: NaN -> 0.0


def round_e2m1_(x: torch.Tensor) -> torch.Tensor:
    """:func:`round_e2m1` in place on ``x`` (float32; not under autograd): one temporary instead of three. ``c`` carries
    ``x``'s sign, so ``x + c - c`` rounds the magnitude (round to nearest even is symmetric), and the sign is put
    back from ``c`` at the end (a result of 0 keeps it: -0.0); ``x + 0.0`` first turns -0.0 into 0.0."""
    x.add_(0.0)
    c = _e2m1_rounding_constant(x).copysign_(x)
    return x.add_(c).sub_(c).copysign_(c).nan_to_num_(nan=0.0)  # NaN stays NaN through the steps: -> 0.0


def _e2m1_rounding_constant(x: torch.Tensor) -> torch.Tensor:
    """``c = step * 2 ** 23`` for each element of float32 ``x`` (a new tensor, positive; ``x``'s sign is ignored):
    ``2 ** (e + 22)``, the exponent bits of ``|x|`` in place, at least 127 (2 ** 0: the step is >= 0.5), plus 22."""
    return (x.view(torch.int32) & 0x7F800000).clamp_(min=127 << 23).add_(22 << 23).view(torch.float32)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of E2M1 values: magnitude index in bits 0-2, sign (``signbit``) in bit 3."""
    a = q.abs()
    idx = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for i, v in enumerate(E2M1_VALUES[1:], start=1):
        idx = torch.where(a == v, torch.tensor(i, dtype=torch.uint8, device=q.device), idx)
    return idx | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x07).long()]
    return mag * torch.where((codes & 0x08).bool(), -1.0, 1.0)


def pack_fp4_to_uint8(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2k in the low nibble, 2k+1 in the high nibble
    (compressed-tensors' ``pack_fp4_to_uint8`` order)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nvfp4 packing needs an even last dimension, got shape {list(codes.shape)}")
    pairs = codes.to(torch.uint8).unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4_from_uint8(packed: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) from :func:`pack_fp4_to_uint8`'s bytes; the last dim doubles."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------- int4 packing


def pack_int4_to_int32(values: torch.Tensor) -> torch.Tensor:
    """Pack int4 values (int8 in [-8, 7]) eight per int32 along the last dim, as compressed-tensors'
    ``pack_to_int32(values, num_bits=4, packed_dim=1)``: each value offset by +8, element ``8k + j`` in bits
    ``4j .. 4j+3`` of word ``k``; a last dim that is not a multiple of 8 is padded with zero nibbles."""
    if values.dtype != torch.int8:
        raise ValueError(f"pack_int4_to_int32 needs int8 values, got {values.dtype}")
    if values.ndim == 0:
        raise ValueError("pack_int4_to_int32 needs at least one dimension")
    lo, hi = torch.aminmax(values) if values.numel() else (0, 0)
    if int(lo) < -8 or int(hi) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    return pack_to_int32(values, 4)


def pack_to_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32(values, bits)``: ``32 // bits`` values per int32 along the last dim,
    each offset by ``2 ** (bits - 1)``, element ``k * per + j`` in bits ``bits*j ..`` of word ``k``; the last dim
    is zero-padded to a whole word. Callers check the value range."""
    per = 32 // bits
    n = values.shape[-1]
    words = -(-n // per)
    if bits in (4, 8) and sys.byteorder == "little":
        return _pack_bytes_to_int32(values, bits, words * per - n)
    v = values.to(torch.int64) + 2 ** (bits - 1)
    if words * per != n:
        v = torch.nn.functional.pad(v, (0, words * per - n))
    v = v.unflatten(-1, (words, per))
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    packed = (v << shifts).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).contiguous()


def _pack_bytes_to_int32(values: torch.Tensor, bits: int, pad: int) -> torch.Tensor:
    """:func:`pack_to_int32` for 4 and 8 bits, in bytes: the offset codes as uint8, two nibbles a byte (the first
    value low), the bytes read as little-endian int32 words — the same bits, without a 64-bit copy of the tensor."""
    if bits == 4 and values.dtype == torch.int8 and not pad and values.is_contiguous() and values.device.type == "cpu":
        return _pack_int4_bytes(values)
    if values.dtype == torch.int8:  # + 2**(bits-1) modulo 256: the offset codes' bits, read as uint8
        v = (values + 8).view(torch.uint8) if bits == 4 else values.view(torch.uint8) ^ 0x80
    else:
        v = (values.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    if bits == 4:  # flat first: a size-1 dim's stride may be anything
        v = _nibble_pairs(v.contiguous().reshape(-1)).reshape(*v.shape[:-1], v.shape[-1] // 2)
    words = v.contiguous().reshape(-1).view(torch.int32)  # flat first: a size-1 dim's stride may be anything
    return words.reshape(*v.shape[:-1], v.shape[-1] // 4)


def _pack_int4_bytes(values: torch.Tensor) -> torch.Tensor:
    """:func:`_pack_bytes_to_int32` of contiguous int8 CPU values, a last dim of whole words: the same steps, the
    temporaries in this thread's reused buffers (an MoE layer packs hundreds of expert slices)."""
    with _scratch(values.numel(), torch.uint8) as codes:
        torch.add(values.reshape(-1), 8, out=codes.view(torch.int8))  # the offset codes' bits, modulo 256
        packed = _nibble_pairs(codes)
    return packed.view(torch.int32).reshape(*values.shape[:-1], values.shape[-1] // 8)


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (flat uint8, an even count) two a byte, the first low, in a new tensor: each pair read as one
    little-endian int16, ``lo | hi << 8``, whose low byte is ``lo | hi << 4`` (on CPU the shifted copy in this
    thread's reused buffer)."""
    pairs = codes.view(torch.int16)
    if pairs.device.type != "cpu":
        return (pairs | (pairs >> 4)).to(torch.uint8)
    with _scratch(pairs.numel(), torch.int16) as shifted:
        return torch.bitwise_right_shift(pairs, 4, out=shifted).bitwise_or_(pairs).to(torch.uint8)


def unpack_int4_from_int32(packed: torch.Tensor, last_dim: int) -> torch.Tensor:
    """int8 values in [-8, 7] from :func:`pack_int4_to_int32`'s words; ``last_dim`` is the unpacked size."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4_from_int32 needs int32 words, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.flatten(-2)[..., :last_dim] - 8).to(torch.int8)


# ----------------------------------------------------------------------------------------------- core


def _nvfp4_blocks(a: torch.Tensor) -> torch.Tensor:
    if a.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"nvfp4 needs a last dimension divisible by {NVFP4_BLOCK_SIZE}, got shape {list(a.shape)}")
    return a.unflatten(-1, (a.shape[-1] // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE))


def _quantize_arranged(
    a: torch.Tensor, amax_b: torch.Tensor, fmt: str, amin_b: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Quantize a float32 arranged tensor; ``amax_b`` (and, asymmetric, ``amin_b``) broadcast against it. Values
    stay float32 here, ``q`` is a new tensor (each step after the division works on it in place) and ``q * eff``
    is the dequantized tensor; an asymmetric result also has ``zp`` (the stored codes are ``q + zp``:
    ``clamp(round(x / s), qmin - zp, qmax - zp) + zp`` equals ``clamp(round(x / s) + zp, qmin, qmax)`` exactly,
    small integers in float32, with two full-size operations fewer)."""
    if FORMATS[fmt].kind == "nvfp4" and amin_b is None:
        gs = nvfp4_global_scale(amax_b)
        xb = _nvfp4_blocks(a)
        q = torch.abs(xb)  # |x| for the block amax, then the scaled values, rounded in place: one full-size buffer
        s = _block_scales(q.amax(dim=-1, keepdim=True), gs)
        eff = (s / gs).expand(xb.shape).contiguous()  # full size: dividing by a 16-wide broadcast is much slower
        if q.requires_grad:  # under autograd: new tensors (autograd refuses out= and needs x for sign's gradient)
            q = round_e2m1(torch.clamp(xb / eff, -E2M1_MAX, E2M1_MAX))
        else:
            round_e2m1_(torch.div(xb, eff, out=q).clamp_(-E2M1_MAX, E2M1_MAX))
        return {"q": q, "eff": eff, "block_scale": s, "global_scale": gs}
    q, scale, zp = _scaled(a, amax_b, fmt, amin_b)
    if _fp8_valued(fmt):
        q = fp8_e4m3_to_float32(q.to(torch.float8_e4m3fn))
    return {"q": q, "eff": scale} if zp is None else {"q": q, "eff": scale, "zp": zp}


def _scaled(
    a: torch.Tensor, amax_b: torch.Tensor, fmt: str, amin_b: torch.Tensor | None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, zero point or None)`` of an int / fp8 / MX format: ``q = a / scale`` (a new tensor, or ``out``,
    which may be ``a`` itself), then rounded and clamped in place (fp8 and mxfp8: clamped to +-448, ready for the
    cast, which rounds to nearest even; mxfp4: rounded to E2M1)."""
    f = FORMATS[fmt]
    scale, zp = qparams(amax_b, amin_b, fmt)
    q = a / scale if out is None else torch.div(a, scale, out=out)
    if zp is not None:
        q.round_().clamp_(f.qmin - zp, f.qmax - zp)
    elif f.kind == "int":
        q.clamp_(f.qmin, f.qmax).round_()
    elif fmt == "mxfp4":
        round_e2m1_(q.clamp_(-E2M1_MAX, E2M1_MAX))
    else:
        q.clamp_(-E4M3_MAX, E4M3_MAX)
    return q, scale, zp


def qdq_arranged(a: torch.Tensor, amax_b: torch.Tensor, fmt: str, amin_b: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize a float32 arranged tensor (observers score candidate amax values with this); ``amin_b``
    makes it asymmetric."""
    r = _quantize_arranged(a, amax_b, fmt, amin_b)
    out = r["q"].mul_(r["eff"])  # q is _quantize_arranged's own new tensor
    return out.flatten(-2) if FORMATS[fmt].kind == "nvfp4" else out


def _layout(spec: QuantizerSpec, x: torch.Tensor, layout: Layout | None) -> Layout:
    return layout if layout is not None else Layout(spec, tuple(x.shape))


def _broadcast_range(
    lay: Layout, x: torch.Tensor, spec: QuantizerSpec, amax: torch.Tensor, amin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``amax`` (and ``amin``, which an asymmetric spec needs and a symmetric one ignores) on ``x``'s device,
    shaped to broadcast against the arranged ``x``."""
    amax_b = lay.broadcast(amax.to(device=x.device, dtype=torch.float32))
    if spec.symmetric:
        return amax_b, None
    if amin is None:
        raise ValueError(f"{lay.name}: an asymmetric quantizer needs its amin as well as its amax")
    return amax_b, lay.broadcast(amin.to(device=x.device, dtype=torch.float32))


#: A CPU tensor is quantized this many elements (whole rows) at a time, in buffers its thread reuses from one tensor
#: to the next (:func:`_scratch`): its float32 temporaries stay a few MB instead of several copies of the tensor, no
#: block is mapped and faulted in anew per tensor or step (see ``runtime.hostmem``: an MoE layer quantizes hundreds
#: of expert slices), and each chunk is large enough that the per-step call overhead does not dominate. The same
#: operations per element: the same bits.
CPU_CHUNK_ELEMENTS = 1 << 20


def _by_rows(x: torch.Tensor, amax_b: torch.Tensor, amin_b: torch.Tensor | None) -> bool:
    """Whether ``x`` is quantized in chunks of rows: a CPU tensor outside autograd, of at least 1/16 of a chunk
    (smaller temporaries come from the allocator's heap, which reuses them anyway)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, amax_b, amin_b))
    return x.device.type == "cpu" and x.dim() >= 2 and x.numel() >= CPU_CHUNK_ELEMENTS // 16 and not grad


class _ScratchPool(threading.local):
    """Each thread's free chunk buffers (a thread quantizes one tensor at a time; nested users take their own)."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []


_SCRATCH = _ScratchPool()
_SCRATCH_KEPT = 6  # a thread keeps: a chunk's float32 values, its FP8 codes and halves, int4 packing's two, a spare


@contextmanager
def _scratch(numel: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """A 1-D CPU buffer of ``numel`` elements of ``dtype``, uninitialised, reused by this thread's next chunks: a
    buffer of at most two chunks goes back to the thread's pool after use (larger ones are freed)."""
    pool = _SCRATCH.free
    at = next((i for i, b in enumerate(pool) if b.dtype == dtype and b.numel() >= numel), None)
    found = torch.empty(numel, dtype=dtype) if at is None else pool.pop(at)
    try:
        yield found[:numel]
    finally:
        if found.numel() <= 2 * CPU_CHUNK_ELEMENTS:
            pool.append(found)
            del pool[:-_SCRATCH_KEPT]


def _row_chunks(
    x: torch.Tensor, lay: Layout, amax_b: torch.Tensor, amin_b: torch.Tensor | None
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``(rows, a, amax, amin)`` per chunk of ``x``'s leading dim: ``a`` is the chunk in float32, arranged, in a
    buffer every chunk reuses (its results may be computed in it); a range with one value per leading index is
    sliced with the chunk, one that broadcasts over that dim is shared."""
    arranged_dims = x.dim() + (1 if lay.group_size is not None else 0)

    def rows_of(r: torch.Tensor | None, s: slice) -> torch.Tensor | None:
        return r[s] if r is not None and r.dim() == arranged_dims and r.shape[0] != 1 else r

    row = x.numel() // x.shape[0]
    step = max(1, CPU_CHUNK_ELEMENTS // row)
    with _scratch(min(step, x.shape[0]) * row, torch.float32) as flat:
        buffer = flat.view((-1,) + tuple(x.shape[1:]))
        for i in range(0, x.shape[0], step):
            s = slice(i, min(i + step, x.shape[0]))
            a = buffer[: s.stop - s.start]
            a.copy_(x[s])
            yield s, lay.arrange(a), rows_of(amax_b, s), rows_of(amin_b, s)


def _fake_quantize_by_rows(
    x: torch.Tensor, lay: Layout, amax_b: torch.Tensor, amin_b: torch.Tensor | None, fmt: str, out: torch.Tensor
) -> torch.Tensor:
    kind = FORMATS[fmt].kind
    with ExitStack() as held:
        codes = None
        for rows, a, amax_c, amin_c in _row_chunks(x, lay, amax_b, amin_b):
            if kind == "nvfp4":
                out[rows] = lay.restore(qdq_arranged(a, amax_c, fmt, amin_c))
                continue
            _, scale, _ = _scaled(a, amax_c, fmt, amin_c, out=a)
            if _fp8_valued(fmt):  # the codes' values / 256, the scale times 256 (exact), as fp8_e4m3_to_float32
                if codes is None:  # sized by the first chunk, the largest
                    codes = held.enter_context(_scratch(a.numel(), torch.float8_e4m3fn)).view(a.shape)
                chunk_codes = codes[: len(a)]
                e4m3_values_over_256(chunk_codes.copy_(a), out=a)
                scale = scale * E4M3_BY_HALVES_FACTOR
            out[rows] = lay.restore(a.mul_(scale))  # cast to x's dtype as .to() casts
    return out


def fake_quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    spec: QuantizerSpec,
    layout: Layout | None = None,
    amin: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize-dequantize ``x`` with ``amax`` (of the layout's amax shape; asymmetric: the range ``[amin, amax]``);
    returns ``x``'s dtype: in ``out`` where given (``x``'s shape and dtype; it may be ``x`` itself), else new.

    ``layout`` defaults to ``Layout(spec, x.shape)`` (right for a weight; a quantizer passes its own).
    """
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"fake_quantize out= must be {list(x.shape)} {x.dtype}, got {list(out.shape)} {out.dtype}")
    lay = _layout(spec, x, layout)
    amax_b, amin_b = _broadcast_range(lay, x, spec, amax, amin)
    if lay.block is None and _by_rows(x, amax_b, amin_b):  # 2-D blocks span rows: a block layout goes whole
        target = torch.empty(x.shape, dtype=x.dtype) if out is None else out
        return _fake_quantize_by_rows(x, lay, amax_b, amin_b, spec.format, target)
    result = lay.restore(qdq_arranged(lay.arrange(x.float()), amax_b, spec.format, amin_b)).to(x.dtype)
    return result if out is None else out.copy_(result)


def encode(
    x: torch.Tensor,
    amax: torch.Tensor,
    spec: QuantizerSpec,
    layout: Layout | None = None,
    amin: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The real quantized encoding of ``x`` (a weight) in compressed-tensors conventions.

    - int8: ``values`` int8 (``x``'s shape), ``scale`` float32 (amax shape: ``[1]``, ``[out, 1]``, ``[out, in/g]``;
      ``[ceil(out/r), ceil(in/c)]`` per block)
    - int4: ``values`` int8 in [-8, 7] (pack with :func:`pack_int4_to_int32`), ``scale`` as above
    - asymmetric int8 / int4: also ``zero_point`` int8 (amax shape); ``values`` include it
    - fp8_e4m3: ``values`` float8_e4m3fn, ``scale`` as above
    - nvfp4: ``packed`` uint8 ``[..., in/2]`` (two E2M1 codes per byte), ``scale`` float8_e4m3fn
      ``[..., in/16]`` (block scales), ``global_scale`` float32 ``[1]`` (``448 * 6 / amax``)
    - mxfp4: ``packed`` as nvfp4's, ``scale`` uint8 ``[..., in/32]`` (E8M0 exponents); mxfp8: ``values``
      float8_e4m3fn, ``scale`` uint8 as mxfp4's
    """
    lay = _layout(spec, x, layout)
    amax_b, amin_b = _broadcast_range(lay, x, spec, amax, amin)
    kind = FORMATS[spec.format].kind
    by_rows = lay.block is None and _by_rows(x, amax_b, amin_b)
    if kind == "nvfp4":
        if not by_rows:
            return _encode_nvfp4(lay.arrange(x.float()), amax_b)
        parts = [_encode_nvfp4(a, amax_c) for _, a, amax_c, _ in _row_chunks(x, lay, amax_b, amin_b)]
        joined = {k: torch.cat([p[k] for p in parts]) for k in ("packed", "scale")}
        return {**joined, "global_scale": parts[0]["global_scale"]}  # one per tensor: every chunk's is the same
    if spec.format == "mxfp4":
        values = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # E2M1 values, packed below
    else:
        values = torch.empty(x.shape, dtype=torch.int8 if kind == "int" else torch.float8_e4m3fn, device=x.device)
    if by_rows:
        chunks = _row_chunks(x, lay, amax_b, amin_b)
    else:  # computed in place: in a copy, whatever x's dtype
        chunks = iter([(..., lay.arrange(x.to(torch.float32, copy=True)), amax_b, amin_b)])
    for rows, a, amax_c, amin_c in chunks:
        _, _, zp = _scaled(a, amax_c, spec.format, amin_c, out=a)
        values[rows] = lay.restore(a if zp is None else a.add_(zp))  # cast to the codes' dtype as .to() casts
    if kind == "mx":
        exponents = mx_exponents(amax_b, spec.format).expand(lay.bshape).reshape(lay.amax_shape).to(torch.uint8)
        if spec.format == "mxfp4":
            return {"packed": pack_fp4_to_uint8(e2m1_codes(values)), "scale": exponents.contiguous()}
        return {"values": values, "scale": exponents.contiguous()}
    scale, zero_point = qparams(amax_b, amin_b, spec.format)
    enc = {"values": values, "scale": scale.expand(lay.bshape).reshape(lay.amax_shape).contiguous()}
    if zero_point is not None:
        enc["zero_point"] = zero_point.expand(lay.bshape).reshape(lay.amax_shape).to(torch.int8).contiguous()
    return enc


def _encode_nvfp4(a: torch.Tensor, amax_b: torch.Tensor) -> dict[str, torch.Tensor]:
    r = _quantize_arranged(a, amax_b, "nvfp4")
    return {
        "packed": pack_fp4_to_uint8(e2m1_codes(r["q"].flatten(-2))),
        "scale": r["block_scale"].squeeze(-1).to(torch.float8_e4m3fn),
        "global_scale": r["global_scale"].reshape(1),
    }


def decode(enc: dict[str, torch.Tensor], spec: QuantizerSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized tensor of :func:`encode`'s output, in ``dtype``."""
    kind = FORMATS[spec.format].kind
    if kind == "nvfp4":
        q = e2m1_values(unpack_fp4_from_uint8(enc["packed"]))
        gs = enc["global_scale"].float()
        eff = enc["scale"].float().unsqueeze(-1) / gs
        return (_nvfp4_blocks(q) * eff).flatten(-2).to(dtype)
    if kind == "mx":  # E2M1 or E4M3 values; the scales stored as E8M0 exponents
        values = e2m1_values(unpack_fp4_from_uint8(enc["packed"])) if spec.format == "mxfp4" else enc["values"]
        scale = mx_scales_of_exponents(enc["scale"])
    else:
        values, scale = enc["values"], enc["scale"].float()
    lay = Layout(spec, tuple(values.shape))
    codes = lay.arrange(fp8_e4m3_to_float32(values) if values.dtype == torch.float8_e4m3fn else values.float())
    if "zero_point" in enc:
        codes = codes - lay.broadcast(enc["zero_point"].float())
    out = codes * lay.broadcast(scale)
    return lay.restore(out).to(dtype)


def scales_from_amax(amax: torch.Tensor, spec: QuantizerSpec) -> dict[str, torch.Tensor]:
    """Export scales of a static activation quantizer: ``{"scale": amax / qmax}`` (float32, amax shape) for
    int/fp8, ``{"global_scale": 448 * 6 / amax}`` for nvfp4 (its block scales are computed at run time)."""
    if spec.format == "nvfp4":
        return {"global_scale": nvfp4_global_scale(amax)}
    return {"scale": scale_from_amax(amax, spec.format)}


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(x^2) / sum((x - x_hat)^2))``."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    signal = ref.pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise))
