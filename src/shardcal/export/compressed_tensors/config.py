"""The compressed-tensors vocabulary: quantizer specs <-> ``QuantizationArgs`` dicts, formats, tensor layouts.

Everything here is plain data and shared by export (spec -> config.json, spec -> tensor names/dtypes/shapes) and
reload (config.json -> spec, and the same tensor layout to check a checkpoint against). The compressed-tensors
package is the reference (``quantization/quant_args.py``, ``quant_scheme.py``, ``compressors/*``); it is never
imported here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...quant.spec import MX_BLOCK_SIZE, MX_FORMATS, NVFP4_BLOCK_SIZE, QuantizerSpec, SpecError

QUANT_METHOD = "compressed-tensors"
STATUS_COMPRESSED = "compressed"

INT_QUANTIZED = "int-quantized"
FLOAT_QUANTIZED = "float-quantized"
PACK_QUANTIZED = "pack-quantized"
NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
MXFP8_QUANTIZED = "mxfp8-quantized"
NAIVE_QUANTIZED = "naive-quantized"
MIXED_PRECISION = "mixed-precision"
#: The formats this package writes and reads.
FORMATS: tuple[str, ...] = (
    INT_QUANTIZED,
    FLOAT_QUANTIZED,
    PACK_QUANTIZED,
    NVFP4_PACK_QUANTIZED,
    MXFP4_PACK_QUANTIZED,
    MXFP8_QUANTIZED,
    NAIVE_QUANTIZED,
)

#: Scales (``weight_scale``, ``input_scale``) are written in float32: the exact values the stored integers were
#: computed with. compressed-tensors keeps them in the model dtype; vLLM and compressed-tensors cast on load.
SCALE_DTYPE = torch.float32


class UnsupportedSpec(ValueError):
    """A quantizer (or a ``QuantizationArgs`` dict) has no counterpart on the other side; ``key`` names the field."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


# ----------------------------------------------------------------------------------------------- spec -> args


def spec_to_args(spec: QuantizerSpec, role: str) -> dict[str, Any]:
    """The ``QuantizationArgs`` dict (as compressed-tensors' ``model_dump`` writes it) for a weight or input spec.

    Raises :class:`UnsupportedSpec` for what compressed-tensors cannot express the same way: per-channel or static
    per-group activations, output quantizers. Dynamic inputs are per tensor, per token (``strategy: token``) or per
    token in groups (``strategy: group``, ``dynamic: true``: FP8 block's activations). Block weights are ``strategy:
    block`` with ``block_structure: [rows, cols]``.
    """
    if role not in ("weight", "input", "kv_cache"):
        raise UnsupportedSpec(role, f"{role} quantizers have no compressed-tensors export (weights and inputs only)")
    if role == "kv_cache":
        if spec.format != "fp8_e4m3" or spec.granularity != "tensor" or spec.dynamic:
            raise UnsupportedSpec("kv_cache", "the KV cache is exported as FP8 E4M3 with static per-tensor scales only")
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": None,
            "strategy": "tensor",
            "dynamic": False,
        }
    if spec.format == "nvfp4":
        args: dict[str, Any] = {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "group_size": NVFP4_BLOCK_SIZE,
            "strategy": "tensor_group",
            "dynamic": "local" if role == "input" else False,
            "scale_dtype": "torch.float8_e4m3fn",
        }
        return args
    if spec.format in MX_FORMATS:  # E8M0 scales per 32; inputs per token at run time
        if role == "input" and not spec.dynamic:
            raise UnsupportedSpec(
                "dynamic", f"{spec.format} inputs take their block scales at run time (dynamic = true)"
            )
        return {"num_bits": spec.num_bits, "type": "float", "symmetric": True, "group_size": MX_BLOCK_SIZE,
                "strategy": "group", "dynamic": role == "input", "scale_dtype": "torch.uint8"}  # fmt: skip
    kind = "int" if spec.format.startswith("int") else "float"
    base = {"num_bits": spec.num_bits, "type": kind, "symmetric": spec.symmetric}
    if role == "weight":
        if spec.granularity == "tensor":
            return {**base, "group_size": None, "strategy": "tensor", "dynamic": False}
        if spec.granularity == "block":
            return {**base, "group_size": None, "strategy": "block", "block_structure": list(spec.block_size),
                    "dynamic": False}  # fmt: skip
        if spec.granularity == "channel":
            if spec.axis not in (0, -2):
                raise UnsupportedSpec(
                    "axis", f"per-channel weights need axis 0 (output channels), got axis {spec.axis}"
                )
            return {**base, "group_size": None, "strategy": "channel", "dynamic": False}
        return {**base, "group_size": spec.group_size, "strategy": "group", "dynamic": False}
    if spec.granularity == "token":  # dynamic per token (the spec refuses a static one)
        return {**base, "group_size": None, "strategy": "token", "dynamic": True}
    if spec.granularity == "group" and spec.dynamic:  # per token, in groups of the last dim
        return {**base, "group_size": spec.group_size, "strategy": "group", "dynamic": True}
    if spec.granularity != "tensor":
        raise UnsupportedSpec(
            "granularity",
            f"{'dynamic' if spec.dynamic else 'static'} per-{spec.granularity} input activations have no compressed-tensors "
            "equivalent (use granularity 'tensor', or 'token' or 'group' with dynamic = true)",
        )
    return {**base, "group_size": None, "strategy": "tensor", "dynamic": bool(spec.dynamic)}


