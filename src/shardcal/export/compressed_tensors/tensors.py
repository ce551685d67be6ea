"""One quantized Linear <-> its compressed-tensors tensors (names relative to the module: ``weight_scale``, ...).

Encoding goes through ``TensorQuantizer.encode`` (``shardcal.quant.formats.encode``), so the stored integers / FP8 /
E2M1 codes are exactly the values the fake-quant model computes with: ``decode(encode(w)) == fake_quantize(w)``
bit for bit. Packing follows compressed-tensors (``pack_to_int32``, ``pack_fp4_to_uint8``).
"""

from __future__ import annotations

import functools

import torch

from ...quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    MX_ELEMENT_EXPONENT,
    asymmetric_qparams,
    decode,
    mx_scales_of_exponents,
    nvfp4_global_scale,
    pack_to_int32,
    scale_from_amax,
    unpack_int4_from_int32,
)
from ...quant.formats import (
    FORMATS as NUMBER_FORMATS,
)
from ...quant.quantizer import TensorQuantizer
from ...quant.spec import MX_FORMATS, QuantizerSpec
from .config import MXFP4_PACK_QUANTIZED, MXFP8_QUANTIZED, NVFP4_PACK_QUANTIZED, PACK_QUANTIZED, SCALE_DTYPE

# ----------------------------------------------------------------------------------------------- int8 packing


def unpack_int8_from_int32(packed: torch.Tensor, last_dim: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 8, device=packed.device, dtype=torch.int64)
    b = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
    return (b.flatten(-2)[..., :last_dim] - 128).to(torch.int8)


# ----------------------------------------------------------------------------------------------- encode


