"""Checkpoint / resume for activation collection, on any number of ranks (also another one than the interrupted run).

A commit after layer ``k`` holds what a rerun needs to go on at layer ``k``:

* ``inputs-L<k>-B<b>.safetensors``: layer ``k``'s input hidden states of global batch ``b``, written by the rank
  that owns the batch — one file per global batch, so a run can resume on another number of ranks;
* ``stats-L<i>.safetensors``: the merged statistics (identical on every rank) of every finished layer ``i`` holding
  a target, written by rank 0 in the first commit after the layer, never rewritten;
* ``collect-manifest.json``, written last by rank 0: the run's fingerprint (model, weights, data, targets and
  settings; not the world size), the completed layer count, whether the collection finished, every file's SHA-256,
  which file holds which batch, and per finished layer the JSON part of its statistics.

Files are safetensors (never pickle), each written to a temporary name, flushed and renamed
(:func:`shardcal.runtime.fsutil.atomic_path`). A write that fails on any rank (a full disk) stops every rank with that
rank's error, and the commit's new files go: the previous commit stays the checkpoint. Files no manifest lists — the
previous commit's inputs, and whatever a killed commit left (its files, its temporaries) — are removed only once
the new manifest is in place, so a crash at any moment leaves the old or the new checkpoint intact, and the next
commit clears what it left. On resume a manifest of another run is refused naming what differs, and a file whose
digest does not match is reported as corrupt, never used. All ranks must see one shared directory.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CalibrationCheckpointError
from ..runtime.distributed import all_gather_strings, barrier, broadcast_string, world
from ..runtime.faults import fault_point
from ..runtime.fsutil import (
    atomic_path,
    atomic_write_text,
    check_creatable,
    read_json_object,
    remove_manifested_dir,
    remove_matching_files,
)
from .report import TargetStats

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
    return f"inputs-L{layer:05d}-B{batch:06d}.safetensors"


def stats_name(layer: int) -> str:
    return f"stats-L{layer:05d}.safetensors"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save(tensors: dict[str, torch.Tensor], path: Path) -> str:
    """Write a safetensors file atomically and return its SHA-256; a failed write leaves nothing."""
    try:
        with atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        return sha256(path)
    except Exception as exc:  # OSError, or safetensors' own error wrapping one
        raise CalibrationCheckpointError(
            f"{path}: cannot write the checkpoint ({' '.join(str(exc).split())[:200]})"
        ) from None


def _shown(value: Any) -> str:
    """A fingerprint value in a message: a digest's first 12 digits, anything else as JSON (at most 80 chars)."""
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value[:12]
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class CollectionResume:
    """What a committed collection checkpoint restores for this rank."""

    completed_layers: int
    finished: bool
    activations: list[torch.Tensor]  # layer ``completed_layers``' inputs of this rank's batches, in order (unfinished)
    stats: dict[str, TargetStats]  # every finished layer's targets
    entries: list[dict[str, Any]]  # per finished layer holding a target: its manifest record
    committed_at: float = 0.0  # when the manifest was written (seconds since the epoch)


