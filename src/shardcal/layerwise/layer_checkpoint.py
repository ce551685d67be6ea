"""The layer-wise checkpoint directory both runners resume from: manifest, fingerprint, verified files, commit, removal.

:class:`LayerCheckpoint` is what a calibration checkpoint
(:class:`shardcal.calib.calibration_checkpoint.CalibrationCheckpoint`) and a collection checkpoint
(:class:`shardcal.collect.collection_checkpoint.CollectionCheckpoint`) share; each subclass says what its manifest is
called, which files are its own, what its fingerprint's keys stand for and which error it raises, and writes its own
part of a commit. The rules are the same for both:

* every file is safetensors (never pickle), written to a temporary name, flushed and renamed, its SHA-256 in the
  manifest; the manifest, written last by rank 0, is JSON, read bounded and checked field by field;
* a commit happens on every rank or on none: when a rank cannot write its part, every rank raises that rank's error
  and the commit's new files go, so the previous commit stays the checkpoint; files no manifest lists (the previous
  commit's, a killed commit's, temporaries) are removed only once the new manifest is in place;
* on resume a manifest of another run is refused naming what differs, a directory holding the other kind's
  checkpoint is refused naming it, and a file whose digest does not match is reported as corrupt, never used.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any, ClassVar

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
    read_bounded_text,
    remove_manifested_dir,
    remove_matching_files,
)

#: Manifest file name -> the kind of checkpoint it marks; every kind refuses a directory holding another kind's.
MANIFEST_KINDS: dict[str, str] = {"manifest.json": "calibration", "collect-manifest.json": "collection"}

_DIGEST = re.compile(r"[0-9a-f]{64}")


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    return " ".join(str(exc).split())[:limit]


def shown(value: Any) -> str:
    """A fingerprint value in a message: a digest's first 12 digits, a string as it is, anything else as JSON
    (at most 80 characters)."""
    if isinstance(value, str):
        return value[:12] if _DIGEST.fullmatch(value) else value[:80]
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def read_tensors(path: Path, error: type[CalibrationCheckpointError]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; ``error`` naming the file when it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise error(f"{path}: unreadable ({one_line(exc)})") from None


def read_tensor(
    path: Path, key: str, error: type[CalibrationCheckpointError], rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """Tensor ``key`` of a safetensors file (only ``rows`` of it when given); ``error`` naming the file and key."""
    try:
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise error(f"{path}: tensor {key!r} listed by the manifest is not in the file")
            return f.get_slice(key)[rows[0] : rows[1]] if rows is not None else f.get_tensor(key)
    except CalibrationCheckpointError:
        raise
    except Exception as exc:
        raise error(f"{path}: unreadable ({one_line(exc)})") from None


def is_count(value: Any, low: int = 0) -> bool:
    """Whether a manifest value is an integer (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


class LayerCheckpoint:
    """A checkpoint directory of one layer-by-layer run; ``fingerprint`` identifies the run (see the module docstring).

    Subclasses set the class attributes below and write their part of a commit (:meth:`commit_parts`).
    """

    #: The manifest's file name (a key of :data:`MANIFEST_KINDS`).
    MANIFEST: ClassVar[str]
    #: The manifest's ``format`` field (None: the manifest has none) and ``format_version``.
    FORMAT: ClassVar[str | None] = None
    FORMAT_VERSION: ClassVar[int]
    #: The names of this checkpoint's own files and of the temporaries atomic writes make of them (``.name.XXXX``).
    OWN_FILE: ClassVar[re.Pattern[str]]
    #: Fields every manifest of this kind has (besides ``fingerprint``, ``completed_layers`` and ``files``).
    FIELDS: ClassVar[tuple[str, ...]] = ()
    #: What the fingerprint's keys stand for, in refusals (a key not listed is named itself).
    LABELS: ClassVar[dict[str, str]] = {}
    #: A refusal of another run's checkpoint, after the manifest's path: ``{label}``, ``{stored}``, ``{value}``.
    MISMATCH: ClassVar[str] = (
        "checkpoint of another run (different {label}: checkpoint {stored}, this run {value}); use another "
        "checkpoint directory or delete this one"
    )
    #: The fault point a commit passes (``step=``: parts written, manifest written, old file removed).
    FAULT: ClassVar[str]
    #: The error this kind raises.
    error: ClassVar[type[CalibrationCheckpointError]] = CalibrationCheckpointError

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.committed: dict[str, str] = {}  # the files of the manifest in place: name -> digest
        self._verified_names: set[str] = set()

    @property
    def kind(self) -> str:
        """``"calibration"`` or ``"collection"``."""
        return MANIFEST_KINDS[self.MANIFEST]

    @property
    def manifest_path(self) -> Path:
        return self.dir / self.MANIFEST

    # ------------------------------------------------------------------ reading
    def check_directory(self) -> None:
        """Refuse a directory that cannot hold the checkpoint, before anything runs. Not collective."""
        if self.dir.exists() and not self.dir.is_dir():
            raise self.error(f"{self.dir}: exists and is not a directory")
        check_creatable(self.dir, self.error, f"cannot create the checkpoint directory {self.dir}")

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest in place, checked (format and fields), or None when there is none yet; refuses a directory
        that holds another kind's checkpoint. Not collective."""
        self._verified_names = set()
        path = self.manifest_path
        if not path.exists():
            self._refuse_other_kind()
            return None
        try:
            manifest = json.loads(read_bounded_text(path, self.error))
        except json.JSONDecodeError as exc:
            raise self.error(f"{path}: corrupt manifest ({exc}); delete the directory to start over") from None
        wanted = (
            f"format {self.FORMAT!r}, " if self.FORMAT is not None else ""
        ) + f"format_version {self.FORMAT_VERSION}"
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != self.FORMAT
            or manifest.get("format_version") != self.FORMAT_VERSION
        ):
            raise self.error(f"{path}: not a shardcal {self.kind} manifest ({wanted})")
        self.check_fields(path, manifest)
        return manifest

    def _refuse_other_kind(self) -> None:
        for name, kind in MANIFEST_KINDS.items():
            if name != self.MANIFEST and (self.dir / name).is_file():
                raise self.error(
                    f"{self.dir}: holds a {kind} checkpoint ({name}), not a {self.kind} one; use another checkpoint "
                    "directory or delete this one"
                )

    def corrupt(self, path: Path, field: str, what: str) -> CalibrationCheckpointError:
        """The error for a manifest field that is not what this reader relies on."""
        return self.error(f"{path}: corrupt manifest (field {field!r} {what})")

    def check_fields(self, path: Path, manifest: dict[str, Any]) -> None:
        """The fields both kinds have; a subclass checks its own after calling this (errors name the field)."""
        for key in ("fingerprint", "completed_layers", *self.FIELDS, "files"):
            if key not in manifest:
                raise self.corrupt(path, key, "missing")
        if not isinstance(manifest["fingerprint"], dict):
            raise self.corrupt(path, "fingerprint", "is not an object")
        done = manifest["completed_layers"]
        if not is_count(done):
            raise self.corrupt(path, "completed_layers", f"is {done!r}, not a count")
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and self.OWN_FILE.fullmatch(k) and not k.startswith(".") and isinstance(v, str)
            for k, v in files.items()
        ):
            raise self.corrupt(path, "files", "is not an object of this checkpoint's file names and digests")

    def check_fingerprint(self, manifest: dict[str, Any]) -> None:
        """Refuse a manifest of another run, naming the first fingerprint key that differs."""
        stored = manifest["fingerprint"]
        for key, value in self.fingerprint.items():
            if stored.get(key) != value:
                label = self.LABELS.get(key, key.replace("_", " "))
                message = self.MISMATCH.format(label=label, stored=shown(stored.get(key)), value=shown(value))
                raise self.error(f"{self.manifest_path}: {message}")

    def verified(self, manifest: dict[str, Any], name: str) -> Path:
        """The path of a file the manifest lists, once its SHA-256 matches (checked once per manifest read)."""
        path = self.dir / name
        if name in self._verified_names:
            return path
        expected = manifest["files"].get(name)
        if expected is None or not path.is_file():
            raise self.error(f"{path}: listed by the manifest but missing; the checkpoint is incomplete")
        if sha256(path) != expected:
            raise self.error(f"{path}: contents do not match the manifest's SHA-256 (corrupt or overwritten)")
        self._verified_names.add(name)
        return path

    def opened(self) -> dict[str, Any] | None:
        """The manifest of this run's checkpoint (checked, fingerprint matched) and the committed files recorded,
        or None when there is none yet. Refuses a directory that cannot hold one. Not collective."""
        self.check_directory()
        manifest = self.read_manifest()
        if manifest is None:
            return None
        self.check_fingerprint(manifest)
        self.committed = dict(manifest["files"])
        return manifest

    def committed_at(self) -> float:
        """When the manifest in place was written (seconds since the epoch)."""
        return self.manifest_path.stat().st_mtime

    # ------------------------------------------------------------------ writing
    def save(self, tensors: dict[str, torch.Tensor], name: str, metadata: dict[str, str] | None = None) -> str:
        """Write ``tensors`` to the checkpoint's file ``name`` atomically; return its SHA-256. A failed write (a full
        disk, a file-size limit) leaves nothing and raises this kind's error."""
        path = self.dir / name
        try:
            with atomic_path(path) as tmp:
                save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        except CalibrationCheckpointError:
            raise
        except Exception as exc:  # OSError, or safetensors' own error wrapping one
            raise self.error(f"{path}: cannot write the checkpoint ({one_line(exc)})") from None
        return sha256(path)

    def commit_parts(
        self,
        write_part: Callable[[dict[str, Any]], None],
        manifest_of: Callable[[list[dict[str, Any]]], dict[str, Any]],
    ) -> dict[str, Any]:
        """One commit on every rank: ``write_part(part)`` writes this rank's files, recording them in
        ``part["files"]`` (name -> digest) and whatever else the kind needs; after every rank's part is gathered,
        rank 0 writes the manifest ``manifest_of(parts)`` returns (its ``files`` are what stays) and removes the
        files it does not list. A rank's failed write stops every rank with that rank's error, its new files gone.
        Returns the manifest. Collective."""
        rank = world()[0]
        part: dict[str, Any] = {"files": {}, "error": ""}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_part(part)
        except (CalibrationCheckpointError, OSError) as exc:
            part["error"] = str(exc) if isinstance(exc, CalibrationCheckpointError) else f"{self.dir}: {exc}"
        fault_point(self.FAULT, step="parts written", rank=rank)
        parts = [json.loads(p) for p in all_gather_strings(json.dumps(part))]
        errors = [p["error"] for p in parts if p["error"]]
        if errors:  # every rank stops; the previous commit stays the checkpoint
            self._remove_new(part["files"])
            raise self.error(errors[0])
        manifest = manifest_of(parts)
        failure = self._write_manifest(manifest) if rank == 0 else ""
        fault_point(self.FAULT, step="manifest written", rank=rank)
        failure = broadcast_string(failure)
        if failure:
            raise self.error(failure)
        self.committed = dict(manifest["files"])
        if rank == 0:  # the new manifest is in place: the old files (and a killed commit's) can go
            self.remove_files_except(self.committed)
        barrier()
        return manifest

    def _remove_new(self, written: dict[str, str]) -> None:
        """Remove the files this rank wrote in a failed commit that the manifest in place does not list."""
        for name in written:
            if name not in self.committed:
                (self.dir / name).unlink(missing_ok=True)

    def _write_manifest(self, manifest: dict[str, Any]) -> str:
        """Write the manifest (rank 0); the error message when it cannot be written, else ""."""
        try:
            atomic_write_text(self.manifest_path, json.dumps(manifest, indent=1))
        except OSError as exc:
            return f"{self.manifest_path}: cannot write the checkpoint ({exc.strerror or exc})"
        return ""

    def remove_files_except(self, keep: Container[str]) -> int:
        """Remove this checkpoint's own files (and temporaries a killed run left) that ``keep`` does not list."""
        rank = world()[0]
        return remove_matching_files(
            self.dir, self.OWN_FILE, keep, lambda: fault_point(self.FAULT, step="old file removed", rank=rank)
        )

    @classmethod
    def remove(cls, directory: str | Path) -> int:
        """Delete a checkpoint of this kind: its manifest first (so a half-removed one is never resumed), then its own
        files, then the directory when nothing else is in it. Returns the bytes freed. Not collective (one rank,
        after the run); files that are not the checkpoint's are left alone."""
        return remove_manifested_dir(directory, cls.MANIFEST, cls.OWN_FILE)