def infer_format(weight: QuantizerSpec, input: QuantizerSpec | None) -> str:
    """The compression format of a scheme: compressed-tensors' inference (``compressors/format.py``'s priority),
    except int4 weights with FP8 inputs (W4AFP8), which compressed-tensors infers as int-quantized (one int8 per
    value) where vLLM's W4A8-FP8 scheme reads only pack-quantized tensors (``weight_packed``): those are written
    pack-quantized, the format named in their config group as compressed-tensors' own ``scheme.format`` override."""
    if weight.format == "nvfp4":
        return NVFP4_PACK_QUANTIZED
    if weight.format == "mxfp4":
        return MXFP4_PACK_QUANTIZED
    if weight.format == "mxfp8":
        return MXFP8_QUANTIZED
    w_int = weight.format.startswith("int")
    if w_int and weight.num_bits == 4 and input is not None and input.format == "fp8_e4m3":
        return PACK_QUANTIZED
    if input is not None and w_int:
        return INT_QUANTIZED
    if w_int and (input is None or input.format.startswith("int")):
        return PACK_QUANTIZED
    if input is not None:
        return FLOAT_QUANTIZED
    return NAIVE_QUANTIZED


def scheme_dict(targets: list[str], weight: QuantizerSpec, input: QuantizerSpec | None, fmt: str) -> dict[str, Any]:
    """One ``config_groups`` entry (a ``QuantizationScheme`` dict)."""
    return {
        "targets": list(targets),
        "weights": spec_to_args(weight, "weight"),
        "input_activations": spec_to_args(input, "input") if input is not None else None,
        "output_activations": None,
        "format": fmt,
    }


