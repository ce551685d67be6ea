"""Where each parameter of a module comes from in a checkpoint, so that any module can be loaded row by row.

A parameter's state-dict name is looked up in the checkpoint as it is, through the caller's ``name_map``, or in the
layouts original checkpoints use where transformers' modules differ from them:

* fused MoE experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are stored per
  expert (``mlp.experts.{e}.gate_proj.weight`` ..., or Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``): the
  source stacks the experts, and a rank reading rows ``[a, b)`` of dim 0 reads experts ``a .. b-1`` only;
* a VLM's language model and towers live under ``model.`` in the module (``model.language_model.layers``) and at
  the top in Llava-style checkpoints (``language_model.model.layers``, ``vision_tower``, ``language_model.lm_head``).

A module's persistent buffers (DeepSeek-V3's router ``e_score_correction_bias``) are looked up the same way
(:func:`resolve_buffers`) and loaded when the checkpoint holds them; only a tensor that is neither a parameter nor
a buffer of the module is refused as unexpected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.checkpoint import CheckpointReader
from ..sharding.fsdp2 import persistent_buffers
from .build import IGNORED_KEY_SUFFIXES, named_keys

NameMap = Mapping[str, str] | Callable[[str], str]

#: Per-expert names of the gate, up and down projections in original checkpoints.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: Module prefix -> checkpoint prefix of Llava-style VLM checkpoints (first match wins).
_VLM_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


@dataclass
class Source:
    """A parameter's tensor in the checkpoint: ``parts[i]`` are the keys concatenated (dim 0) into slice ``i`` of a
    stacked parameter; a plain parameter has one slice of one key and ``stacked`` False."""

    parts: list[list[str]]
    stacked: bool = False

    def shape(self, reader: CheckpointReader) -> tuple[int, ...]:
        if not self.stacked:
            return reader.shape(self.parts[0][0])
        first = [reader.shape(k) for k in self.parts[0]]
        return (len(self.parts), sum(s[0] for s in first), *first[0][1:])

    def keys(self) -> list[str]:
        return [k for part in self.parts for k in part]

    def rows(
        self,
        reader: CheckpointReader,
        start: int,
        stop: int,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 (experts, for a stacked parameter), reading nothing else; in ``dtype`` (None:
        as the reader gives them: a published FP8 weight's in float32), written into ``out`` where given (their shape
        and that dtype: a buffer reused from an earlier layer), else into a new tensor. A 0-d tensor is read whole."""
        shape = self.shape(reader)
        dtype = dtype or (out.dtype if out is not None else reader.value_dtype(self.parts[0][0]))
        want = (stop - start, *shape[1:]) if shape else ()
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif tuple(out.shape) != want or out.dtype != dtype:
            raise ValueError(
                f"{self.parts[0][0]}: rows read into {list(out.shape)} {out.dtype}, not {list(want)} {dtype}"
            )
        if not self.stacked:
            return reader.read_into(self.parts[0][0], out, start)
        for row, expert in enumerate(range(start, stop)):  # each expert's keys straight into their rows
            offset = 0
            for key in self.parts[expert]:
                rows = reader.shape(key)[0]
                reader.read_into(key, out[row, offset : offset + rows])
                offset += rows
        return out

    def full(
        self, reader: CheckpointReader, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole tensor, in ``dtype`` (None: as :meth:`rows`), into ``out`` where given."""
        shape = self.shape(reader)
        return self.rows(reader, 0, shape[0] if shape else 0, dtype, out)


def _candidates(name: str, name_map: NameMap | None) -> list[str]:
    if name_map is not None:
        mapped = name_map(name) if callable(name_map) else name_map.get(name, name)
        return [mapped]
    out = [name]
    for module_prefix, checkpoint_prefix in _VLM_PREFIXES:
        if name.startswith(module_prefix):
            out.append(checkpoint_prefix + name[len(module_prefix) :])
            break
    return out


def _expert_source(name: str, param: torch.Tensor, reader: CheckpointReader, name_map: NameMap | None) -> Source | None:
    """Per-expert keys of a fused experts parameter (``.../experts.gate_up_proj`` or ``.../experts.down_proj``)."""
    module, _, leaf = name.rpartition(".")
    if param.dim() != 3 or leaf not in ("gate_up_proj", "down_proj"):
        return None
    prefixes = {module, module.replace(".mlp.", ".block_sparse_moe.")}
    for prefix in sorted(prefixes):
        for gate, up, down in _EXPERT_NAMES:
            projections = (gate, up) if leaf == "gate_up_proj" else (down,)
            parts = [[f"{prefix}.{e}.{p}.weight" for p in projections] for e in range(param.shape[0])]
            resolved = [[_find(k, reader, name_map) for k in part] for part in parts]
            if all(k is not None for part in resolved for k in part):
                return Source(resolved, stacked=True)  # type: ignore[arg-type]
    return None


def _find(key: str, reader: CheckpointReader, name_map: NameMap | None) -> str | None:
    return next((k for k in _candidates(key, name_map) if k in reader), None)


def resolve_sources(model: nn.Module, reader: CheckpointReader, name_map: NameMap | None = None) -> dict[str, Source]:
    """Every parameter's source, checked: none missing, shapes equal, no unexpected tensor in the checkpoint.

    Errors (:class:`CheckpointError`) name the file and the tensors.
    """
    sources: dict[str, Source] = {}
    missing = []
    for name, param in model.named_parameters():
        key = _find(name, reader, name_map)
        source = Source([[key]]) if key is not None else _expert_source(name, param, reader, name_map)
        if source is None:
            missing.append(name)
            continue
        sources[name] = source
    if missing:
        raise CheckpointError(
            f"{reader.source}: {len(missing)} parameter(s) of {type(model).__name__} are not in the checkpoint: "
            f"{named_keys(missing)} (pass name_map= to say under which names they are stored)"
        )
    used = {k for s in sources.values() for k in s.keys()}
    used |= set(resolve_buffers(model, reader, name_map).values())
    used |= {k for n, _ in model.named_buffers() for k in _candidates(n, name_map)}  # computed ones: allowed
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(sources)  # tied: may be stored
    used |= {k for n in aliases for k in _candidates(n, name_map)}
    unexpected = [k for k in reader.keys() if k not in used and not k.endswith(IGNORED_KEY_SUFFIXES)]
    if unexpected:
        raise CheckpointError(
            f"{reader.file_of(unexpected[0])}: unexpected tensor(s) {named_keys(unexpected)} (neither parameters nor "
            f"buffers of {type(model).__name__})"
        )
    params = dict(model.named_parameters())
    for name, source in sources.items():
        found, want = source.shape(reader), tuple(params[name].shape)
        if found != want:
            raise CheckpointError(
                f"{reader.file_of(source.parts[0][0])}: {source.parts[0][0]!r} gives shape {list(found)} for "
                f"{name!r}, the module has {list(want)}"
            )
    return sources


def resolve_buffers(model: nn.Module, reader: CheckpointReader, name_map: NameMap | None = None) -> dict[str, str]:
    """Persistent buffer name -> its checkpoint key, for every persistent buffer the checkpoint holds, checked:
    the stored shape must be the buffer's (:class:`CheckpointError` naming the file and the key). A persistent
    buffer the checkpoint lacks keeps the value the module computed (as transformers does)."""
    found: dict[str, str] = {}
    for name, buf in persistent_buffers(model).items():
        key = _find(name, reader, name_map)
        if key is None:
            continue
        if tuple(reader.shape(key)) != tuple(buf.shape):
            raise CheckpointError(
                f"{reader.file_of(key)}: {key!r} has shape {list(reader.shape(key))}, the buffer {name!r} of "
                f"{type(model).__name__} has {list(buf.shape)}"
            )
        found[name] = key
    return found
