"""Checkpoints published quantized, read as the floating-point weights they stand for: FP8 with block scales.

DeepSeek-V3 / R1, Kimi-K2 and Qwen3's FP8 releases store each Linear's weight in float8_e4m3fn with one float32 scale
per block of ``weight_block_size`` (``config.json``: ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}``), under ``<linear>.weight`` and ``<linear>.weight_scale_inv``
(``[ceil(out / 128), ceil(in / 128)]``). The weight they stand for is

    w[i, j] = float(q[i, j]) * weight_scale_inv[i // block_out, j // block_in]

the publishers' own dequantization (DeepSeek's ``weight_dequant``, transformers' fine-grained FP8 integration). The
checkpoint readers (:class:`~.checkpoint.CheckpointReader`, :class:`~.reads.ReadingReader`) apply it on read, to the
rows asked for only: every loader, the streamed one included, then sees a float checkpoint (the scale tensors are not
among its keys), and a calibration starts from the weights the FP8 model computes with. Nothing else is dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
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

    def dequantize(self, q: torch.Tensor, scale_inv: torch.Tensor, row_start: int = 0) -> torch.Tensor:
        """Weight rows ``row_start : row_start + len(q)`` in float32, from their FP8 values ``q`` and the scale rows
        :meth:`scale_rows` names."""
        if q.dim() != 2 or scale_inv.dim() != 2:
            raise ValueError(
                f"block-scaled FP8 weights are 2-D, got {list(q.shape)} with scales {list(scale_inv.shape)}"
            )
        rows, cols = q.shape
        bo, bi = self.block
        offset = row_start - (row_start // bo) * bo
        scales = scale_inv.float().repeat_interleave(bo, 0)[offset : offset + rows].repeat_interleave(bi, 1)[:, :cols]
        return q.float() * scales


def published_quantization(raw: Mapping[str, Any], source: object = "config.json") -> BlockFP8 | None:
    """The published quantization ``raw`` (a config.json) declares: :class:`BlockFP8` for ``quant_method: "fp8"``,
    None for none or for another method (a shardcal export's compressed-tensors is read by its own loader). An FP8
    config without a usable ``weight_block_size`` (per-tensor FP8) is a :class:`CheckpointError` naming ``source``."""
    quant = raw.get("quantization_config")
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


def read_published_quantization(model_dir: Path) -> BlockFP8 | None:
    """:func:`published_quantization` of ``model_dir/config.json`` (None without one)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    return published_quantization(read_json_object(path, CheckpointError), path)


def is_published(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw``'s ``quantization_config`` is one the readers dequantize (the loaders then read it as a float
    checkpoint)."""
    quant = raw.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") == "fp8"


def scale_keys(keys: Iterable[str]) -> dict[str, str]:
    """``{weight key: its scale key}`` of every block-scaled weight among ``keys``."""
    present = set(keys)
    return {
        k[: -len(SCALE_SUFFIX)]: k for k in present if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in present
    }


class PublishedReads:
    """What both checkpoint readers share: a block-scaled FP8 weight read as its float32 values, rows as asked, and
    its scale tensor kept out of the reader's keys. A reader calls :meth:`_find_published` once it knows its keys, and
    gives ``_raw_get`` / ``_raw_get_rows`` (the stored tensor, as it is)."""

    published: BlockFP8 | None
    _scales: dict[str, str]
    _hidden: frozenset[str]

    def _find_published(self, model_dir: Path, keys: Iterable[str]) -> None:
        self.published = read_published_quantization(model_dir)
        self._scales = scale_keys(keys) if self.published is not None else {}
        self._hidden = frozenset(self._scales.values())

    def _raw_get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def _raw_get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def _visible(self, key: str) -> bool:
        """Whether ``key`` is one of the checkpoint's tensors as a float checkpoint has them (not a scale)."""
        return key not in self._hidden

    def _dequantized(self, key: str, stored: torch.Tensor, start: int) -> torch.Tensor:
        """``stored`` (rows ``start:`` of ``key``) as the weight it stands for: float32 where it is block-scaled."""
        scale_key = self._scales.get(key)
        if scale_key is None or self.published is None:
            return stored
        first, stop = self.published.scale_rows(start, start + stored.shape[0])
        return self.published.dequantize(stored, self._raw_get_rows(scale_key, first, stop), start)

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor (a block-scaled FP8 weight: dequantized, float32)."""
        return self._dequantized(key, self._raw_get(key), 0)

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0, nothing else read (a block-scaled FP8 weight: dequantized, float32, with the
        scale rows those rows need)."""
        return self._dequantized(key, self._raw_get_rows(key, start, stop), start)
