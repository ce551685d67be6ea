"""What the planner reads of a model directory: ``config.json`` and the safetensors headers (never a weight), the model
built on the meta device (:mod:`.structure`), and its parameters as ``load_pretrained`` will hold them (:class:`Param`).

The headers are checked as the loader checks them, with the same errors; a directory with only ``config.json`` is
planned from the shapes the model has, in its dtype.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..algorithms.residual import root_modules, untie_word_embeddings
from ..errors import CheckpointError, PlanError
from ..loading.build import build_on_meta, check_checkpoint_keys, module_dtype, resolve_dtype
from ..loading.foreign import build_transformers_on_meta, choose_impl, raw_config
from ..loading.sources import resolve_sources
from ..models.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointReader
from ..models.config import ModelConfig, load_config
from ..models.published import is_published
from .structure import Linear, ModelStructure, read_structure


@dataclass(frozen=True, kw_only=True)
class Param:
    """One parameter as ``load_pretrained`` holds it: its FSDP2 unit and whether it is sharded over the ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # in memory
    file_dtype: torch.dtype  # in the checkpoint (the memory dtype when planning from config.json alone)
    file_bytes: float = 0.0  # bytes per value in the checkpoint (0: ``file_dtype``'s; a published FP8 / MXFP4
    # tensor: its codes and scales over its values)
    unit: str  # the FSDP2 unit that gathers it: a decoder layer's name, "lm_head" or "<root>"
    sharded: bool
    row_numel: int = field(init=False, repr=False)  # elements per dim-0 row

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_numel", math.prod(self.shape[1:]))
        if not self.file_bytes:
            object.__setattr__(self, "file_bytes", float(self.file_dtype.itemsize))

    @property
    def numel(self) -> int:
        return self.shape[0] * self.row_numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def build_params(
    structure: ModelStructure,
    dtype: torch.dtype,
    file_dtypes: Mapping[str, torch.dtype] | None,
    shard_root: bool,
    file_bytes: Mapping[str, float] | None = None,
) -> list[Param]:
    """The parameters as ``load_pretrained`` holds them: memory dtype (``dtype``, or as built for a class the loader
    does not cast; float32 routers kept when the checkpoint stores them so), file dtype, FSDP2 unit, sharded or
    replicated (off the dominant dtype; outside the decoder stack and its side units with ``shard_root=False``)."""
    shapes, built, files = structure.params, structure.built_dtypes, dict(file_dtypes or {})
    dtypes = {n: built[n] if built is not None else dtype for n, _ in shapes}
    for n in structure.routers:
        if files.get(n) == torch.float32:
            dtypes[n] = torch.float32
    counts: dict[torch.dtype, int] = {}
    for n, s in shapes:
        counts[dtypes[n]] = counts.get(dtypes[n], 0) + math.prod(s)
    dominant = max(counts, key=lambda d: counts[d])
    wrapped = set(structure.layer_names) | {u for u in structure.side_units if u != "lm_head"}
    out = []
    for n, s in shapes:
        unit = structure.units[n]
        sharded = dtypes[n] == dominant and (unit in wrapped or shard_root)
        file_dtype = files.get(n, dtypes[n])
        out.append(Param(name=n, shape=s, dtype=dtypes[n], file_dtype=file_dtype, unit=unit, sharded=sharded,
                         file_bytes=(file_bytes or {}).get(n, 0.0)))  # fmt: skip
    return out


