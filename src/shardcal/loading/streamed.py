"""``load_streamed``: a model whose decoder layers stay on disk until their step, for models larger than memory.

Everything outside the decoder stack (embeddings, final norm, LM head, towers) is loaded as :func:`load_pretrained`
loads it — FSDP2-sharded, each rank reading its own rows. The decoder layers' parameters stay on the meta device.
When a step holds layer ``i`` (:mod:`shardcal.sharding.residency`), every rank holds the whole layer, as a resident
run's gather gives it. The layer's tensors are read with plain reads (:class:`~shardcal.models.reads.ReadingReader`:
no memory map, so no file page stays in the process): on several GPUs each rank reads its own rows and the ranks
gather them (NCCL), on CPU or alone each rank reads the whole layer (:func:`reads_layers_whole`). While the step
computes, a thread reads what this rank reads of layer ``i + 1``. When the step is done the hooks registered with
:meth:`StreamedLayers.on_release` run (the export writes the layer), then the parameters go back to the meta device:
at most the layer in its step, the next layer's read and the activations are in memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.config import load_config
from ..models.published import is_published
from ..models.reads import ReadingReader
from ..runtime.distributed import all_gather_rows_, row_range, world
from ..sharding.fsdp2 import DISTRIBUTION_PLAN_ATTR, default_mesh, dominant_dtype, fsdp2_units, init_fsdp2_root
from ..sharding.registry import decoder_layer_prefix, require_decoder_layers
from ..sharding.residency import RESIDENCY_ATTR, ResidentLayers, decoder_layers_replaced
from .build import (
    build_on_meta,
    check_checkpoint_keys,
    module_dtype,
    param_dtypes,
    resolve_dtype,
    set_param_dtypes,
)
from .foreign import build_transformers_on_meta, raw_config
from .sharded import real_buffers
from .sources import Source, resolve_buffers, resolve_sources


def reads_layers_whole(device_type: str, world_size: int) -> bool:
    """Whether each rank of a streamed run reads every decoder layer whole instead of its rows and an all-gather:
    alone (its rows are the layer: held as read, not copied into a gathered one), or with several ranks on CPU.
    There the ranks of a host read the same file pages (the second from the page cache, one copy), where gloo's
    all-gather copies the layer through loopback sockets on every rank; on GPUs the gather (NCCL) is the cheap way,
    and each rank copies only its rows from the host."""
    return world_size == 1 or device_type == "cpu"


class StreamedLayers(ResidentLayers):
    """The decoder layers of a streamed model: read in for their step, released after it (see the module docstring).

    ``bytes_read``: what this rank read of the layers so far; ``reads_whole``: each rank reads every layer whole
    (:func:`reads_layers_whole`, decided once); ``on_release(hook)``: ``hook(index, layer)`` runs on a
    held layer just before its parameters are released (every rank, in registration order)."""

    streamed = True

    def __init__(
        self,
        model: nn.Module,
        reader: ReadingReader,
        sources: dict[str, Source],
        device: torch.device,
        prefetch: bool,
    ):
        self.model, self.reader, self.sources, self.device, self.prefetch = model, reader, sources, device, prefetch
        self.layers = require_decoder_layers(model)
        self.prefix = decoder_layer_prefix(model, self.layers)
        self.bytes_read = 0
        self.reads_whole = reads_layers_whole(device.type, world()[1])  # else its rows, then the all-gather
        self._hooks: list[Callable[[int, nn.Module], None]] = []
        self._next: tuple[int, threading.Thread, dict[str, torch.Tensor]] | None = None
        self._spare = _SpareBuffers()  # a released layer's tensors, which a later read of the same shapes reuses

    def on_release(self, hook: Callable[[int, nn.Module], None]) -> Callable[[], None]:
        """Run ``hook(index, layer)`` on every held layer just before its release; returns what unregisters it."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def source_identity(self) -> list[tuple[str, int, int]]:
        """``(file name, size, modification time in ns)`` of every checkpoint file the decoder layers are read from:
        what a resumed streamed run checks its model by, instead of reading every weight for a checksum."""
        files = sorted({self.reader.file_of(k) for source in self.sources.values() for k in source.keys()})
        return [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files]

    def _names(self, index: int, layer: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
        """``(full name, owning module, attribute, parameter)`` of the layer's parameters."""
        out = []
        for module_name, module in layer.named_modules(prefix=f"{self.prefix}.{index}"):
            for attr, p in module._parameters.items():
                if p is not None:
                    out.append((f"{module_name}.{attr}", module, attr, p))
        return out

    def _read_share(self, names: list[tuple[str, nn.Module, str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        """What this rank reads of each parameter, cast to the parameter's dtype: all of it (:func:`reads_layers_whole`)
        or its rows (its :func:`row_range`)."""
        rank, size = world()
        spans = {name: self._span(p, rank, size) for name, _, _, p in names}
        wanted = {name: ((stop - start, *p.shape[1:]) if p.dim() else (), p.dtype)
                  for name, _, _, p in names for start, stop in [spans[name]]}  # fmt: skip
        spare = self._spare.take(list(wanted.values()))  # matched before anything is read; the rest is freed
        out = {}
        with self.reader.staging():
            for name, _, _, p in names:
                into = spare[wanted[name]].pop() if spare.get(wanted[name]) else None
                rows = self.sources[name].rows(self.reader, *spans[name], p.dtype, into)
                self.bytes_read += rows.numel() * rows.element_size()
                out[name] = rows.pin_memory() if self.device.type == "cuda" else rows  # copied to the GPU async
        return out

    def _span(self, p: nn.Parameter, rank: int, size: int) -> tuple[int, int]:
        """The rows of ``p`` this rank reads: all (:func:`reads_layers_whole`; a 0-d tensor: ``(0, 0)``), or its own."""
        if self.reads_whole or not p.dim():
            return 0, p.shape[0] if p.dim() else 0
        return row_range(p.shape[0], rank, size)

    def _start_prefetch(self, index: int, layer: nn.Module) -> None:
        names = self._names(index, layer)
        box: dict[str, torch.Tensor] = {}
        thread = threading.Thread(target=lambda: box.update(self._read_share(names)), daemon=True)
        thread.start()
        self._next = (index, thread, box)

    def _share(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        """What this rank reads of layer ``index``: prefetched, or read now."""
        if self._next is not None and self._next[0] == index:
            _, thread, box = self._next
            self._next = None
            thread.join()
            if len(box) == len(self._names(index, layer)):
                return box
        return self._read_share(self._names(index, layer))

    @contextlib.contextmanager
    def held(self, index: int, layer: nn.Module) -> Iterator[nn.Module]:
        names = self._names(index, layer)
        read = self._share(index, layer)
        with torch.no_grad():
            for name, module, attr, p in names:
                if self.reads_whole or not p.dim():
                    full = read.pop(name).to(self.device)  # read whole: held as read
                else:
                    full = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    all_gather_rows_(full, read.pop(name).to(self.device, non_blocking=True))
                module._parameters[attr] = nn.Parameter(full, requires_grad=p.requires_grad)
        if self.prefetch and index + 1 < len(self.layers):
            self._start_prefetch(index + 1, self.layers[index + 1])
        try:
            yield layer
            for hook in self._hooks:
                hook(index, layer)
        finally:
            released = []
            for _, module, attr, p in self._names(index, layer):
                released.append(p.detach())
                module._parameters[attr] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
                )
            # the read of the layer after next (not reading ahead: of the next) reuses them
            if self.device.type == "cpu" and index + (2 if self.prefetch else 1) < len(self.layers):
                self._spare.give(released)

    def close(self) -> None:
        if self._next is not None:
            self._next[1].join()
            self._next = None
        self._spare.take([])
        self.reader.close()


class _SpareBuffers:
    """A released layer's CPU tensors by shape and dtype, until a read takes them: a streamed model's layers are
    alike, so a read writes into the pages of the layer before it instead of new ones, which the kernel would map
    and zero page by page. Shared by the main thread (which releases) and the prefetch thread (which reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def give(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                if t.is_contiguous():  # as a read writes it
                    self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def take(
        self, wanted: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]]:
        """The spare tensors for ``wanted`` (shape, dtype) pairs, each given at most once; every other spare tensor is
        dropped (freed), so that none outlives the read that could have used it."""
        with self._lock:
            free, self._free = self._free, {}
        out: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for key in wanted:
            if free.get(key):
                out.setdefault(key, []).append(free[key].pop())
        return out


def load_streamed(
    path: str | Path,
    *,
    shard_root: bool = True,
    dtype: torch.dtype | str | None = None,
    prefetch: bool = True,
    impl: str = "shardcal",
) -> nn.Module:
    """Load a Hugging Face-format directory for a streamed run (see the module docstring): the parts outside the
    decoder stack sharded and resident, the decoder layers read in when a step holds them. ``impl``: shardcal's own
    model class (``"shardcal"``) or transformers' (``"transformers"``: built on the meta device by transformers, each
    parameter found in the checkpoint as :func:`~.sources.resolve_sources` finds it — per-expert tensors of fused
    experts, VLM prefixes — and the decoder layers' persistent buffers, a router's correction bias, loaded resident
    with them). Collective (every rank calls it). The model's residency (``model._shardcal_residency``) is a
    :class:`StreamedLayers`; its distribution plan records the bytes this rank read."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    raw = load_config(path).raw if impl == "shardcal" else raw_config(path)
    if raw.get("quantization_config") is not None and not is_published(raw):
        raise CheckpointError(f"{path}: load_streamed reads unquantized checkpoints")
    reader = ReadingReader(path)
    try:
        model, sources, stored = _streamed_model(path, reader, impl, dtype)
        layers = require_decoder_layers(model)
        prefix = decoder_layer_prefix(model, layers)
        mesh = default_mesh(model)
        device = torch.device("cpu") if mesh.device_type == "cpu" else _current_device(mesh)
        streamed = {id(p) for p in layers.parameters()}
        with decoder_layers_replaced(model, layers, nn.ModuleList()):
            main = dominant_dtype(model)  # the rest's off-dtype parameters stay replicated, as fsdp2_wrap keeps them
        ignored = {p for p in model.parameters() if id(p) in streamed or p.dtype != main}
        kwargs: dict[str, Any] = {"mesh": mesh, "offload_policy": OffloadPolicy(), "ignored_params": ignored}
        for module in fsdp2_units(model, replicate=list(layers)):
            if module is getattr(model, "lm_head", None) and not shard_root:
                continue
            fully_shard(module, reshard_after_forward=True, **kwargs)
        if shard_root:
            fully_shard(model, reshard_after_forward=True, **kwargs)
        with decoder_layers_replaced(model, layers, nn.ModuleList()):
            buffers = real_buffers(model, reader, stored)  # the root's: the decoder stack is detached
            model.to_empty(device=device)  # the rest only: the decoder stack is detached
            with torch.no_grad():
                for name, value in buffers.items():
                    model.get_buffer(name).copy_(value)
            if callable(getattr(model, "tie_weights", None)):
                model.tie_weights()
            read = _fill_root(model, reader, sources)
        if shard_root:
            model._get_fsdp_state()._lazy_init()  # the decoder layers stay on meta: init_fsdp2_root would wait
        init_fsdp2_root(model)
        _layer_buffers(layers, prefix, reader, stored, device)
        layer_params = {n for n, _ in layers.named_parameters(prefix=prefix)}
        residency = StreamedLayers(model, reader, {n: s for n, s in sources.items() if n in layer_params}, device,
                                   prefetch)  # fmt: skip
    except BaseException:
        reader.close()
        raise
    setattr(model, RESIDENCY_ATTR, residency)
    setattr(model, DISTRIBUTION_PLAN_ATTR, {"streamed": True, "shard_root": shard_root, "world_size": mesh.size(),
                                            "rank": world()[0], "bytes_read": read})  # fmt: skip
    return model.eval()


def _streamed_model(
    path: str | Path, reader: ReadingReader, impl: str, dtype: torch.dtype | str | None
) -> tuple[nn.Module, dict[str, Source], dict[str, str]]:
    """The model on the meta device (shardcal's class, or transformers' for ``impl="transformers"``), every
    parameter's source in the checkpoint, and the persistent buffers the checkpoint holds (name -> key)."""
    if impl == "shardcal":
        cfg = load_config(path)
        target = resolve_dtype(cfg, dtype)
        model = build_on_meta(cfg, target)
        check_checkpoint_keys(model, reader, cfg)
        set_param_dtypes(model, param_dtypes(model, reader, target))
        return model, {n: Source([[n]]) for n, _ in model.named_parameters()}, {}
    model = build_transformers_on_meta(path)  # parameters on meta, computed buffers real
    sources, stored = resolve_sources(model, reader), resolve_buffers(model, reader)
    if dtype is not None:  # as load_pretrained(model=..., dtype=) casts
        target = module_dtype(dtype, reader, (k for src in sources.values() for k in src.keys()))
        set_param_dtypes(model, {n: target if p.is_floating_point() else p.dtype for n, p in model.named_parameters()})
    return model, sources, stored


def _layer_buffers(
    layers: nn.ModuleList, prefix: str, reader: ReadingReader, stored: dict[str, str], device: torch.device
) -> None:
    """The decoder layers' buffers stay resident (they are small: a router's correction bias, rotary tables): the
    persistent ones the checkpoint holds are read now, computed ones keep their values; all on ``device``. Streaming
    materialises parameters only."""
    for name, module in layers.named_modules(prefix=prefix):
        for attr, buf in list(module._buffers.items()):
            if buf is None:
                continue
            value = reader.get(stored[f"{name}.{attr}"]).to(buf.dtype) if f"{name}.{attr}" in stored else buf
            if value.device.type == "meta":
                raise CheckpointError(
                    f"{reader.source}: the decoder layer buffer {name}.{attr} is not in the checkpoint"
                )
            module._buffers[attr] = value.detach().to(device)


def _fill_root(model: nn.Module, reader: ReadingReader, sources: dict[str, Source]) -> int:
    """The parameters outside the decoder stack: this rank's rows of the sharded ones, the replicated ones whole."""
    from torch.distributed.tensor import DTensor

    from ..sharding.fsdp2 import local_rows

    read = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                continue
            if isinstance(param, DTensor):
                start, stop = local_rows(param)
                if stop > start:
                    rows = sources[name].rows(reader, start, stop)
                    param.to_local().copy_(rows)
                    read += rows.numel() * rows.element_size()
            else:
                full = sources[name].full(reader)
                param.copy_(full)
                read += full.numel() * full.element_size()
    return read


def _current_device(mesh: Any) -> torch.device:
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
