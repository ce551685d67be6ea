"""``QuantLinear``: quantizers inserted into a model's ``nn.Linear`` modules in place.

Insertion changes the module's class (``module.__class__ = QuantLinear``) and adds ``input_quantizer``,
``weight_quantizer`` and ``output_quantizer`` submodules (``None`` where the recipe has no such quantizer). The
module object, its parameters and their names stay the same: ``...q_proj.weight`` is still ``...q_proj.weight``,
the state dict only gains the quantizers' ``amax`` buffers (``...q_proj.input_quantizer.amax``), and FSDP2,
which keeps references to the module objects and re-registers the unsharded parameters on them, keeps working.

A QuantLinear may also rotate its input (:func:`rotate_inputs`): ``forward(x)`` then computes ``(x H) (W H)^T``
with ``H`` an orthonormal block-diagonal Hadamard (:func:`shardcal.quant.hadamard.hadamard_blocks`), ``W H``
folded into the weight parameter once and ``x H`` computed on every call, before the input quantizer. In full
precision the function is unchanged (up to rounding); quantized, the rotation spreads outlier channels over their
block. ``input_rotation`` is the block size (None: no rotation).

Insert before or after ``fully_shard``; after is what the runner does (it calls
``shardcal.calib.attach.quantize_modules`` on each sharded decoder layer with the layer's name as ``prefix``). The quantizer buffers go on the weight's device (the
local shard's device for a DTensor weight); the weight quantizer's shape is the full (global) weight shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .hadamard import hadamard_blocks, hadamard_blocks_by_factors
from .quantizer import TensorQuantizer
from .reuse import LastResult, reusable
from .spec import QuantizerSpec

_QUANT_CLASSES: dict[type, type] = {}


def _weight_device(weight: torch.Tensor) -> torch.device:
    from torch.distributed.tensor import DTensor

    return weight.to_local().device if isinstance(weight, DTensor) else weight.device


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` whose input, weight and (optionally) output go through :class:`TensorQuantizer` s.

    ``forward(x) = output_quantizer(F.linear(input_quantizer(x), weight_quantizer(self.weight), self.bias))``,
    each quantizer skipped when it is ``None``, and ``x`` first rotated when ``input_rotation`` is set. Made from an
    existing Linear with :meth:`from_linear` (in place).
    """

    #: The Hadamard block rotating the input (see :func:`rotate_inputs`), or None.
    input_rotation: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.input_quantizer: TensorQuantizer | None = None
        self.weight_quantizer: TensorQuantizer | None = None
        self.output_quantizer: TensorQuantizer | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = rotated_input(self, input)
        if self.input_quantizer is not None:
            input = self.input_quantizer(input)
        weight = self.weight
        if self.weight_quantizer is not None:
            weight = self.weight_quantizer(weight)
        out = F.linear(input, weight, self.bias)
        if self.output_quantizer is not None:
            out = self.output_quantizer(out)
        return out

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        weight: QuantizerSpec | None = None,
        input: QuantizerSpec | None = None,
        output: QuantizerSpec | None = None,
        name: str = "linear",
    ) -> QuantLinear:
        """Turn ``linear`` into a QuantLinear in place (same object, same parameters) and return it.

        ``name`` (the module's path) appears in errors, e.g. a group size that does not divide ``in_features``
        (a :class:`ValueError`). An existing QuantLinear gets its quantizers replaced.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name}: expected an nn.Linear, got {type(linear).__name__}")
        device = _weight_device(linear.weight)
        out_f, in_f = linear.out_features, linear.in_features
        quantizers = {
            "input_quantizer": (input, (in_f,)),
            "weight_quantizer": (weight, (out_f, in_f)),
            "output_quantizer": (output, (out_f,)),
        }
        built = {
            attr: TensorQuantizer(spec, shape, device=device, name=f"{name}.{attr}") if spec is not None else None
            for attr, (spec, shape) in quantizers.items()
        }  # build all first: a bad spec leaves the module untouched
        linear.__class__ = _quant_class(type(linear))
        for attr, q in built.items():
            if attr in linear._modules:
                del linear._modules[attr]
            setattr(linear, attr, q)
        return linear  # type: ignore[return-value]


def _quant_class(cls: type) -> type:
    """QuantLinear for a plain Linear; for a Linear subclass (e.g. FSDP2's ``FSDPLinear``), a subclass of both."""
    if issubclass(cls, QuantLinear):
        return cls
    if cls is nn.Linear:
        return QuantLinear
    if cls not in _QUANT_CLASSES:
        _QUANT_CLASSES[cls] = type(f"Quant{cls.__name__}", (QuantLinear, cls), {"__module__": cls.__module__})
    return _QUANT_CLASSES[cls]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


#: Weight elements rotated at a time: the float64 temporaries stay near 32 MiB whatever the weight's size.
_ROTATE_CHUNK = 2**20


def _rotate_weight(linear: nn.Linear, block: int) -> None:
    """``W <- W H`` in place, computed in float64: each row on its own (in chunks of rows), so a sharded weight
    rotates its local rows (FSDP2 shards rows) to the same bits as the full weight would. Applying it twice
    undoes it."""
    local = _local(linear.weight)
    if local.device.type == "meta" or local.numel() == 0:
        return
    rows = max(1, _ROTATE_CHUNK // local.shape[-1])
    with torch.no_grad():
        for chunk in local.split(rows):
            chunk.copy_(hadamard_blocks(chunk.detach().to(torch.float64), block).to(chunk.dtype))


def rotate_inputs(linear: QuantLinear, block: int) -> None:
    """Rotate ``linear``'s inputs by the Hadamard blocks of size ``block``: fold ``H`` into its weight (``W H``) and
    set ``input_rotation``, so that ``forward`` computes ``(x H) (W H)^T``, the same function in full precision. A
    :class:`ValueError` when ``block`` does not divide ``in_features`` or the inputs are rotated already."""
    if linear.input_rotation is not None:
        raise ValueError(f"the inputs of this Linear are rotated already (block {linear.input_rotation})")
    if linear.in_features % block:
        raise ValueError(f"rotation block {block} does not divide in_features {linear.in_features}")
    _rotate_weight(linear, block)
    linear.input_rotation = block


def unrotated_weight(linear: nn.Module) -> torch.Tensor:
    """``linear``'s weight in its inputs' own channels: ``(W H) H = W`` (float32) for a Linear that rotates its
    inputs, else its weight (detached)."""
    block = getattr(linear, "input_rotation", None)
    weight = linear.weight.detach()
    return weight if block is None else hadamard_blocks(weight.to(torch.float64), block).float()


@torch.no_grad()
def scale_input_columns_(linear: nn.Module, factor: torch.Tensor) -> None:
    """Multiply ``linear``'s weight column ``j`` by ``factor[j]`` in the inputs' own channels (in place): ``W H``
    becomes ``(W diag(factor)) H`` for a Linear that rotates its inputs (computed in float64)."""
    block = getattr(linear, "input_rotation", None)
    weight = linear.weight
    if block is None:
        weight.copy_((weight.float() * factor[None, :]).to(weight.dtype))
        return
    plain = hadamard_blocks(weight.detach().to(torch.float64), block) * factor.to(torch.float64)[None, :]
    weight.copy_(hadamard_blocks(plain, block).to(weight.dtype))


_LAST_ROTATION = LastResult()  # q / k / v (gate / up) rotate one input tensor: once


def rotated_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``module``'s weight sees of its input ``x``: ``x H`` for a QuantLinear with an input rotation, else
    ``x`` itself (what hooks that record a Linear's inputs for an algorithm use). Linears that share their input
    and block share one rotation of it (:mod:`shardcal.quant.reuse`)."""
    block = getattr(module, "input_rotation", None)
    if block is None:
        return x
    keep = reusable(x)
    out = _LAST_ROTATION.get(x, (block,)) if keep else None
    if out is None:
        out = hadamard_blocks_by_factors(x, block)
        if keep:
            _LAST_ROTATION.put(x, (block,), out)
    return out


def remove_quantizers(module: nn.Module) -> int:
    """Turn every QuantLinear under ``module`` back into its original Linear class, without quantizers (the inverse
    of :meth:`QuantLinear.from_linear`; a rotated weight is rotated back, other parameters are untouched); return
    how many."""
    originals = {quant: cls for cls, quant in _QUANT_CLASSES.items()}
    count = 0
    for sub in module.modules():
        if isinstance(sub, QuantLinear):
            if sub.input_rotation is not None:
                _rotate_weight(sub, sub.input_rotation)
                sub.__dict__.pop("input_rotation", None)
            for attr in ("input_quantizer", "weight_quantizer", "output_quantizer"):
                sub._modules.pop(attr, None)
                sub.__dict__.pop(attr, None)
            sub.__class__ = originals.get(type(sub), nn.Linear)
            count += 1
    return count


def quantized_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, QuantLinear]]:
    """``(name, module)`` for every QuantLinear under ``module``."""
    return [(n, m) for n, m in module.named_modules(prefix=prefix) if isinstance(m, QuantLinear)]