@dataclass(kw_only=True)
class ModelSource:
    """What the plan knows about a model directory: its config (shardcal's :class:`ModelConfig`; None for a class
    only transformers has), its structure (the model on the meta device, read as tables) and, when there are
    weights, their header dtypes."""

    config: ModelConfig | None
    file_dtypes: dict[str, torch.dtype] | None  # None: config.json only
    checkpoint_bytes: int  # the checkpoint's tensor data (from the headers), or the config's size in its dtype
    file_bytes: dict[str, float] | None = None  # bytes per value where the checkpoint stores other than its dtype
    structure: ModelStructure | None = None  # None: built from ``config`` (shardcal's class) when first needed
    _params: dict[Any, list[Param]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def model_structure(self) -> ModelStructure:
        """The structure, built once (from shardcal's class for ``config`` when none was given)."""
        if self.structure is None:
            if self.config is None:
                raise PlanError("ModelSource needs a config or a structure")
            self.structure = shardcal_structure(self.config)
        return self.structure

    def tensors(self) -> tuple[list[tuple[str, tuple[int, ...]]], list[Linear]]:
        """Every parameter ``(name, shape)`` in ``named_parameters`` order and every Linear (fused experts' per-expert
        projections included)."""
        structure = self.model_structure()
        return structure.params, structure.linears

    def untied(self) -> ModelSource:
        """This source as ``load_pretrained(..., untie_word_embeddings=True)`` loads it: a head tied to the
        embeddings becomes a parameter of its own (an FSDP2 unit, stored by the export), read from the same tensor."""
        st = self.model_structure()
        model = copy.deepcopy(st.model)  # on the meta device: shapes only
        names = {id(p): n for n, p in model.named_parameters()}
        embed = root_modules(model)[0]
        if not untie_word_embeddings(model):
            return self
        structure = read_structure(
            model,
            st.model_type,
            hidden_size=st.hidden_size,
            num_attention_heads=st.num_attention_heads,
            head_dim=st.head_dim,
            built_dtypes=st.built_dtypes is not None,
        )
        files, per_value = None, self.file_bytes
        if self.file_dtypes is not None:
            head = next(n for n, _ in structure.params if n not in self.file_dtypes)
            files = {**self.file_dtypes, head: self.file_dtypes[names[id(embed.weight)]]}
            if per_value and names[id(embed.weight)] in per_value:
                per_value = {**per_value, head: per_value[names[id(embed.weight)]]}
        return ModelSource(
            config=self.config, file_dtypes=files, checkpoint_bytes=self.checkpoint_bytes, structure=structure,
            file_bytes=per_value,
        )  # fmt: skip

    def params(self, dtype: torch.dtype, shard_root: bool) -> list[Param]:
        """:func:`build_params` for this source, computed once per dtype and ``shard_root``."""
        key = (dtype, shard_root)
        if key not in self._params:
            self._params[key] = build_params(
                self.model_structure(), dtype, self.file_dtypes, shard_root, file_bytes=self.file_bytes
            )
        return self._params[key]


def shardcal_structure(cfg: ModelConfig) -> ModelStructure:
    """The structure of shardcal's class for ``cfg`` (built on the meta device; shapes only, dtypes as asked)."""
    model = build_on_meta(cfg, torch.float32)
    return read_structure(
        model,
        cfg.model_type,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        built_dtypes=False,
    )


def model_tensors(cfg: ModelConfig) -> tuple[list[tuple[str, tuple[int, ...]]], list[Linear]]:
    """Every parameter ``(name, shape)`` of shardcal's model for ``cfg``, in ``named_parameters`` order, and every
    Linear module — read from the model built on the meta device."""
    structure = shardcal_structure(cfg)
    return structure.params, structure.linears


def read_source(model_dir: str | Path, dtype: torch.dtype | str | None = None, impl: str = "auto") -> ModelSource:
    """Read ``config.json`` and, if present, the safetensors headers of ``model_dir`` (never the weights), and build
    the model on the meta device: shardcal's class, or transformers' (``impl``: ``auto`` takes shardcal's when it
    has one, as ``--model-impl`` does).

    The headers are checked as the loader checks them (every tensor present, the shapes the model has, float
    dtypes, nothing unexpected), with the same errors. A directory with only ``config.json`` is planned from the
    shapes the model has, in its dtype.
    """
    if choose_impl(model_dir, impl) == "transformers":
        return _read_foreign_source(Path(model_dir), dtype)
    cfg = load_config(model_dir)
    _refuse_quantized(cfg.raw, model_dir)
    target = resolve_dtype(cfg, dtype)
    structure = shardcal_structure(cfg)
    folder = Path(model_dir)
    if not _has_weights(folder):
        size = sum(math.prod(s) for _, s in structure.params) * target.itemsize
        return ModelSource(config=cfg, file_dtypes=None, checkpoint_bytes=size, structure=structure)
    with CheckpointReader(folder) as reader:
        check_checkpoint_keys(structure.model, reader, cfg)
        expected = dict(structure.params)
        if cfg.tie_word_embeddings and "lm_head.weight" in reader:
            expected["lm_head.weight"] = reader.shape("lm_head.weight")
        dtypes = {name: reader.dtype(name) for name in expected}
        nbytes = {name: reader.stored_nbytes(name) for name in expected}
    per_value = _published_bytes(nbytes, {n: math.prod(s) for n, s in expected.items()}, dtypes)
    return ModelSource(
        config=cfg, file_dtypes=dtypes, checkpoint_bytes=sum(nbytes.values()), structure=structure,
        file_bytes=per_value,
    )  # fmt: skip


def _published_bytes(
    nbytes: Mapping[str, int], numel: Mapping[str, int], dtypes: Mapping[str, torch.dtype]
) -> dict[str, float]:
    """Bytes per value of the parameters the checkpoint stores in other than their file dtype's bytes (a published
    FP8 weight with its scales, MXFP4 experts: half a byte a value and their scales)."""
    per_value = {n: nbytes[n] / numel[n] for n in nbytes if numel[n]}
    return {n: b for n, b in per_value.items() if b != dtypes[n].itemsize}


def _module_dtype(model: torch.nn.Module, folder: Path, dtype: torch.dtype | str) -> torch.dtype:
    """The dtype the loader casts transformers' ``model`` to for ``dtype`` (``"auto"``: the checkpoint's own)."""
    if dtype != "auto" or not _has_weights(folder):
        return module_dtype(dtype, None, ())
    with CheckpointReader(folder) as reader:
        return module_dtype(dtype, reader, (k for src in resolve_sources(model, reader).values() for k in src.keys()))


def _refuse_quantized(raw: Mapping[str, Any], model_dir: str | Path) -> None:
    if raw.get("quantization_config") is not None and not is_published(raw):
        raise CheckpointError(
            f"{model_dir}: load_pretrained reads unquantized checkpoints; load an exported (quantized) directory "
            "with shardcal.models.from_pretrained"
        )


def _has_weights(folder: Path) -> bool:
    """Whether ``folder`` has safetensors weights (raising the loader's error for pickled or unindexed ones)."""
    if (folder / INDEX_NAME).is_file() or (folder / SINGLE_NAME).is_file():
        return True
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.safetensors")):
        CheckpointReader(folder)  # raises the loader's error
    return False


def _read_foreign_source(folder: Path, dtype: torch.dtype | str | None) -> ModelSource:
    """A model only transformers has a class for: built on the meta device, its parameters found in the checkpoint
    as the loader finds them (:func:`~shardcal.loading.sources.resolve_sources`)."""
    raw = raw_config(folder)
    _refuse_quantized(raw, folder)
    model = build_transformers_on_meta(folder)
    if dtype is not None:  # load_pretrained(dtype=) casts every floating parameter
        target = _module_dtype(model, folder, dtype)
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(target)
    structure = read_structure(model, str(raw.get("model_type")))
    held = dict(model.named_parameters())
    if not _has_weights(folder):
        size = sum(p.numel() * p.element_size() for p in held.values())
        return ModelSource(config=None, file_dtypes=None, checkpoint_bytes=size, structure=structure)
    with CheckpointReader(folder) as reader:
        sources = resolve_sources(model, reader)
        dtypes = {name: reader.dtype(src.parts[0][0]) for name, src in sources.items()}
        keys = {k for src in sources.values() for k in src.keys()}
        stored = sum(reader.stored_nbytes(k) for k in keys)
        nbytes = {name: sum(reader.stored_nbytes(k) for k in set(src.keys())) for name, src in sources.items()}
    per_value = _published_bytes(nbytes, {n: held[n].numel() for n in nbytes}, dtypes)
    return ModelSource(
        config=None, file_dtypes=dtypes, checkpoint_bytes=stored, structure=structure, file_bytes=per_value
    )
