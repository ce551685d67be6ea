"""Checkpoints published quantized, read as the floating-point weights they stand for: FP8 with block scales, and
GPT-OSS's MXFP4 experts.

* **FP8 with block scales.** DeepSeek-V3 / R1, Kimi-K2 and Qwen3's FP8 releases store each Linear's weight in
  float8_e4m3fn with one float32 scale per block of ``weight_block_size`` (``config.json``: ``quantization_config =
  {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``), under ``<linear>.weight`` and
  ``<linear>.weight_scale_inv`` (``[ceil(out / 128), ceil(in / 128)]``). The weight they stand for is
  ``w[i, j] = float(q[i, j]) * weight_scale_inv[i // block_out, j // block_in]`` — the publishers' own
  dequantization (DeepSeek's ``weight_dequant``, transformers' fine-grained FP8 integration).
* **MXFP4 experts** (``quant_method: "mxfp4"``: GPT-OSS). Each fused experts tensor ``<experts>.gate_up_proj`` /
  ``down_proj`` is stored as ``<name>_blocks`` (uint8 ``[E, out, in / 32, 16]``: two FP4 E2M1 codes per byte, the low
  nibble first) and ``<name>_scales`` (uint8 ``[E, out, in / 32]``: an E8M0 exponent per 32 values, bias 127): value
  ``FP4[code] * 2 ** (scale - 127)``, the OCP microscaling format. The module holds the transpose, ``[E, in, out]``
  (transformers' ``GptOssExperts``; its ``convert_moe_packed_tensors`` reads them so).

The checkpoint readers (:class:`~.checkpoint.CheckpointReader`, :class:`~.reads.ReadingReader`) apply this on read,
to the rows asked for only (experts, for MXFP4): every loader, the streamed one included, then sees a float
checkpoint — the scale tensors are not among its keys, an MXFP4 tensor is there under the module's name — and a
calibration starts from the weights the published model computes with. Nothing else is dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..quant.formats import E4M3_BY_HALVES_FACTOR, e4m3_values_over_256
from ..runtime.fsutil import read_json_object

#: The suffix of a block-scaled weight's scale tensor (``<linear>.weight`` -> ``<linear>.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class BlockFP8:
    """FP8 weights with one scale per ``block`` = ``(rows, columns)`` block (see the module docstring)."""

    block: tuple[int, int]

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        """The rows of the scale tensor that weight rows ``start:stop`` need."""
        return start // self.block[0], math.ceil(stop / self.block[0])

    def dequantize(
        self,
        q: torch.Tensor,
        scale_inv: torch.Tensor,
        row_start: int = 0,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Weight rows ``row_start : row_start + len(q)`` from their FP8 values ``q`` and the scale rows
        :meth:`scale_rows` names: computed in float32, then rounded once to ``dtype`` (float32: kept); written into
        ``out`` where given (``q``'s shape, ``dtype``: a slot of a larger tensor), else a new tensor."""
        if q.dim() != 2 or scale_inv.dim() != 2:
            raise ValueError(
                f"block-scaled FP8 weights are 2-D, got {list(q.shape)} with scales {list(scale_inv.shape)}"
            )
        if out is not None and (out.shape != q.shape or out.dtype != dtype):
            raise ValueError(f"dequantize out= must be {list(q.shape)} {dtype}, got {list(out.shape)} {out.dtype}")
        rows, cols = q.shape
        bo, bi = self.block
        offset = row_start - (row_start // bo) * bo
        column_scales = scale_inv.float().repeat_interleave(bi, 1)[:, :cols]  # one row per block row: small
        e4m3 = q.dtype == torch.float8_e4m3fn  # the values / 256 from their bits; any other dtype converted by torch
        if e4m3:
            column_scales = column_scales * E4M3_BY_HALVES_FACTOR  # exact: the 256 back
        out = torch.empty((rows, cols), dtype=dtype) if out is None else out
        # block row by block row, through a band-sized buffer unless ``out`` is float32 and contiguous
        direct = dtype == torch.float32 and out.is_contiguous()
        band_buffer = None if direct else torch.empty((min(bo, rows), cols), dtype=torch.float32)
        for band, start in enumerate(range(-offset, rows, bo)):
            lo, hi = max(start, 0), min(start + bo, rows)
            values = out[lo:hi] if band_buffer is None else band_buffer[: hi - lo]
            if e4m3:
                e4m3_values_over_256(q[lo:hi], out=values)
            else:
                values.copy_(q[lo:hi])
            values.mul_(column_scales[band])
            if band_buffer is not None:
                out[lo:hi].copy_(values)
        return out


#: The FP4 E2M1 value of each 4-bit code (the OCP microscaling formats' element type).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: The suffixes of an MXFP4 tensor's two stored parts.
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


@dataclass(frozen=True)
class MXFP4:
    """MXFP4 fused experts, GPT-OSS's layout (see the module docstring)."""

    def shape(self, blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The module's tensor shape, ``[E, in, out]``, of stored blocks ``[E, out, in / 32, 16]``."""
        experts, out, groups, pairs = blocks_shape
        return (experts, groups * pairs * 2, out)

    def dequantize(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Experts' weights ``[E, in, out]`` (float32) from their blocks ``[E, out, in / 32, 16]`` and scales
        ``[E, out, in / 32]``."""
        if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not fit scales {list(scales.shape)}")
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        codes = blocks.to(torch.uint8)
        values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1).flatten(-2)
        values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
        return values.flatten(-2).transpose(1, 2).contiguous()


def published_quantization(raw: Mapping[str, Any], source: object = "config.json") -> BlockFP8 | MXFP4 | None:
    """The published quantization ``raw`` (a config.json) declares: :class:`BlockFP8` for ``quant_method: "fp8"``,
    :class:`MXFP4` for ``"mxfp4"``, None for none or for another method (a shardcal export's compressed-tensors is
    read by its own loader). An FP8 config without a usable ``weight_block_size`` (per-tensor FP8) is a
    :class:`CheckpointError` naming ``source``."""
    quant = raw.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4":
        return MXFP4()
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{source}: quantization_config 'fp8' needs weight_block_size [rows, columns] (FP8 with block scales), got "
            f"{block!r}; per-tensor FP8 checkpoints are not read"
        )
    return BlockFP8(block=(int(block[0]), int(block[1])))


def read_published_quantization(model_dir: Path) -> BlockFP8 | MXFP4 | None:
    """:func:`published_quantization` of ``model_dir/config.json`` (None without one)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    return published_quantization(read_json_object(path, CheckpointError), path)


def is_published(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw``'s ``quantization_config`` is one the readers dequantize (the loaders then read it as a float
    checkpoint)."""
    quant = raw.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") in ("fp8", "mxfp4")


def scale_keys(keys: Iterable[str]) -> dict[str, str]:
    """``{weight key: its scale key}`` of every block-scaled weight among ``keys``."""
    present = set(keys)
    return {
        k[: -len(SCALE_SUFFIX)]: k for k in present if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in present
    }


def packed_keys(keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{tensor name: (its blocks key, its scales key)}`` of every MXFP4 tensor among ``keys``."""
    present = set(keys)
    out = {}
    for k in present:
        if k.endswith(BLOCKS_SUFFIX) and k[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in present:
            name = k[: -len(BLOCKS_SUFFIX)]
            out[name] = (k, name + SCALES_SUFFIX)
    return out


class PublishedReads:
    """What both checkpoint readers share: a published quantized tensor read as its float32 values, rows as asked,
    under the name the module has it, and its stored parts kept out of the reader's keys. A reader calls
    :meth:`_find_published` once it knows its keys, and gives ``_raw_keys`` / ``_raw_get`` / ``_raw_get_rows`` /
    ``_raw_shape`` / ``_raw_dtype`` / ``_raw_file_of`` (the stored tensors, as they are)."""

    published: BlockFP8 | MXFP4 | None
    _scales: dict[str, str]
    _packed: dict[str, tuple[str, str]]
    _hidden: frozenset[str]

    def _find_published(self, model_dir: Path, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.published = read_published_quantization(model_dir)
        self._scales = scale_keys(keys) if isinstance(self.published, BlockFP8) else {}
        self._packed = packed_keys(keys) if isinstance(self.published, MXFP4) else {}
        self._hidden = frozenset(self._scales.values()) | {k for parts in self._packed.values() for k in parts}

    def _raw_keys(self) -> Iterable[str]:
        raise NotImplementedError

    def _raw_contains(self, key: str) -> bool:
        raise NotImplementedError

    def _raw_get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _raw_get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def _raw_get_staged(self, key: str, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` as stored: read into ``into`` where given (their shape and stored dtype, contiguous),
        else for use before the thread's next staged read (a reader may reuse one buffer while it stages)."""
        rows = self._raw_get_rows(key, start, stop)
        return rows if into is None else into.copy_(rows)

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _raw_dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def _raw_file_of(self, key: str) -> Path:
        raise NotImplementedError

    def keys(self) -> list[str]:
        """The checkpoint's tensors as a float checkpoint has them: no scale or block parts, MXFP4 tensors by name."""
        return [k for k in self._raw_keys() if k not in self._hidden] + list(self._packed)

    def __contains__(self, key: str) -> bool:
        return key in self._packed or (key not in self._hidden and self._raw_contains(key))

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._packed and isinstance(self.published, MXFP4):
            return self.published.shape(self._raw_shape(self._packed[key][0]))
        return self._raw_shape(key)

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype (an MXFP4 tensor: its packed bytes, uint8, two values a byte)."""
        return self._raw_dtype(self._packed[key][0] if key in self._packed else key)

    def value_dtype(self, key: str) -> torch.dtype:
        """The dtype :meth:`get` gives ``key`` in by default: float32 for a published quantized tensor, else stored."""
        if key in self._packed or key in self._scales:
            return torch.float32
        return self._raw_dtype(key)

    def file_of(self, key: str) -> Path:
        return self._raw_file_of(self._packed[key][0] if key in self._packed else key)

    def stored_nbytes(self, key: str) -> int:
        """The bytes the checkpoint stores for ``key``: a published quantized tensor's codes and its scales."""
        parts = self._packed.get(key) or (key, *((self._scales[key],) if key in self._scales else ()))
        return sum(math.prod(self._raw_shape(k)) * self._raw_dtype(k).itemsize for k in parts)

    def _dequantized(
        self, key: str, stored: torch.Tensor, start: int, dtype: torch.dtype | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``stored`` (rows ``start:`` of ``key``) as the weight it stands for, in ``dtype`` (None: float32 where it is
        block-scaled, else as stored); a block-scaled one dequantized into ``out`` where given."""
        scale_key = self._scales.get(key)
        if scale_key is None or not isinstance(self.published, BlockFP8):
            return stored if dtype is None else stored.to(dtype)
        first, stop = self.published.scale_rows(start, start + stored.shape[0])
        scales = self._raw_get_rows(scale_key, first, stop)
        return self.published.dequantize(stored, scales, start, dtype or torch.float32, out)

    def get(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, in ``dtype`` (None: as stored, a published quantized one dequantized in float32)."""
        if key in self._packed and isinstance(self.published, MXFP4):
            blocks, scales = self._packed[key]
            values = self.published.dequantize(self._raw_get(blocks), self._raw_get(scales))
            return values if dtype is None else values.to(dtype)
        return self._dequantized(key, self._raw_get(key), 0, dtype)

    def read_into(self, key: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rows ``start : start + len(out)`` of ``key`` (a 0-d tensor: all of it) written into ``out``, cast to its
        dtype as :meth:`get_rows` with that dtype rounds: a tensor stored in ``out``'s dtype is read straight into it
        (contiguous), a block-scaled FP8 weight dequantized into it, with no tensor of its size between."""
        shape = self.shape(key)
        stop = start + (out.shape[0] if out.dim() else 0)
        if tuple(out.shape[1:] if shape else out.shape) != tuple(shape[1:]) or not 0 <= start <= stop <= (
            shape[0] if shape else 0
        ):
            raise ValueError(
                f"{key}: cannot read rows {start}:{stop} into a tensor of shape {list(out.shape)}, it is {list(shape)}"
            )
        if not shape or key in self._packed:
            return out.copy_(self.get_rows(key, start, stop) if shape else self.get(key))
        if key in self._scales and isinstance(self.published, BlockFP8):
            stored = self._raw_get_staged(key, start, stop)  # dequantized before the next staged read reuses it
            return self._dequantized(key, stored, start, out.dtype, out)
        direct = out.dtype == self._raw_dtype(key) and out.is_contiguous()
        stored = self._raw_get_staged(key, start, stop, out if direct else None)
        return out if direct else out.copy_(stored)  # the cast as get_rows' .to(dtype) makes it

    def get_rows(self, key: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0, nothing else read, in ``dtype`` (None: as :meth:`get`); a block-scaled FP8
        weight is dequantized with the scale rows those rows need (rounded once to ``dtype``), an MXFP4 tensor's
        rows are its experts."""
        if key in self._packed and isinstance(self.published, MXFP4):
            blocks, scales = self._packed[key]
            values = self.published.dequantize(
                self._raw_get_rows(blocks, start, stop), self._raw_get_rows(scales, start, stop)
            )
            return values if dtype is None else values.to(dtype)
        return self._dequantized(key, self._raw_get_rows(key, start, stop), start, dtype)
