"""Quantization: number formats, granularities, observers, the fake-quant ``TensorQuantizer``, ``QuantLinear``
insertion and TOML recipes. See docs/design/quantization.md.

- :mod:`.spec` — ``QuantizerSpec``: plain-data description of one quantizer (what recipes and export use).
- :mod:`.formats` — int8 / int4 / fp8_e4m3 / nvfp4 fake quantization and real encodings (compressed-tensors).
- :mod:`.granularity` — per-tensor / per-channel / per-group amax layouts.
- :mod:`.reuse` — the last result kept for the same input tensor (q / k / v read one input).
- :mod:`.observers` — max / percentile / mse, each with an exact cross-rank merge.
- :mod:`.merge` — one all-reduce per reduce op for many quantizers' statistics.
- :mod:`.quantizer` — ``TensorQuantizer`` (modes, calibration passes, amax buffer).
- :mod:`.session` — the pass protocol over many quantizers (what the layer runner calls).
- :mod:`.linear` — ``QuantLinear`` (in place; works before or after ``fully_shard``).

Recipes (which modules get which quantizers, and the algorithm) are a layer above: :mod:`shardcal.calib.recipes`.
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
from .linear import QuantLinear, quantized_modules
from .merge import merge_stats
from .observers import OBSERVERS, MaxObserver, MseObserver, Observer, PercentileObserver
from .quantizer import NotCalibratedError, QuantMode, TensorQuantizer
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
from .spec import FORMATS, GRANULARITIES, OBSERVER_KINDS, QuantizerSpec, SpecError

__all__ = [
    "FORMATS",
    "GRANULARITIES",
    "OBSERVERS",
    "OBSERVER_KINDS",
    "CalibrationSession",
    "Layout",
    "MaxObserver",
    "MseObserver",
    "NotCalibratedError",
    "Observer",
    "PercentileObserver",
    "QuantLinear",
    "QuantMode",
    "QuantizerSpec",
    "SpecError",
    "TensorQuantizer",
    "begin_pass_all",
    "decode",
    "encode",
    "end_pass_all",
    "fake_quantize",
    "finish_calibration_all",
    "iter_quantizers",
    "merge_stats",
    "num_passes",
    "nvfp4_global_scale",
    "pack_fp4_to_uint8",
    "pack_int4_to_int32",
    "quantized_modules",
    "quantizer_mode",
    "scales_from_amax",
    "set_quantizer_mode",
    "sqnr_db",
    "start_calibration_all",
    "unpack_fp4_from_uint8",
    "unpack_int4_from_int32",
]
