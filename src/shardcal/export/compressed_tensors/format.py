"""The compressed-tensors export format: the :class:`~shardcal.export.format.ExportFormat` the export writes by default.

It ties the vocabulary (:mod:`.config`: specs -> ``QuantizationArgs``, formats, tensor layouts) and the encoding
(:mod:`.tensors`) to the interface the shared streaming export and the planner use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...quant.hadamard import sylvester_matrix
from ...quant.quantizer import TensorQuantizer
from ...quant.spec import QuantizerSpec
from . import config as ct_config
from .tensors import encode_input, encode_weight


class CompressedTensorsFormat:
    """compressed-tensors (vLLM's and transformers' quantized checkpoint format); see docs/reference/export-format.md."""

    name = ct_config.QUANT_METHOD
    config_key = "quantization_config"

    def check_spec(self, spec: QuantizerSpec, role: str) -> None:
        """Raise :class:`~.config.UnsupportedSpec` (a ``ValueError``) for what compressed-tensors cannot express."""
        ct_config.spec_to_args(spec, role)

    def module_format(self, weight: QuantizerSpec, input: QuantizerSpec | None) -> str:
        """compressed-tensors' ``format`` of a scheme (``int-quantized``, ``pack-quantized``, ...)."""
        return ct_config.infer_format(weight, input)

    def module_tensors(
        self,
        module_format: str,
        weight: QuantizerSpec,
        input: QuantizerSpec | None,
        out_features: int,
        in_features: int,
        input_rotation: int | None = None,
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{suffix: (dtype, shape)}`` of one quantized Linear (:func:`.config.tensor_layout`), and its rotation's
        Hadamard matrix when its inputs are rotated (:func:`.config.rotation_layout`)."""
        layout = ct_config.tensor_layout(module_format, weight, input, out_features, in_features)
        if input_rotation is not None:
            layout.update(ct_config.rotation_layout(input_rotation))
        return layout

    def encode_module(
        self,
        module_format: str,
        weight_quantizer: TensorQuantizer,
        weight: torch.Tensor,
        input_quantizer: TensorQuantizer | None,
        input_rotation: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The stored tensors of one quantized Linear: its weight's (:func:`.tensors.encode_weight`; a rotated
        Linear's weight holds ``W H`` already), its static input scale's (:func:`.tensors.encode_input`), and the
        Hadamard matrix of its input rotation."""
        tensors = encode_weight(weight_quantizer, weight, module_format)
        tensors.update(encode_input(input_quantizer))
        if input_rotation is not None:
            (suffix,) = ct_config.rotation_layout(input_rotation)
            tensors[suffix] = sylvester_matrix(input_rotation, torch.float32)
        return tensors

    def config(
        self,
        schemes: Mapping[tuple[QuantizerSpec, QuantizerSpec | None, str], list[str]],
        ignore: list[str],
        kv_cache: QuantizerSpec | None,
        rotations: Mapping[str, int] | None = None,
    ) -> dict[str, Any]:
        """``quantization_config``: one group per scheme (targets ``["Linear"]`` when there is one, else the module
        names), ``ignore`` as given, ``kv_cache_scheme``, and the ``transform_config`` of the ``rotations``."""
        groups = []
        for (weight, input, fmt), names in schemes.items():
            targets = ["Linear"] if len(schemes) == 1 else list(names)
            groups.append(ct_config.scheme_dict(targets, weight, input, fmt))
        return ct_config.quantization_config(groups, ignore, kv_cache, rotations)


#: The one instance the registry (:func:`shardcal.export.format.formats`) hands out.
COMPRESSED_TENSORS = CompressedTensorsFormat()