class CollectionCheckpoint:
    """A checkpoint directory for one collection run; ``fingerprint`` identifies the run (keys: :data:`LABELS`)."""

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.committed: dict[str, str] = {}  # the files of the manifest in place: name -> digest
        self.stats_files: dict[str, str] = {}  # the statistics files written: name -> digest
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # statistics files the next commit writes (rank 0)

    # ------------------------------------------------------------------ reading
    def check_directory(self) -> None:
        """Refuse a directory that cannot hold the checkpoint, before anything runs. Not collective."""
        if self.dir.exists() and not self.dir.is_dir():
            raise CalibrationCheckpointError(f"{self.dir}: exists and is not a directory")
        check_creatable(self.dir, CalibrationCheckpointError, f"cannot create the checkpoint directory {self.dir}")

    def _manifest(self) -> dict[str, Any] | None:
        path = self.dir / MANIFEST
        if not path.exists():
            return None
        manifest = read_json_object(path, CalibrationCheckpointError)
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise CalibrationCheckpointError(
                f"{path}: not a shardcal collection checkpoint (format {FORMAT!r} version {FORMAT_VERSION})"
            )
        _check_manifest(path, manifest)
        return manifest

    def _check_fingerprint(self, manifest: dict[str, Any]) -> None:
        stored = manifest["fingerprint"]
        for key, value in self.fingerprint.items():
            if stored.get(key) != value:
                raise CalibrationCheckpointError(
                    f"{self.dir / MANIFEST}: checkpoint of another run (different {LABELS.get(key, key)}: "
                    f"checkpoint {_shown(stored.get(key))}, this run {_shown(value)}); use another checkpoint "
                    "directory or delete this one"
                )

    def _verified(self, manifest: dict[str, Any], name: str) -> Path:
        path = self.dir / name
        if not path.is_file():
            raise CalibrationCheckpointError(
                f"{path}: listed by the manifest but missing; the checkpoint is incomplete"
            )
        if sha256(path) != manifest["files"][name]:
            raise CalibrationCheckpointError(
                f"{path}: contents do not match the manifest's SHA-256 (corrupt or overwritten)"
            )
        return path

    def _read(self, path: Path) -> dict[str, torch.Tensor]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:
            raise CalibrationCheckpointError(f"{path}: unreadable ({' '.join(str(exc).split())[:200]})") from None

    def load(self, batch_indices: Sequence[int]) -> CollectionResume | None:
        """The committed state for this rank, which owns global batches ``batch_indices`` now (any world size), or
        None when there is no checkpoint yet. Refuses a directory that cannot hold one. Not collective."""
        self.check_directory()
        manifest = self._manifest()
        if manifest is None:
            return None
        self._check_fingerprint(manifest)
        finished = manifest["finished"]
        activations = []
        if not finished:
            for b in batch_indices:
                name = manifest["batches"].get(str(b))
                if name is None:
                    raise CalibrationCheckpointError(
                        f"{self.dir / MANIFEST}: no inputs of batch {b}; the checkpoint is incomplete"
                    )
                tensors = self._read(self._verified(manifest, name))
                if "hidden" not in tensors:
                    raise CalibrationCheckpointError(f"{self.dir / name}: holds no 'hidden' tensor (corrupt)")
                activations.append(tensors["hidden"])
        stats: dict[str, TargetStats] = {}
        for entry in manifest["layers"]:
            tensors = self._read(self._verified(manifest, entry["stats"]))
            try:
                for summary in entry["targets"]:
                    found = TargetStats.from_saved(summary, tensors)
                    stats[found.name] = found
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise CalibrationCheckpointError(
                    f"{self.dir / MANIFEST}: corrupt manifest (layer {entry['layer']}'s statistics: bad {exc})"
                ) from None
        self.committed = dict(manifest["files"])
        self.stats_files = {e["stats"]: manifest["files"][e["stats"]] for e in manifest["layers"]}
        if finished and world()[0] == 0:  # no commit follows to clear what a killed final commit left
            self._remove_files_except(self.committed)
        done, committed_at = manifest["completed_layers"], (self.dir / MANIFEST).stat().st_mtime
        return CollectionResume(done, finished, activations, stats, list(manifest["layers"]), committed_at)

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
        rank = world()[0]
        part: dict[str, Any] = {"files": {}, "batches": {}, "stats": {}, "error": ""}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for b, hidden in inputs.items():
                name = inputs_name(completed_layers, b)
                part["files"][name] = _save({"hidden": hidden}, self.dir / name)
                part["batches"][str(b)] = name
            fault_point("collect.commit", step="inputs written", rank=rank)
            for name, tensors in self.pending.items():
                part["stats"][name] = _save(tensors, self.dir / name)
        except (CalibrationCheckpointError, OSError) as exc:
            part["error"] = str(exc) if isinstance(exc, CalibrationCheckpointError) else f"{self.dir}: {exc}"
        parts = [json.loads(p) for p in all_gather_strings(json.dumps(part))]
        errors = [p["error"] for p in parts if p["error"]]
        if errors:  # every rank stops; the previous commit stays the checkpoint
            for name in (*part["files"], *part["stats"]):
                if name not in self.committed:
                    (self.dir / name).unlink(missing_ok=True)
            raise CalibrationCheckpointError(errors[0])
        stats_files = dict(self.stats_files)
        files, batches = {}, {}
        for p in parts:
            stats_files.update(p["stats"])
            files.update(p["files"])
            batches.update(p["batches"])
        files.update(stats_files)
        failure = ""
        if rank == 0:
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "completed_layers": completed_layers,
                "finished": finished,
                "files": files,
                "batches": batches,
                "layers": entries,
            }
            try:
                atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=1))
            except OSError as exc:
                failure = f"{self.dir / MANIFEST}: cannot write the checkpoint ({exc.strerror or exc})"
        fault_point("collect.commit", step="manifest written", rank=rank)
        failure = broadcast_string(failure)
        if failure:
            raise CalibrationCheckpointError(failure)
        self.committed, self.stats_files = files, stats_files
        self.pending.clear()
        if rank == 0:  # the new manifest is in place: the old files (and a killed commit's) can go
            self._remove_files_except(files)
        barrier()

    def _remove_files_except(self, keep: dict[str, str]) -> None:
        """Remove this checkpoint's own files (and temporaries a killed run left) that ``keep`` does not list."""
        remove_matching_files(self.dir, _OWN_FILE, keep)


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """The manifest's fields have the types and shapes this reader relies on (errors name the field)."""

    def bad(field: str, what: str) -> CalibrationCheckpointError:
        return CalibrationCheckpointError(f"{path}: corrupt manifest (field {field!r} {what})")

    for key in ("fingerprint", "completed_layers", "finished", "files", "batches", "layers"):
        if key not in manifest:
            raise bad(key, "missing")
    if not isinstance(manifest["fingerprint"], dict):
        raise bad("fingerprint", "is not an object")
    done = manifest["completed_layers"]
    if not isinstance(done, int) or isinstance(done, bool) or done < 0:
        raise bad("completed_layers", f"is {done!r}, not a count")
    if not isinstance(manifest["finished"], bool):
        raise bad("finished", "is not true or false")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and _OWN_FILE.fullmatch(k) and not k.startswith(".") and isinstance(v, str)
        for k, v in files.items()
    ):
        raise bad("files", "is not an object of this checkpoint's file names and digests")
    batches = manifest["batches"]
    if not isinstance(batches, dict) or not all(isinstance(v, str) and v in files for v in batches.values()):
        raise bad("batches", "does not map batch indices to listed files")
    layers = manifest["layers"]
    if not isinstance(layers, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("layer"), int)
        and not isinstance(e.get("layer"), bool)
        and 0 <= e["layer"] < done
        and isinstance(e.get("stats"), str)
        and e["stats"] in files
        and isinstance(e.get("targets"), list)
        for e in layers
    ):
        raise bad("layers", "is not a list of finished layers' records (layer, listed stats file, targets)")


def remove_checkpoint(directory: str | Path) -> int:
    """Delete a collection checkpoint: its manifest first (so a half-removed one is never resumed), then its own
    files, then the directory when nothing else is in it. Returns the bytes freed. Not collective (one rank, after
    the run); files that are not the checkpoint's are left alone."""
    return remove_manifested_dir(directory, MANIFEST, _OWN_FILE)