def quantization_config(
    groups: list[dict[str, Any]],
    ignore: list[str],
    kv_cache: QuantizerSpec | None = None,
    rotations: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The ``quantization_config`` of config.json: what compressed-tensors' ``ModelCompressor.update_config`` writes
    (``QuantizationConfig.model_dump()`` plus ``quant_method``, an empty ``sparsity_config``, and the
    ``transform_config`` of the ``rotations``, module name -> Hadamard block: :func:`transform_config`);
    ``kv_cache`` becomes ``kv_cache_scheme`` (with ``<attention>.k_scale`` / ``v_scale`` tensors)."""
    formats = {g["format"] for g in groups}
    return {
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups)},
        "format": formats.pop() if len(formats) == 1 else MIXED_PRECISION,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": spec_to_args(kv_cache, "kv_cache") if kv_cache is not None else None,
        "moe_sparsity_config": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": STATUS_COMPRESSED,
        "sparsity_config": {},
        "transform_config": transform_config(rotations or {}),
    }


# ----------------------------------------------------------------------------------------------- rotations

#: The one transform type written and read: compressed-tensors' deterministic (Sylvester) Hadamard, which vLLM
#: applies with its fast Hadamard kernel.
TRANSFORM_TYPE = "hadamard"


def rotation_group(block: int) -> str:
    """The ``transform_config.config_groups`` name of the input rotations with Hadamard blocks of ``block``."""
    return f"hadamard_{block}"


def rotation_layout(block: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` of the tensor a rotated Linear stores for its online input transform: the
    unnormalized ``[block, block]`` Sylvester matrix (entries ±1; the loader divides by ``sqrt(block)``), under the
    transform module's name ``<group>_input`` as compressed-tensors and vLLM register it."""
    return {f"{rotation_group(block)}_input.weight": (torch.float32, (block, block))}


def transform_config(rotations: Mapping[str, int]) -> dict[str, Any]:
    """``transform_config`` (a ``TransformConfig.model_dump()``) for Linears whose inputs are rotated, module name ->
    block: per block, one ``hadamard`` scheme with ``head_dim = block`` applied at ``input`` (online: ``x H``) and
    ``weight_input`` (``inverse``: fused into the stored weight, ``W H``). Empty without rotations."""
    by_block: dict[int, list[str]] = {}
    for name, block in rotations.items():
        by_block.setdefault(block, []).append(name)
    if not by_block:
        return {}
    groups = {}
    for block, names in sorted(by_block.items()):
        groups[rotation_group(block)] = {
            "type": TRANSFORM_TYPE,
            "apply": [
                {"targets": list(names), "location": "input", "inverse": False, "ignore": []},
                {"targets": list(names), "location": "weight_input", "inverse": True, "ignore": []},
            ],
            "randomize": False,
            "requires_grad": False,
            "head_dim": block,
            "precision": "torch.float32",
        }
    return {"config_groups": groups}


def parse_transform_config(qc: Mapping[str, Any], modules: Mapping[str, torch.nn.Module]) -> dict[str, int]:
    """Module name -> Hadamard block of the Linears whose inputs a ``quantization_config.transform_config`` rotates
    (what :func:`transform_config` writes: ``hadamard`` schemes with ``head_dim``, applied at ``input`` and, to the
    same modules, fused at ``weight_input``); ValueError messages name the key."""
    where = "quantization_config.transform_config"
    tc = qc.get("transform_config") or {}
    if not isinstance(tc, Mapping):
        raise ValueError(f"{where}: must be an object, got {type(tc).__name__}")
    groups = tc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ValueError(f"{where}.config_groups: must be an object")
    rotations: dict[str, int] = {}
    for gname, scheme in groups.items():
        gwhere = f"{where}.config_groups.{gname}"
        if not isinstance(scheme, Mapping):
            raise ValueError(f"{gwhere}: must be an object")
        if scheme.get("type") != TRANSFORM_TYPE or scheme.get("randomize", False):
            raise ValueError(
                f"{gwhere}.type: only deterministic {TRANSFORM_TYPE!r} rotations are read (randomize = false), got "
                f"{scheme.get('type')!r}{' randomized' if scheme.get('randomize') else ''}"
            )
        block = scheme.get("head_dim")
        if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block & (block - 1):
            raise ValueError(f"{gwhere}.head_dim: must be a power of two (the Hadamard block), got {block!r}")
        applied: dict[str, set[str]] = {"input": set(), "weight_input": set()}
        for i, args in enumerate(scheme.get("apply") or []):
            location = args.get("location") if isinstance(args, Mapping) else None
            if location not in applied:
                raise ValueError(
                    f"{gwhere}.apply[{i}].location: only input (online) and weight_input (fused) rotations are read, "
                    f"got {location!r}"
                )
            if bool(args.get("inverse", False)) != (location == "weight_input"):
                raise ValueError(f"{gwhere}.apply[{i}].inverse: must be {location == 'weight_input'} at {location}")
            targets, ignore = args.get("targets") or [], args.get("ignore") or []
            applied[location] |= {n for n, m in modules.items() if matches(n, m, targets) and not matches(n, m, ignore)}
        if applied["input"] != applied["weight_input"]:
            odd = sorted(applied["input"] ^ applied["weight_input"])[:3]
            raise ValueError(f"{gwhere}.apply: the input and weight_input rotations name different modules ({odd})")
        for name in applied["input"]:
            if name in rotations:
                raise ValueError(f"{gwhere}: module {name!r} is rotated by two schemes")
            rotations[name] = block
    return rotations


# ----------------------------------------------------------------------------------------------- args -> spec

_ARG_KEYS = {
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
    "scale_dtype",
    "zp_dtype",
    "observer",
    "observer_kwargs",
}


def args_to_spec(args: Mapping[str, Any], role: str) -> QuantizerSpec:
    """The :class:`QuantizerSpec` a ``QuantizationArgs`` dict describes; :class:`UnsupportedSpec` names the field."""
    if not isinstance(args, Mapping):
        raise UnsupportedSpec("", f"must be an object, got {type(args).__name__}")
    for key in args:
        if key not in _ARG_KEYS:
            raise UnsupportedSpec(key, "unknown QuantizationArgs field")
    num_bits = args.get("num_bits", 8)
    kind = str(args.get("type", "int")).lower()
    strategy = args.get("strategy")
    group_size = args.get("group_size")
    dynamic = args.get("dynamic", False)
    if isinstance(dynamic, str):
        dynamic = dynamic.lower()
    if strategy is None:  # compressed-tensors infers it from group_size
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    strategy = str(strategy).lower()
    symmetric = args.get("symmetric", True)
    if symmetric is not True and (symmetric is not False or role != "weight" or kind != "int"):
        raise UnsupportedSpec("symmetric", "asymmetric quantization is supported for int weights only")
    block = args.get("block_structure")
    if (block is not None) != (strategy == "block"):
        raise UnsupportedSpec("block_structure", "block_structure goes with strategy 'block', and only with it")
    if block is not None and (
        role != "weight"
        or not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in block)
    ):
        raise UnsupportedSpec("block_structure", f"must be [rows, cols] (positive integers) of a weight, got {block!r}")
    if kind == "float" and args.get("scale_dtype") in ("torch.uint8", "uint8"):  # MX: E8M0 scales
        if num_bits not in (4, 8) or strategy != "group" or group_size != MX_BLOCK_SIZE:
            raise UnsupportedSpec("scale_dtype", "E8M0 (uint8) scales are read as mxfp4 / mxfp8 (group_size 32) only")
        if dynamic is not (role == "input"):
            raise UnsupportedSpec("dynamic", f"mx {role}s need dynamic = {role == 'input'}, got {dynamic!r}")
        return QuantizerSpec(format=f"mxfp{num_bits}", dynamic=role == "input")
    if (kind, num_bits) == ("float", 4):
        if strategy != "tensor_group" or group_size != NVFP4_BLOCK_SIZE:
            raise UnsupportedSpec(
                "strategy", "4-bit float is supported as nvfp4 only (strategy tensor_group, group_size 16)"
            )
        want = "local" if role == "input" else False
        if dynamic != want:
            raise UnsupportedSpec("dynamic", f"nvfp4 {role}s need dynamic = {want!r}, got {dynamic!r}")
        return QuantizerSpec(format="nvfp4")
    formats = {("int", 8): "int8", ("int", 4): "int4", ("float", 8): "fp8_e4m3"}
    if (kind, num_bits) not in formats:
        raise UnsupportedSpec("num_bits", f"{num_bits}-bit {kind} is not supported (int8, int4, fp8, nvfp4)")
    fmt = formats[(kind, num_bits)]
    if dynamic not in (True, False):
        raise UnsupportedSpec("dynamic", f"dynamic {dynamic!r} is only valid for nvfp4 inputs")
    if role == "weight":
        if dynamic:
            raise UnsupportedSpec("dynamic", "dynamic weight quantization is not supported")
        if strategy == "tensor":
            return QuantizerSpec(format=fmt, granularity="tensor", symmetric=symmetric)
        if strategy == "channel":
            return QuantizerSpec(format=fmt, granularity="channel", axis=0, symmetric=symmetric)
        if strategy == "group":
            return QuantizerSpec(format=fmt, granularity="group", group_size=int(group_size), symmetric=symmetric)
        if strategy == "block" and symmetric:
            return QuantizerSpec(format=fmt, granularity="block", block_size=(block[0], block[1]))
        raise UnsupportedSpec(
            "strategy", f"weight strategy {strategy!r} is not supported (tensor, channel, group, symmetric block)"
        )
    if strategy == "token":
        if dynamic is not True:
            raise UnsupportedSpec(
                "dynamic", "per-token input scales are taken at run time: strategy 'token' needs dynamic true"
            )
        return QuantizerSpec(format=fmt, granularity="token", dynamic=True)
    if strategy == "group" and dynamic is True and isinstance(group_size, int) and group_size >= 1:
        return QuantizerSpec(format=fmt, granularity="group", group_size=group_size, dynamic=True)
    if strategy != "tensor":
        raise UnsupportedSpec(
            "strategy", f"input strategy {strategy!r} is not supported (tensor, token, group with dynamic true)"
        )
    return QuantizerSpec(format=fmt, granularity="tensor", dynamic=bool(dynamic))


