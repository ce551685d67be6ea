"""Checkpoint / resume for activation collection, on any number of ranks (also another one than the interrupted run).

A commit after layer ``k`` holds what a rerun needs to go on at layer ``k``:

* ``inputs-L<k>-B<b>.safetensors``: layer ``k``'s input hidden states of global batch ``b``, written by the rank
  that owns the batch — one file per global batch, so a run can resume on another number of ranks;
* ``stats-L<i>.safetensors``: the merged statistics (identical on every rank) of every finished layer ``i`` holding
  a target, written by rank 0 in the first commit after the layer, never rewritten;
* ``collect-manifest.json``, written last by rank 0: the run's fingerprint (model, weights, data, targets and
  settings; not the world size), the completed layer count, whether the collection finished, every file's SHA-256,
  which file holds which batch, and per finished layer the JSON part of its statistics.

The directory's rules — safetensors files written atomically with their SHA-256 in the manifest, commits on every
rank or none, files no manifest lists removed only once the new manifest is in place, another run's or another
kind's checkpoint refused naming what differs, a corrupt file never used — are :class:`LayerCheckpoint`'s
(:mod:`shardcal.layerwise.layer_checkpoint`), its errors :class:`~shardcal.errors.CollectionCheckpointError`. All ranks
must see one shared directory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CollectionCheckpointError
from ..layerwise.layer_checkpoint import LayerCheckpoint, is_count, read_tensors, sha256
from ..runtime.distributed import world
from ..runtime.faults import fault_point
from .report import TargetStats

__all__ = ["CollectionCheckpoint", "CollectionResume", "inputs_name", "remove_checkpoint", "sha256", "stats_name"]

MANIFEST = "collect-manifest.json"
FORMAT = "shardcal-collect-checkpoint"
FORMAT_VERSION = 1
#: This checkpoint's own files, and the temporaries atomic writes make of them (``.name.XXXX``).
_OWN_FILE = re.compile(r"\.?(inputs-L\d{5}-B\d{6}|stats-L\d{5})\.safetensors(\..+)?|\." + re.escape(MANIFEST) + r"\..+")
#: What the fingerprint's keys stand for, in refusals.
LABELS = {
    "model": "model (config or parameter shapes)",
    "model_weights": "model weights",
    "data": "data or batch size",
    "targets": "targets",
    "patterns": "target patterns",
    "stats": "statistics",
    "bins": "histogram bins",
    "top_k": "top_k",
    "save_dtype": "raw activations (saved or not, and their save_dtype)",
}


def inputs_name(layer: int, batch: int) -> str:
    """The file of layer ``layer``'s inputs of global batch ``batch``."""
    return f"inputs-L{layer:05d}-B{batch:06d}.safetensors"


def stats_name(layer: int) -> str:
    """The file of layer ``layer``'s merged statistics."""
    return f"stats-L{layer:05d}.safetensors"


@dataclass(kw_only=True)
class CollectionResume:
    """What a committed collection checkpoint restores for this rank."""

    completed_layers: int
    finished: bool
    activations: list[torch.Tensor]  # layer ``completed_layers``' inputs of this rank's batches, in order (unfinished)
    stats: dict[str, TargetStats]  # every finished layer's targets
    entries: list[dict[str, Any]]  # per finished layer holding a target: its manifest record
    committed_at: float = 0.0  # when the manifest was written (seconds since the epoch)


