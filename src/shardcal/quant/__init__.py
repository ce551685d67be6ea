"""Quantization: number formats, granularities, observers, the fake-quant ``TensorQuantizer``, ``QuantLinear``
insertion and TOML recipes. See docs/quantization.md.

- :mod:`.spec` — ``QuantizerSpec``: plain-data description of one quantizer (what recipes and export use).
- :mod:`.formats` — int8 / int4 / fp8_e4m3 / nvfp4 fake quantization and real encodings (compressed-tensors).
- :mod:`.granularity` — per-tensor / per-channel / per-group amax layouts.
- :mod:`.observers` — max / percentile / mse, each with an exact cross-rank merge.
- :mod:`.merge` — one all-reduce per reduce op for many quantizers' statistics.
- :mod:`.quantizer` — ``TensorQuantizer`` (modes, calibration passes, amax buffer).
- :mod:`.session` — the pass protocol over many quantizers (what the layer runner calls).
- :mod:`.linear` — ``QuantLinear`` and ``quantize_modules`` (in place; works before or after ``fully_shard``).
- :mod:`.recipe` — ``Recipe`` and ``load_recipe``.
"""

from .formats import (
    decode,
    encode,
    fake_quantize,
    nvfp4_global_scale,
    pack_fp4_to_uint8,
    pack_int4_to_int32,
    scales_from_amax,
    sqnr_db,
    unpack_fp4_from_uint8,
    unpack_int4_from_int32,
)
from .granularity import Layout
from .linear import QuantLinear, quantize_modules, quantized_modules
from .merge import merge_stats
from .observers import OBSERVERS, MaxObserver, MseObserver, Observer, PercentileObserver
from .quantizer import NotCalibratedError, QuantMode, TensorQuantizer
from .recipe import DEFAULT_EXCLUDES, Recipe, load_recipe, parse_recipe, register_algorithm, shipped_recipes
from .session import (
    CalibrationSession,
    begin_pass_all,
    end_pass_all,
    finish_calibration_all,
    iter_quantizers,
    num_passes,
    quantizer_mode,
    set_quantizer_mode,
    start_calibration_all,
)
from .spec import FORMATS, GRANULARITIES, QuantizerSpec, SpecError

__all__ = [
    "CalibrationSession",
    "DEFAULT_EXCLUDES",
    "FORMATS",
    "GRANULARITIES",
    "Layout",
    "MaxObserver",
    "MseObserver",
    "NotCalibratedError",
    "OBSERVERS",
    "Observer",
    "PercentileObserver",
    "QuantLinear",
    "QuantMode",
    "QuantizerSpec",
    "Recipe",
    "SpecError",
    "TensorQuantizer",
    "begin_pass_all",
    "decode",
    "encode",
    "end_pass_all",
    "fake_quantize",
    "finish_calibration_all",
    "iter_quantizers",
    "load_recipe",
    "merge_stats",
    "num_passes",
    "nvfp4_global_scale",
    "pack_fp4_to_uint8",
    "pack_int4_to_int32",
    "parse_recipe",
    "quantize_modules",
    "quantized_modules",
    "quantizer_mode",
    "register_algorithm",
    "scales_from_amax",
    "set_quantizer_mode",
    "shipped_recipes",
    "sqnr_db",
    "start_calibration_all",
    "unpack_fp4_from_uint8",
    "unpack_int4_from_int32",
]