def encode_weight(quantizer: TensorQuantizer, weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The stored tensors of a (full, unsharded) weight, as compressed-tensors' compressor for ``fmt`` names them."""
    enc = quantizer.encode(weight.detach())
    if fmt == MXFP4_PACK_QUANTIZED:  # E8M0 exponents as uint8, no global scale
        return {"weight_packed": enc["packed"], "weight_scale": enc["scale"]}
    if fmt == MXFP8_QUANTIZED:
        return {"weight": enc["values"], "weight_scale": enc["scale"]}
    if fmt == NVFP4_PACK_QUANTIZED:
        return {
            "weight_packed": enc["packed"],
            "weight_scale": enc["scale"],
            "weight_global_scale": enc["global_scale"].to(torch.float32).reshape(1),
        }
    out: dict[str, torch.Tensor] = {}
    if fmt == PACK_QUANTIZED:
        values = enc["values"]
        bits = quantizer.spec.num_bits
        out["weight_packed"] = pack_to_int32(values, bits)  # encode clamped the codes to the format's range
        out["weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
    else:
        out["weight"] = enc["values"]
    out["weight_scale"] = enc["scale"].to(SCALE_DTYPE)
    if "zero_point" in enc:
        out["weight_zero_point"] = _pack_zero_point(enc["zero_point"], quantizer.spec.num_bits, fmt)
    return out


def _pack_zero_point(zero_point: torch.Tensor, bits: int, fmt: str) -> torch.Tensor:
    """``weight_zero_point`` as compressed-tensors stores it: int8 ``[out, groups]`` (int-quantized), or packed
    ``32 // bits`` per int32 along the output dim, ``[ceil(out * bits / 32), groups]`` (pack-quantized)."""
    if fmt != PACK_QUANTIZED:
        return zero_point
    return pack_to_int32(zero_point.T.contiguous(), bits).T.contiguous()


def _unpack_zero_point(stored: torch.Tensor, bits: int, fmt: str, out_features: int) -> torch.Tensor:
    if fmt != PACK_QUANTIZED:
        return stored.to(torch.int8)
    words = stored.T.contiguous()
    unpack = unpack_int4_from_int32 if bits == 4 else unpack_int8_from_int32
    return unpack(words, out_features).T.contiguous()


def encode_input(quantizer: TensorQuantizer | None) -> dict[str, torch.Tensor]:
    """``input_scale`` (int / fp8, static) or ``input_global_scale`` (nvfp4); nothing for a dynamic input."""
    if quantizer is None or quantizer.spec.dynamic:
        return {}
    scales = quantizer.export_scales()
    if "global_scale" in scales:
        return {"input_global_scale": scales["global_scale"].to(torch.float32).reshape(1)}
    return {"input_scale": scales["scale"].to(SCALE_DTYPE).reshape(1)}


# ----------------------------------------------------------------------------------------------- decode


def decode_weight(
    tensors: dict[str, torch.Tensor], spec: QuantizerSpec, fmt: str, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The dequantized weight (in ``dtype``) of a module's stored tensors; exactly what the fake-quant model used."""
    out_f, in_f = shape
    if fmt == MXFP4_PACK_QUANTIZED:
        return decode({"packed": tensors["weight_packed"], "scale": tensors["weight_scale"]}, spec, dtype)
    if fmt == MXFP8_QUANTIZED:
        return decode({"values": tensors["weight"], "scale": tensors["weight_scale"]}, spec, dtype)
    if fmt == NVFP4_PACK_QUANTIZED:
        enc = {
            "packed": tensors["weight_packed"],
            "scale": tensors["weight_scale"].to(torch.float8_e4m3fn),
            "global_scale": tensors["weight_global_scale"].float().reshape(1),
        }
        return decode(enc, spec, dtype)
    if fmt == PACK_QUANTIZED:
        packed = tensors["weight_packed"]
        values = unpack_int4_from_int32(packed, in_f) if spec.num_bits == 4 else unpack_int8_from_int32(packed, in_f)
    else:
        values = tensors["weight"]
    enc = {"values": values, "scale": tensors["weight_scale"].float()}
    if not spec.symmetric:
        enc["zero_point"] = weight_zero_point(tensors, spec, fmt, out_f)
    return decode(enc, spec, dtype)


def weight_zero_point(
    tensors: dict[str, torch.Tensor], spec: QuantizerSpec, fmt: str, out_features: int
) -> torch.Tensor:
    """The int8 zero points (the scale's shape) of an asymmetric weight's stored ``weight_zero_point``."""
    return _unpack_zero_point(tensors["weight_zero_point"], spec.num_bits, fmt, out_features)


# ----------------------------------------------------------------------------------------------- amax from scales


def _float32_preimage(target: torch.Tensor, guess: torch.Tensor, fn, span: int = 4) -> torch.Tensor:
    """Per element, a float32 ``a`` near ``guess`` with ``fn(a) == target`` bit for bit (``guess`` itself when no
    neighbour within ``span`` ulps qualifies). Scales are always computed from some float32 amax, so one exists."""
    target = target.float()
    best = guess.float().clone()
    found = fn(best) == target
    up, down = best.clone(), best.clone()
    for _ in range(span):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        for cand in (up, down):
            hit = ~found & (fn(cand) == target)
            best = torch.where(hit, cand, best)
            found = found | hit
    return best


def amax_for_scale(scale: torch.Tensor, spec: QuantizerSpec) -> torch.Tensor:
    """An amax whose ``amax / qmax`` (shardcal's int / fp8 scale rule) equals the stored ``scale`` bit for bit; MX:
    the power of two ``2 ** (e - 127 + k)`` whose E8M0 exponent (``formats.mx_exponents``) is the stored ``e``."""
    if spec.format in MX_FORMATS:
        return mx_scales_of_exponents(scale.to(torch.int32) + MX_ELEMENT_EXPONENT[spec.format])
    qmax = NUMBER_FORMATS[spec.format].qmax
    scale = scale.float()
    return _float32_preimage(scale, scale * qmax, lambda a: scale_from_amax(a, spec.format))


def range_for_qparams(
    scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantizerSpec, span: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """An asymmetric ``(amax, amin)`` whose scale and zero point (``formats.asymmetric_qparams``) equal the stored
    ones bit for bit: ``amin`` within ``span`` ulps of ``(qmin - zp) * scale``, ``amax`` within ``span`` ulps of
    ``amin + scale * (qmax - qmin)`` (the subtraction in the scale rule needs both ends to move)."""
    f = NUMBER_FORMATS[spec.format]
    scale, zero_point = scale.float(), zero_point.float()
    centre = (f.qmin - zero_point) * scale
    best_max, best_min = centre + scale * (f.qmax - f.qmin), centre.clone()
    found = torch.zeros_like(scale, dtype=torch.bool)
    for amin in _ulp_neighbours(centre, span):
        scale_of = functools.partial(_asymmetric_scale, amin=amin, fmt=spec.format)
        amax = _float32_preimage(scale, amin + scale * (f.qmax - f.qmin), scale_of, span)
        got_scale, got_zp = asymmetric_qparams(amax, amin, spec.format)
        hit = ~found & (got_scale == scale) & (got_zp == zero_point)
        best_max, best_min = torch.where(hit, amax, best_max), torch.where(hit, amin, best_min)
        found |= hit
        if bool(found.all()):
            break
    return best_max, best_min


def _asymmetric_scale(amax: torch.Tensor, amin: torch.Tensor, fmt: str) -> torch.Tensor:
    return asymmetric_qparams(amax, amin, fmt)[0]


def _ulp_neighbours(x: torch.Tensor, span: int) -> list[torch.Tensor]:
    """``x``, then its neighbours 1, -1, 2, -2, ... ``span`` ulps away (float32)."""
    out, up, down = [x], x, x
    for _ in range(span):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        out += [up, down]
    return out


def amax_for_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """An amax whose nvfp4 global scale ``448 * 6 / amax`` equals the stored one bit for bit (shape ``[1]``)."""
    gs = global_scale.float().reshape(1)
    return _float32_preimage(gs, (E4M3_MAX * E2M1_MAX) / gs, nvfp4_global_scale)
