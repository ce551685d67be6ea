"""Checkpoint / resume for layer-by-layer calibration under FSDP2 — with any number of ranks, also another one.

After a committed step every rank has written its own part — the activations it holds (the next layer's inputs,
one tensor per *global* batch it owns) and, when weights changed during calibration (algorithms, fused experts),
its own rows of them, each keyed by the first global row it holds — and rank 0 has written the merged quantizer
state and then, last, ``manifest.json``, which says which file holds which batch and which rows of which weight.
Nothing in the checkpoint depends on the world size: a run resumed on another number of ranks reads the batches
it owns now and the rows of its new shards from whichever files hold them, and computes bit-identically to an
uninterrupted run (whose result does not depend on the world size either).

The directory's rules — safetensors files written atomically with their SHA-256 in the manifest, commits on every
rank or none, the previous commit's files deleted only after the new manifest is in place, another run's or another
kind's checkpoint refused naming what differs, a corrupt file never used — are :class:`LayerCheckpoint`'s
(:mod:`shardcal.layerwise.layer_checkpoint`); this module adds what a calibration commits and restores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CalibrationCheckpointError
from ..layerwise.batches import Batch, data_fingerprint
from ..layerwise.layer_checkpoint import LayerCheckpoint, is_count, read_tensor, read_tensors
from ..layerwise.options import CalibrationOptions
from ..quant.experts import expert_projections, iter_projections
from ..quant.quantizer import QuantMode
from ..quant.session import iter_quantizers
from ..runtime.distributed import all_reduce_, dp_group, row_range, world
from ..runtime.faults import fault_point
from ..sharding.fsdp2 import local_rows
from ..sharding.residency import residency_of
from .attach import quantize_modules
from .recipe import Recipe
from .report import LayerReport

MANIFEST = "manifest.json"
#: The names of the files a commit writes, and of the temporaries it writes them through (``.name.XXXX``).
_OWN_FILE = re.compile(r"^\.?(activations|weights|quantizers)-L\d{5}[-\w]*\.safetensors(\..+)?$|^\.manifest\.json\..+$")
FORMAT_VERSION = 2
_REPORT_FIELDS = {f.name for f in dataclasses.fields(LayerReport)}
_REPORT_REQUIRED = {
    f.name
    for f in dataclasses.fields(LayerReport)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
}
#: The options a checkpoint's ``options`` digest covers (``CalibrationOptions.fingerprint()`` and the collected report).
_OPTIONS = [f.name for f in dataclasses.fields(CalibrationOptions) if f.metadata.get("fingerprint")]


@dataclass(kw_only=True)
class ResumeState:
    """What a committed checkpoint restores for this rank."""

    completed_layers: int
    activations: list[torch.Tensor]  # the hidden states of the global batches this rank owns, in order
    quantizer_state: dict[str, torch.Tensor]  # merged, identical on every rank
    report: list[dict[str, Any]]
    weights: dict[str, list[tuple[str, int, int]]]  # parameter -> pieces (file, first row, last row + 1)
    committed_at: float = 0.0  # when the manifest was written (seconds since the epoch)
    #: The full-precision stream's hidden states of the same batches (a run with a reference stream), else None.
    reference: list[torch.Tensor] | None = None


class CalibrationCheckpoint(LayerCheckpoint):
    """A checkpoint directory for one calibration run (``fingerprint`` identifies model, recipe, data, options)."""

    MANIFEST = MANIFEST
    FORMAT_VERSION = FORMAT_VERSION
    OWN_FILE = _OWN_FILE
    FIELDS = ("num_layers", "report", "batches", "weights", "quantizers")
    LABELS = {
        "layers": "way of holding the decoder layers (streamed from disk, or resident)",
        "model": "model (config or parameter shapes)",
        "model_files": "set of model files (the decoder layers' names, sizes and modification times)",
        "model_weights": "model weights",
        "recipe": "recipe",
        "data": "data or batching",
        "options": f"options ({', '.join(_OPTIONS)}, activation_report)",
    }
    MISMATCH = (
        "checkpoint is from a different {label} (checkpoint: {stored}, this run: {value}); use another "
        "--checkpoint-dir or delete this one"
    )
    FAULT = "checkpoint.commit"
    error = CalibrationCheckpointError

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any], rank: int, world_size: int):
        super().__init__(directory, fingerprint)
        self.rank, self.world_size = rank, world_size
        #: The committed weights' pieces (parameter -> [file, first row, end row]), kept by commits that add to them.
        self.weight_pieces: dict[str, list[list[Any]]] = {}

    # ------------------------------------------------------------------ reading
    def check_fields(self, path: Path, manifest: dict[str, Any]) -> None:
        """The manifest's fields have the types and shapes this reader relies on (errors name the field)."""
        super().check_fields(path, manifest)
        done, total, files = manifest["completed_layers"], manifest["num_layers"], manifest["files"]
        if not is_count(total, done):
            raise self.corrupt(path, "num_layers", f"is {total!r}, not a count of at least completed_layers")
        self._check_report(path, manifest["report"])
        if not isinstance(manifest["batches"], dict) or not all(
            isinstance(v, str) and v in files for v in manifest["batches"].values()
        ):
            raise self.corrupt(path, "batches", "does not map batch indices to listed files")
        if not isinstance(manifest["quantizers"], str) or manifest["quantizers"] not in files:
            raise self.corrupt(path, "quantizers", "does not name a listed file")
        if not _are_pieces(manifest["weights"], files):
            raise self.corrupt(path, "weights", "is not an object of (file, first row, end row) pieces")

    def _check_report(self, path: Path, report: Any) -> None:
        if not isinstance(report, list) or not all(isinstance(e, dict) for e in report):
            raise self.corrupt(path, "report", "is not a list of objects")
        for entry in report:
            unknown = sorted(set(entry) - _REPORT_FIELDS)
            missing = sorted(_REPORT_REQUIRED - set(entry))
            if unknown or missing:
                what = f"unknown key {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
                raise self.corrupt(path, "report", f"has an entry with {what}")

    def load(self, batch_indices: Sequence[int], reference: bool = False) -> ResumeState | None:
        """The committed state for this rank, which owns global batches ``batch_indices`` now (any world size), or
        None when the directory holds no checkpoint yet; with ``reference``, also the full-precision stream's hidden
        states of those batches. Not collective."""
        manifest = self.opened()
        if manifest is None:
            return None
        done = int(manifest["completed_layers"])
        activations: list[torch.Tensor] = []
        streams: list[torch.Tensor] | None = [] if reference else None
        if done < manifest["num_layers"]:
            for b in batch_indices:
                name = manifest["batches"].get(str(b))
                if name is None:
                    raise self.error(f"{self.manifest_path}: no activations of batch {b}; the checkpoint is incomplete")
                path = self.verified(manifest, name)
                activations.append(read_tensor(path, f"batch{b}", self.error))
                if streams is not None:
                    streams.append(read_tensor(path, f"reference{b}", self.error))
        quant = read_tensors(self.verified(manifest, manifest["quantizers"]), self.error)
        self.weight_pieces = {pname: [list(p) for p in pieces] for pname, pieces in manifest["weights"].items()}
        weights = {}
        for pname, pieces in manifest["weights"].items():
            weights[pname] = [(str(self.verified(manifest, f)), a, b) for f, a, b in pieces]
        return ResumeState(
            completed_layers=done,
            activations=activations,
            quantizer_state=quant,
            report=list(manifest["report"]),
            weights=weights,
            committed_at=self.committed_at(),
            reference=streams,
        )

    # ------------------------------------------------------------------ writing
    def commit(
        self,
        completed_layers: int,
        num_layers: int,
        activations: dict[int, torch.Tensor],
        quantizer_state: dict[str, torch.Tensor],
        report: list[dict[str, Any]],
        weights: dict[str, tuple[int, torch.Tensor]] | None = None,
        reference: dict[int, torch.Tensor] | None = None,
        *,
        adds_weights: bool = False,
    ) -> None:
        """Write this rank's part, then (rank 0, after everyone) the manifest. Collective.

        ``activations``: this rank's global batch index -> hidden states; ``weights``: parameter name -> (first
        global row, this rank's rows), or None when weights did not change; ``reference``: the same batches' hidden
        states in the full-precision stream (a run with a reference stream), stored beside them. ``adds_weights``:
        ``weights`` holds only the layers finished since the last commit (a streamed run, whose earlier layers are
        no longer in memory), and the committed pieces and their files stay in the checkpoint beside them; else
        ``weights`` holds every finished layer and replaces them.
        """
        carried = self.weight_pieces if adds_weights else {}

        def manifest_of(parts: list[dict[str, Any]]) -> dict[str, Any]:
            merged = _merge_parts(parts)
            kept = {f for pieces in carried.values() for f, _, _ in pieces}
            merged["files"] = {**{f: self.committed[f] for f in sorted(kept)}, **merged["files"]}
            for pname, pieces in carried.items():
                merged["weights"][pname] = sorted([*pieces, *merged["weights"].get(pname, [])], key=lambda p: p[1])
            return {
                "format_version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "completed_layers": completed_layers,
                "num_layers": num_layers,
                "report": report,
                **merged,
            }

        manifest = self.commit_parts(
            lambda part: self._write_part(part, completed_layers, activations, quantizer_state, weights, reference),
            manifest_of,
        )
        self.weight_pieces = manifest["weights"]

    def _write_part(
        self,
        part: dict[str, Any],
        completed_layers: int,
        activations: dict[int, torch.Tensor],
        quantizer_state: dict[str, torch.Tensor],
        weights: dict[str, tuple[int, torch.Tensor]] | None,
        reference: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """This rank's files, recorded in ``part`` as they are written."""
        part.update(batches={}, weights={})
        meta = {"completed_layers": str(completed_layers), "rank": str(self.rank)}
        if activations:
            name = f"activations-L{completed_layers:05d}-rank{self.rank:05d}.safetensors"
            tensors = {f"batch{b}": a for b, a in activations.items()}
            tensors.update({f"reference{b}": r for b, r in (reference or {}).items()})
            part["files"][name] = self.save(tensors, name, meta)
            part["batches"] = {str(b): name for b in activations}
        fault_point(self.FAULT, step="activations written", rank=self.rank)
        if weights:
            name = f"weights-L{completed_layers:05d}-rank{self.rank:05d}.safetensors"
            part["files"][name] = self.save({f"{p}@{start}": rows for p, (start, rows) in weights.items()}, name, meta)
            part["weights"] = {p: [[name, start, start + rows.shape[0]]] for p, (start, rows) in weights.items()}
        if self.rank == 0:
            name = f"quantizers-L{completed_layers:05d}.safetensors"
            part["files"][name] = self.save(quantizer_state, name, meta)
            part["quantizers"] = name


def _merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    files: dict[str, str] = {}
    batches: dict[str, str] = {}
    weights: dict[str, list[list[Any]]] = {}
    quantizers = None
    for part in parts:
        files.update(part["files"])
        batches.update(part["batches"])
        for pname, pieces in part["weights"].items():
            weights.setdefault(pname, []).extend(pieces)
        quantizers = part.get("quantizers", quantizers)
    for pieces in weights.values():
        pieces.sort(key=lambda piece: piece[1])
    return {"files": files, "batches": batches, "weights": weights, "quantizers": quantizers}


def _are_pieces(weights: Any, files: dict[str, str]) -> bool:
    """Whether ``weights`` maps parameter names to lists of ``[listed file, first row, end row]``."""
    return isinstance(weights, dict) and all(
        isinstance(pieces, list)
        and all(
            isinstance(p, list)
            and len(p) == 3
            and p[0] in files
            and all(isinstance(x, int) and not isinstance(x, bool) for x in p[1:])
            for p in pieces
        )
        for pieces in weights.values()
    )


# ----------------------------------------------------------------------------------------------- model state


def quantizer_state(model: nn.Module, layer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The calibrated amax (and an asymmetric quantizer's amin) of every quantizer in the named layers (identical on
    every rank)."""
    modules = dict(model.named_modules())
    state: dict[str, torch.Tensor] = {}
    for layer_name in layer_names:
        for n, q in iter_quantizers(modules[layer_name], layer_name):
            for key, t in (("amax", q.amax), ("amin", q.amin)):
                if t is not None:
                    state[f"{n}.{key}"] = t.detach().cpu().clone()
    return state


def restore_quantizers(
    model: nn.Module,
    recipe: Recipe,
    layer_names: Sequence[str],
    state: dict[str, torch.Tensor],
    fallback_layers: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Insert the recipe's quantizers (its fallback's in ``fallback_layers``) into the named layers and set their
    amax from ``state``."""
    modules = dict(model.named_modules())
    for layer_name in layer_names:
        layer_recipe = recipe.fallback if layer_name in fallback_layers and recipe.fallback is not None else recipe
        quantize_modules(modules[layer_name], layer_recipe, prefix=layer_name)
        for n, q in iter_quantizers(modules[layer_name], layer_name):
            if q.amax is None:
                continue
            keys = [f"{n}.amax"] + ([f"{n}.amin"] if q.amin is not None else [])
            for key in keys:
                if key not in state:
                    raise CalibrationCheckpointError(f"calibration checkpoint lacks quantizer state {key!r}")
            q.set_amax(*(state[key].to(q.amax.device) for key in keys))
            q.mode = QuantMode.QUANTIZE
        for experts in (m for m in modules[layer_name].modules() if expert_projections(m)):
            for _, _, projection in iter_projections(experts):  # fused weights hold their quantized values
                if projection.weight_quantizer is not None:
                    projection.weight_quantizer.mode = QuantMode.DISABLED


def run_fingerprint(model: nn.Module, recipe: Recipe, batches: list[Batch], options: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: model (config, shapes, a weight checksum), recipe, data, options.

    Nothing here depends on the world size: the weight checksum sums the raw bits of every element as 64-bit
    integers (exact and order-free, wrapping), so any split of the rows over ranks gives the same number. A streamed
    model's decoder layers are on disk: its checksum covers the rest, and its layers are known by their files'
    names, sizes and modification times (reading every weight would double the run's reads). A streamed run and a
    resident one never resume each other's checkpoints (``layers``). Collective.
    """
    config = getattr(model, "config", None)
    raw = getattr(config, "raw", None)
    if not isinstance(raw, dict) and callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    raw = raw or {}
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    checksum = torch.zeros(1, dtype=torch.int64)
    for i, (_, p) in enumerate(model.named_parameters()):
        rows = _own_rows(p) if p.device.type != "meta" else None  # a streamed model's layers: on disk (below)
        if rows is not None:
            checksum += _bit_sum(rows[1]) * (i + 1)
    all_reduce_(checksum, "sum", dp_group())
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    residency = residency_of(model)
    streamed = {"model_files": digest(residency.source_identity())} if residency.streamed else {}
    return {
        "layers": "streamed" if residency.streamed else "resident",
        "model": digest({"config": {k: v for k, v in raw.items() if k != "architectures"}, "params": shapes}),
        "model_weights": str(int(checksum)),
        **streamed,
        "recipe": digest(recipe.to_dict()),
        "data": data_fingerprint(batches),
        "options": digest(options),
    }


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum, as int64 (wrapping), of every element's raw bits: equal for equal tensors, whatever the split."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width).to(torch.int64).sum()


def _own_rows(p: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``(first global row, rows)`` this rank holds of a parameter: its shard of a DTensor; a replicated parameter
    is held by rank 0 only (None elsewhere)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        start, _ = local_rows(p)
        return start, p.to_local()
    return (0, p) if world()[0] == 0 else None


def local_weight_pieces(model: nn.Module, layer_names: Sequence[str]) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's rows of every parameter of the named layers, keyed by name: ``(first global row, rows)``."""
    modules = dict(model.named_modules())
    out = {}
    for layer_name in layer_names:
        for n, p in modules[layer_name].named_parameters(prefix=layer_name):
            rows = _own_rows(p)
            if rows is not None and rows[1].shape[0] > 0:
                out[n] = (rows[0], rows[1].detach().cpu().clone())
    return out


def held_weight_pieces(layer: nn.Module, layer_name: str) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's share (:func:`row_range`) of the rows of every parameter of a layer held whole on every rank (a
    streamed run's, at the end of its step), keyed by name: ``(first global row, rows)``; the ranks' shares together
    are the whole layer."""
    rank, size = world()
    out = {}
    for n, p in layer.named_parameters(prefix=layer_name):
        start, stop = row_range(p.shape[0], rank, size) if p.dim() else (0, 0)
        if stop > start:
            out[n] = (start, p.detach()[start:stop].cpu().clone())
    return out


def restore_weights(model: nn.Module, pieces: dict[str, list[tuple[str, int, int]]]) -> None:
    """Fill each checkpointed parameter's local rows (whatever this rank's share is now) from the pieces that hold
    them, reading only the rows needed."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, parts in pieces.items():
            if name not in params:
                raise CalibrationCheckpointError(
                    f"calibration checkpoint holds weights for {name!r}, which the model lacks"
                )
            p = params[name]
            start, stop = local_rows(p) if isinstance(p, DTensor) else (0, p.shape[0])
            target = p.to_local() if isinstance(p, DTensor) else p
            covered = 0
            for file, a, b in parts:
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    continue
                rows = read_tensor(Path(file), f"{name}@{a}", CalibrationCheckpointError, (lo - a, hi - a))
                if tuple(rows.shape[1:]) != tuple(target.shape[1:]):
                    raise CalibrationCheckpointError(
                        f"{file}: weights {name!r} have rows of shape {list(rows.shape[1:])}, expected {list(target.shape[1:])}"
                    )
                target[lo - start : hi - start].copy_(rows)
                covered += hi - lo
            if covered != stop - start:
                raise CalibrationCheckpointError(
                    f"calibration checkpoint holds {covered} of the {stop - start} rows {start}:{stop} of {name!r}"
                )


def remove_checkpoint(directory: str | Path) -> int:
    """Delete a calibration checkpoint: its manifest first (so a half-removed one is never resumed), then its own
    files, then the directory when nothing else is in it. Returns the bytes freed. Not collective (one rank, after
    the run); files that are not the checkpoint's are left alone."""
    return CalibrationCheckpoint.remove(directory)
