"""``load_quantized_into``: a compressed-tensors checkpoint -> fake-quant ``QuantLinear`` modules.

``from_pretrained`` calls it when config.json has a ``quantization_config``. The quantizer specs
come from the config (no recipe needed). Each quantized Linear gets its weight dequantized from the stored
integers / FP8 / E2M1 codes and scales — the exact values the calibrated model computed with — and its input
quantizer's amax chosen so that the scale it derives equals the stored ``input_scale`` (``input_global_scale`` for
nvfp4) bit for bit. The reloaded model's logits therefore equal the calibrated model's exactly.

The weight quantizer keeps an amax equivalent to the stored scales (for a re-export) but is ``disabled``: the
weights already hold their quantized values. A ``kv_cache_scheme`` gives every attention a KV-cache quantizer whose
amax reproduces the stored ``k_scale`` / ``v_scale`` bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..export.compressed_tensors import config as ct_config
from ..export.compressed_tensors.config import NVFP4_PACK_QUANTIZED, Scheme
from ..export.compressed_tensors.tensors import (
    amax_for_global_scale,
    amax_for_scale,
    decode_weight,
    range_for_qparams,
    weight_zero_point,
)
from ..models.checkpoint import CheckpointReader
from ..models.config import ModelConfig
from ..quant.fused import ROLES, fused_layer, role_quantizers, unshared_ranges
from ..quant.hadamard import sylvester_matrix
from ..quant.kv_cache import attach_kv_cache_quantizers, attention_modules, kv_cache_quantizers
from ..quant.linear import QuantLinear
from ..quant.quantizer import QuantMode
from .build import check_float_shapes, check_tensor_names, router_weight_names


def _schemes_by_module(model: nn.Module, schemes: list[Scheme], ignore: list[str], source: str) -> dict[str, Scheme]:
    found: dict[str, Scheme] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or ct_config.matches(name, module, ignore):
            continue
        for scheme in schemes:  # first matching group wins, as in compressed-tensors
            if ct_config.matches(name, module, scheme.targets):
                found[name] = scheme
                break
    if not found:
        raise ConfigError(f"{source}: quantization_config matches no Linear module of this model")
    return found


def _check_tensor(reader: CheckpointReader, key: str, dtype: torch.dtype, shape: tuple[int, ...], fmt: str) -> None:
    found_shape = reader.shape(key)
    if found_shape != shape:
        raise CheckpointError(
            f"{reader.file_of(key)}: tensor {key!r} has shape {list(found_shape)}, expected {list(shape)}"
        )
    found = reader.dtype(key)
    suffix = key.rpartition(".")[2]
    scale_ok = (
        suffix.endswith("scale")
        and found.is_floating_point
        and not (fmt == NVFP4_PACK_QUANTIZED and suffix == "weight_scale")
    )
    if found != dtype and not scale_ok:
        raise CheckpointError(
            f"{reader.file_of(key)}: tensor {key!r} has dtype {reader.dtype_name(key)}, expected {dtype}"
        )


def _check_rotations(
    rotations: dict[str, int], by_module: dict[str, Scheme], modules: dict[str, nn.Module], source: str
) -> None:
    """A :class:`ConfigError` for a rotated module that is not quantized or whose ``in_features`` the block does not
    divide."""
    for name, block in rotations.items():
        if name not in by_module:
            raise ConfigError(
                f"{source}: quantization_config.transform_config rotates {name!r}, which is not quantized"
            )
        if modules[name].in_features % block:
            raise ConfigError(
                f"{source}: quantization_config.transform_config rotates {name!r} with head_dim {block}, which does "
                f"not divide its in_features {modules[name].in_features}"
            )


def _check_hadamard(reader: CheckpointReader, key: str, block: int) -> None:
    """The stored matrix of an online ``hadamard`` rotation must be the ``[block, block]`` Sylvester matrix (±1)."""
    if not reader.dtype(key).is_floating_point or reader.shape(key) != (block, block):
        raise CheckpointError(
            f"{reader.file_of(key)}: tensor {key!r} has dtype {reader.dtype_name(key)} and shape "
            f"{list(reader.shape(key))}, expected a floating-point [{block}, {block}] Hadamard matrix"
        )
    if not torch.equal(reader.get(key).to(torch.float64), sylvester_matrix(block)):
        raise CheckpointError(
            f"{reader.file_of(key)}: tensor {key!r} is not the {block} x {block} Sylvester Hadamard matrix its "
            "transform_config (type hadamard) names"
        )


def load_quantized_into(
    model: nn.Module, path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Fill ``model`` (built on the meta device in ``dtype``) from the compressed-tensors checkpoint at ``path``.

    Errors name the file and the config key or tensor: :class:`ConfigError` for a ``quantization_config`` this
    package cannot run, :class:`CheckpointError` for missing, unexpected or mis-shaped tensors.
    """
    source = str(Path(path) / "config.json")
    try:
        schemes, ignore = ct_config.parse_quantization_config(cfg.raw.get("quantization_config"), source)
        kv_spec = ct_config.parse_kv_cache_scheme(cfg.raw["quantization_config"])
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        rotations = ct_config.parse_transform_config(cfg.raw["quantization_config"], linears)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    by_module = _schemes_by_module(model, schemes, ignore, source)
    modules = dict(model.named_modules())
    _check_rotations(rotations, by_module, modules, source)

    with CheckpointReader(path) as reader:
        # expected tensors: plain parameters, and each quantized module's compressed-tensors tensors
        params = dict(model.named_parameters())
        plain = {
            n: tuple(p.shape)
            for n, p in params.items()
            if n.rpartition(".")[0] not in by_module or not n.endswith(".weight")
        }
        if cfg.tie_word_embeddings and "lm_head.weight" in reader and "lm_head" not in by_module:
            plain["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        layouts: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        for name, scheme in by_module.items():
            m = modules[name]
            if f"{name}.weight" not in params:
                raise ConfigError(
                    f"{source}: quantization_config quantizes {name!r}, whose weight is tied to another tensor"
                )
            layouts[name] = ct_config.tensor_layout(
                scheme.format, scheme.weight, scheme.input, m.out_features, m.in_features
            )
        attentions = [n for n, _ in attention_modules(model)] if kv_spec is not None else []
        kv_keys = [f"{n}.{s}" for n in attentions for s in ("k_scale", "v_scale")]
        rotation_keys = {f"{n}.{next(iter(ct_config.rotation_layout(b)))}": b for n, b in rotations.items()}
        expected = [*plain, *(f"{n}.{s}" for n, layout in layouts.items() for s in layout), *kv_keys, *rotation_keys]
        check_tensor_names(reader, expected, "", f"this {cfg.model_type} model with its quantization_config")
        check_float_shapes(reader, plain)
        for key in kv_keys:
            _check_tensor(reader, key, torch.float32, (1,), "")
        for key, block in rotation_keys.items():
            _check_hadamard(reader, key, block)
        for name, layout in layouts.items():
            for suffix, (dt, shape) in layout.items():
                _check_tensor(reader, f"{name}.{suffix}", dt, shape, by_module[name].format)
            if "weight_shape" in layout:
                stored = [int(v) for v in reader.get(f"{name}.weight_shape")]
                m = modules[name]
                if stored != [m.out_features, m.in_features]:
                    raise CheckpointError(
                        f"{reader.file_of(name + '.weight_shape')}: tensor {name + '.weight_shape'!r} says {stored}, "
                        f"the config implies {[m.out_features, m.in_features]}"
                    )

        # structure: quantizers on meta, then materialise
        for name, scheme in by_module.items():
            QuantLinear.from_linear(modules[name], weight=scheme.weight, input=scheme.input, name=name)
            modules[name].input_rotation = rotations.get(name)  # the stored weight holds W H already
        if kv_spec is not None:
            attach_kv_cache_quantizers(model, kv_spec)
        routers = router_weight_names(model)
        for pname, p in model.named_parameters():
            if pname in routers and pname in reader and reader.dtype(pname) == torch.float32:
                p.data = p.data.to(torch.float32)
        model.to_empty(device=device)
        model.tie_weights()

        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname in plain:
                    p.copy_(reader.get(pname))
            for name, scheme in by_module.items():
                m = modules[name]
                stored = {s: reader.get(f"{name}.{s}") for s in layouts[name]}
                weight = decode_weight(
                    stored, scheme.weight, scheme.format, (m.out_features, m.in_features), m.weight.dtype
                )
                m.weight.copy_(weight)
                wq = m.weight_quantizer
                if scheme.format == NVFP4_PACK_QUANTIZED:
                    wq.set_amax(amax_for_global_scale(stored["weight_global_scale"]))
                elif not scheme.weight.symmetric:
                    zero_point = weight_zero_point(stored, scheme.weight, scheme.format, m.out_features)
                    amax, amin = range_for_qparams(stored["weight_scale"], zero_point, scheme.weight)
                    wq.set_amax(amax.reshape(wq.amax.shape), amin.reshape(wq.amax.shape))
                else:
                    wq.set_amax(amax_for_scale(stored["weight_scale"], scheme.weight).reshape(wq.amax.shape))
                wq.mode = QuantMode.DISABLED  # the weight already holds its quantized values
                iq = m.input_quantizer
                if iq is not None and not iq.spec.dynamic:
                    if "input_global_scale" in stored:
                        iq.set_amax(amax_for_global_scale(stored["input_global_scale"]))
                    else:
                        iq.set_amax(amax_for_scale(stored["input_scale"], scheme.input))
                if iq is not None:
                    iq.mode = QuantMode.QUANTIZE
            for name, kv in kv_cache_quantizers(model):
                for role, q in (("k", kv.k_quantizer), ("v", kv.v_quantizer)):
                    q.set_amax(amax_for_scale(reader.get(f"{name}.{role}_scale").reshape(1), kv_spec))
                    q.mode = QuantMode.QUANTIZE
    _warn_unshared_ranges(model, source)
    return model.eval()


def _warn_unshared_ranges(model: nn.Module, source: str) -> None:
    """Warn when the checkpoint's fused-layer members (q/k/v, gate/up) have scales vLLM takes as one but which differ
    (e.g. an nvfp4 export of shardcal before it shared them): this model computes what the checkpoint says, vLLM
    computes something else (docs/reference/vllm-conventions.md)."""
    for role in ROLES:
        for group in unshared_ranges(role_quantizers(model, "", role), role):
            warnings.warn(
                f"{source}: {', '.join(group)} have different {role} scales, but vLLM loads them as one fused layer "
                f"({fused_layer(group[0])}) and computes it with one: in vLLM this checkpoint computes something "
                "else than here (re-export it with a current shardcal; see docs/reference/vllm-conventions.md)",
                stacklevel=4,
            )