@dataclass(frozen=True)
class Scheme:
    """One parsed config group: its targets, weight and input specs and compression format."""

    name: str
    targets: tuple[str, ...]
    weight: QuantizerSpec
    input: QuantizerSpec | None
    format: str


def parse_quantization_config(qc: Any, source: str) -> tuple[list[Scheme], list[str]]:
    """``(schemes, ignore)`` from a config.json ``quantization_config``; ValueError messages name the key."""
    where = "quantization_config"
    if not isinstance(qc, Mapping):
        raise ValueError(f"{where}: must be an object, got {type(qc).__name__}")
    if qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{where}.quant_method: expected {QUANT_METHOD!r}, got {qc.get('quant_method')!r}")
    status = qc.get("quantization_status", STATUS_COMPRESSED)
    if status != STATUS_COMPRESSED:
        raise ValueError(
            f"{where}.quantization_status: only {STATUS_COMPRESSED!r} checkpoints are read, got {status!r}"
        )
    top_format = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}.config_groups: must be a non-empty object")
    schemes = []
    for gname, group in groups.items():
        gwhere = f"{where}.config_groups.{gname}"
        if not isinstance(group, Mapping):
            raise ValueError(f"{gwhere}: must be an object (preset names are not supported)")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise ValueError(f"{gwhere}.targets: must be a non-empty list of strings")
        if group.get("weights") is None:
            raise ValueError(f"{gwhere}.weights: activation-only schemes are not supported")
        if group.get("output_activations") is not None:
            raise ValueError(f"{gwhere}.output_activations: output quantization is not supported")
        specs = {}
        for role, key in (("weight", "weights"), ("input", "input_activations")):
            if group.get(key) is None:
                specs[role] = None
                continue
            try:
                specs[role] = args_to_spec(group[key], role)
            except UnsupportedSpec as exc:
                raise ValueError(f"{gwhere}.{key}{'.' + exc.key if exc.key else ''}: {exc}") from None
            except SpecError as exc:
                raise ValueError(f"{gwhere}.{key}.{exc.key}: {exc}") from None
        fmt = group.get("format") or top_format
        expected = infer_format(specs["weight"], specs["input"])
        if fmt != expected:
            raise ValueError(f"{gwhere}.format: this scheme is stored as {expected!r}, the config says {fmt!r}")
        schemes.append(Scheme(str(gname), tuple(targets), specs["weight"], specs["input"], fmt))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise ValueError(f"{where}.ignore: must be a list of strings")
    return schemes, ignore