class CollectionCheckpoint(LayerCheckpoint):
    """A checkpoint directory for one collection run; ``fingerprint`` identifies the run (keys: :data:`LABELS`)."""

    MANIFEST = MANIFEST
    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION
    OWN_FILE = _OWN_FILE
    FIELDS = ("finished", "batches", "layers")
    LABELS = LABELS
    FAULT = "collect.commit"
    error = CollectionCheckpointError

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        super().__init__(directory, fingerprint)
        self.stats_files: dict[str, str] = {}  # the statistics files written: name -> digest
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # statistics files the next commit writes (rank 0)

    # ------------------------------------------------------------------ reading
    def check_fields(self, path: Path, manifest: dict[str, Any]) -> None:
        """The manifest's fields have the types and shapes this reader relies on (errors name the field)."""
        super().check_fields(path, manifest)
        done, files = manifest["completed_layers"], manifest["files"]
        if not isinstance(manifest["finished"], bool):
            raise self.corrupt(path, "finished", "is not true or false")
        batches = manifest["batches"]
        if not isinstance(batches, dict) or not all(isinstance(v, str) and v in files for v in batches.values()):
            raise self.corrupt(path, "batches", "does not map batch indices to listed files")
        layers = manifest["layers"]
        if not isinstance(layers, list) or not all(_is_layer_record(e, done, files) for e in layers):
            raise self.corrupt(
                path, "layers", "is not a list of finished layers' records (layer, listed stats file, targets)"
            )

    def load(self, batch_indices: Sequence[int]) -> CollectionResume | None:
        """The committed state for this rank, which owns global batches ``batch_indices`` now (any world size), or
        None when there is no checkpoint yet. Refuses a directory that cannot hold one. Not collective."""
        manifest = self.opened()
        if manifest is None:
            return None
        finished = manifest["finished"]
        activations = [] if finished else [self._inputs(manifest, b) for b in batch_indices]
        stats: dict[str, TargetStats] = {}
        for entry in manifest["layers"]:
            stats.update(self._layer_stats(manifest, entry))
        self.stats_files = {e["stats"]: manifest["files"][e["stats"]] for e in manifest["layers"]}
        if finished and world()[0] == 0:  # no commit follows to clear what a killed final commit left
            self.remove_files_except(self.committed)
        done = manifest["completed_layers"]
        return CollectionResume(
            completed_layers=done,
            finished=finished,
            activations=activations,
            stats=stats,
            entries=list(manifest["layers"]),
            committed_at=self.committed_at(),
        )

    def _inputs(self, manifest: dict[str, Any], batch: int) -> torch.Tensor:
        name = manifest["batches"].get(str(batch))
        if name is None:
            raise self.error(f"{self.manifest_path}: no inputs of batch {batch}; the checkpoint is incomplete")
        tensors = read_tensors(self.verified(manifest, name), self.error)
        if "hidden" not in tensors:
            raise self.error(f"{self.dir / name}: holds no 'hidden' tensor (corrupt)")
        return tensors["hidden"]

    def _layer_stats(self, manifest: dict[str, Any], entry: dict[str, Any]) -> dict[str, TargetStats]:
        tensors = read_tensors(self.verified(manifest, entry["stats"]), self.error)
        try:
            found = [TargetStats.from_saved(summary, tensors) for summary in entry["targets"]]
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise self.error(
                f"{self.manifest_path}: corrupt manifest (layer {entry['layer']}'s statistics: bad {exc})"
            ) from None
        return {s.name: s for s in found}

    # ------------------------------------------------------------------ writing
    def record_layer(self, layer: int, found: list[TargetStats]) -> dict[str, Any]:
        """A finished layer's manifest record; its merged statistics go to disk with the next commit (rank 0)."""
        name = stats_name(layer)
        if world()[0] == 0:
            self.pending[name] = {k: v for s in found for k, v in s.tensors().items()}
        return {"layer": layer, "stats": name, "targets": [s.summary() for s in found]}

    def commit(
        self,
        completed_layers: int,
        inputs: dict[int, torch.Tensor],
        entries: list[dict[str, Any]],
        finished: bool = False,
    ) -> None:
        """Write this rank's batches' inputs of layer ``completed_layers`` (global batch -> hidden states) and (rank
        0) the statistics recorded since the last commit, then (rank 0, after every rank) the manifest; then remove
        the files it does not list. ``finished``: the collection is done (no inputs). Collective."""
        stats_files = dict(self.stats_files)

        def manifest_of(parts: list[dict[str, Any]]) -> dict[str, Any]:
            files, batches = {}, {}
            for p in parts:
                stats_files.update(p["stats"])
                files.update({n: d for n, d in p["files"].items() if n not in p["stats"]})
                batches.update(p["batches"])
            return {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "completed_layers": completed_layers,
                "finished": finished,
                "files": {**files, **stats_files},
                "batches": batches,
                "layers": entries,
            }

        self.commit_parts(lambda part: self._write_part(part, completed_layers, inputs), manifest_of)
        self.stats_files = stats_files
        self.pending.clear()

    def _write_part(self, part: dict[str, Any], completed_layers: int, inputs: dict[int, torch.Tensor]) -> None:
        """This rank's inputs and (rank 0) the pending statistics, recorded in ``part`` as they are written."""
        part.update(batches={}, stats={})
        for b, hidden in inputs.items():
            name = inputs_name(completed_layers, b)
            part["files"][name] = self.save({"hidden": hidden}, name)
            part["batches"][str(b)] = name
        fault_point(self.FAULT, step="inputs written", rank=world()[0])
        for name, tensors in self.pending.items():
            part["stats"][name] = part["files"][name] = self.save(tensors, name)


def _is_layer_record(entry: Any, done: int, files: dict[str, str]) -> bool:
    """Whether ``entry`` is a finished layer's manifest record: its layer (< ``done``), listed stats file, targets."""
    return (
        isinstance(entry, dict)
        and is_count(entry.get("layer"))
        and entry["layer"] < done
        and isinstance(entry.get("stats"), str)
        and entry["stats"] in files
        and isinstance(entry.get("targets"), list)
    )


def remove_checkpoint(directory: str | Path) -> int:
    """Delete a collection checkpoint: its manifest first (so a half-removed one is never resumed), then its own
    files, then the directory when nothing else is in it. Returns the bytes freed. Not collective (one rank, after
    the run); files that are not the checkpoint's are left alone."""
    return CollectionCheckpoint.remove(directory)