def parse_kv_cache_scheme(qc: Mapping[str, Any]) -> QuantizerSpec | None:
    """The KV-cache spec of a ``quantization_config``'s ``kv_cache_scheme`` (FP8 per tensor, static), or None;
    ValueError messages name the key."""
    args = qc.get("kv_cache_scheme")
    if args is None:
        return None
    where = "quantization_config.kv_cache_scheme"
    try:
        spec = args_to_spec(args, "input")
    except (UnsupportedSpec, SpecError) as exc:
        raise ValueError(f"{where}{'.' + exc.key if exc.key else ''}: {exc}") from None
    if spec.format != "fp8_e4m3" or spec.granularity != "tensor" or spec.dynamic:
        raise ValueError(f"{where}: only FP8 (8-bit float) per-tensor static k/v scales are supported")
    return spec


def _match_one(name: str, module: torch.nn.Module, target: str) -> bool:
    """compressed-tensors' ``is_match`` for one target: ``re:`` regex (``re.match``), exact name, or a class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(cls.__name__ == target for cls in type(module).__mro__)


def matches(name: str, module: torch.nn.Module, targets: Iterable[str]) -> bool:
    return any(_match_one(name, module, t) for t in targets)


# ----------------------------------------------------------------------------------------------- tensor layout


def tensor_layout(
    fmt: str, weight: QuantizerSpec, input: QuantizerSpec | None, out_f: int, in_f: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` of the tensors one quantized Linear stores (its ``bias``, if any, not included).

    ``weight`` (int8 / float8_e4m3fn) or ``weight_packed`` (int32 for pack-quantized, eight int4 or four int8 per
    word; uint8 for nvfp4, two E2M1 codes per byte) + ``weight_shape`` (int64 ``[2]``, pack-quantized only);
    ``weight_scale`` (float32 ``[1]`` / ``[out, 1]`` / ``[out, in/group]``; float8_e4m3fn ``[out, in/16]`` for nvfp4);
    ``weight_zero_point`` (asymmetric weights: int8 of the scale's shape, or for pack-quantized int32 with
    ``32 // bits`` zero points per word along the output dim); ``weight_global_scale`` (nvfp4); ``input_scale`` (float32 ``[1]``, static inputs) or ``input_global_scale``
    (float32 ``[1]``, nvfp4 inputs).
    """
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    if fmt in (MXFP4_PACK_QUANTIZED, MXFP8_QUANTIZED):
        if fmt == MXFP4_PACK_QUANTIZED:
            out["weight_packed"] = (torch.uint8, (out_f, in_f // 2))
        else:
            out["weight"] = (torch.float8_e4m3fn, (out_f, in_f))
        out["weight_scale"] = (torch.uint8, (out_f, in_f // MX_BLOCK_SIZE))
        return out
    if fmt == NVFP4_PACK_QUANTIZED:
        out["weight_packed"] = (torch.uint8, (out_f, in_f // 2))
        out["weight_scale"] = (torch.float8_e4m3fn, (out_f, in_f // NVFP4_BLOCK_SIZE))
        out["weight_global_scale"] = (torch.float32, (1,))
    else:
        if weight.granularity == "tensor":
            scale_shape: tuple[int, ...] = (1,)
        elif weight.granularity == "channel":
            scale_shape = (out_f, 1)
        elif weight.granularity == "block":
            rows, cols = weight.block_size
            scale_shape = (-(-out_f // rows), -(-in_f // cols))
        else:
            scale_shape = (out_f, in_f // weight.group_size)
        if fmt == PACK_QUANTIZED:
            per_word = 32 // weight.num_bits
            out["weight_packed"] = (torch.int32, (out_f, -(-in_f // per_word)))
            out["weight_shape"] = (torch.int64, (2,))
        else:
            out["weight"] = (torch.int8 if weight.format.startswith("int") else torch.float8_e4m3fn, (out_f, in_f))
        out["weight_scale"] = (SCALE_DTYPE, scale_shape)
        if not weight.symmetric:
            zp_rows = -(-scale_shape[0] * weight.num_bits // 32) if fmt == PACK_QUANTIZED else scale_shape[0]
            zp_dtype = torch.int32 if fmt == PACK_QUANTIZED else torch.int8
            out["weight_zero_point"] = (zp_dtype, (zp_rows,) + scale_shape[1:])
    if input is not None and not input.dynamic:
        if input.format == "nvfp4":
            out["input_global_scale"] = (torch.float32, (1,))
        else:
            out["input_scale"] = (SCALE_DTYPE, (1,))
    return out
