"""Checkpoint / resume for layer-by-layer calibration under FSDP2 — with any number of ranks, also another one.

After a committed step every rank has written its own part — the activations it holds (the next layer's inputs,
one tensor per *global* batch it owns) and, when weights changed during calibration (algorithms, fused experts),
its own rows of them, each keyed by the first global row it holds — and rank 0 has written the merged quantizer
state and then, last, ``manifest.json``, which says which file holds which batch and which rows of which weight.
Nothing in the checkpoint depends on the world size: a run resumed on another number of ranks reads the batches
it owns now and the rows of its new shards from whichever files hold them, and computes bit-identically to an
uninterrupted run (whose result does not depend on the world size either).

Files are safetensors (never pickle), each written to a temporary name, flushed and renamed, with its SHA-256 in
the manifest. Files of the previous commit are deleted only after the new manifest is in place, so a crash at any
moment leaves either the old or the new checkpoint intact. On resume, a manifest from another model, recipe, data
or run options is refused, and a file whose digest does not match is reported as corrupt — never silently used.
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
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import CalibrationCheckpointError
from ..layerwise.batches import Batch, data_fingerprint
from ..quant.experts import expert_projections, iter_projections
from ..quant.quantizer import QuantMode
from ..quant.session import iter_quantizers
from ..runtime.distributed import all_gather_strings, all_reduce_, barrier, broadcast_string, dp_group, world
from ..runtime.faults import fault_point
from ..runtime.fsutil import (
    atomic_path,
    atomic_write_text,
    check_creatable,
    remove_manifested_dir,
    remove_matching_files,
)
from ..sharding.fsdp2 import local_rows
from .recipes import Recipe, quantize_modules
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


@dataclass
class ResumeState:
    """What a committed checkpoint restores for this rank."""

    completed_layers: int
    activations: list[torch.Tensor]  # the hidden states of the global batches this rank owns, in order
    quantizer_state: dict[str, torch.Tensor]  # merged, identical on every rank
    report: list[dict[str, Any]]
    weights: dict[str, list[tuple[str, int, int]]]  # parameter -> pieces (file, first row, last row + 1)
    committed_at: float = 0.0  # when the manifest was written (seconds since the epoch)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically; a failed write (a full disk, a file size limit) leaves nothing."""
    try:
        with atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    except CalibrationCheckpointError:
        raise
    except Exception as exc:  # OSError, or safetensors' own error wrapping one
        raise CalibrationCheckpointError(
            f"{path}: cannot write the checkpoint ({' '.join(str(exc).split())[:200]})"
        ) from None


class CalibrationCheckpoint:
    """A checkpoint directory for one calibration run (``fingerprint`` identifies model, recipe, data, options)."""

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any], rank: int, world_size: int):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.rank, self.world_size = rank, world_size

    # ------------------------------------------------------------------ reading
    def _manifest(self) -> dict[str, Any] | None:
        path = self.dir / MANIFEST
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, OSError) as exc:
            raise CalibrationCheckpointError(
                f"{path}: corrupt manifest ({exc}); delete the directory to start over"
            ) from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            raise CalibrationCheckpointError(
                f"{path}: not a shardcal calibration manifest (format_version {FORMAT_VERSION})"
            )
        _check_manifest(path, manifest)
        return manifest

    def _check_fingerprint(self, manifest: dict[str, Any]) -> None:
        stored = manifest["fingerprint"]
        for key, value in self.fingerprint.items():
            if stored.get(key) != value:
                raise CalibrationCheckpointError(
                    f"{self.dir / MANIFEST}: checkpoint is from a different {key.replace('_', ' ')} "
                    f"(checkpoint: {str(stored.get(key))[:80]}, this run: {str(value)[:80]}); use another "
                    "--checkpoint-dir or delete this one"
                )

    def _verified(self, manifest: dict[str, Any], name: str, seen: set[str]) -> Path:
        path = self.dir / name
        if name in seen:
            return path
        expected = manifest["files"].get(name)
        if expected is None or not path.is_file():
            raise CalibrationCheckpointError(
                f"{path}: listed by the manifest but missing; the checkpoint is incomplete"
            )
        if _sha256(path) != expected:
            raise CalibrationCheckpointError(
                f"{path}: contents do not match the manifest's SHA-256 (corrupt or overwritten)"
            )
        seen.add(name)
        return path

    def _check_directory(self) -> None:
        """Refuse a directory that cannot hold the checkpoint now, not after the first layer is calibrated."""
        if self.dir.exists() and not self.dir.is_dir():
            raise CalibrationCheckpointError(f"{self.dir}: exists and is not a directory")
        check_creatable(self.dir, CalibrationCheckpointError, f"cannot create the checkpoint directory {self.dir}")

    def load(self, batch_indices: Sequence[int]) -> ResumeState | None:
        """The committed state for this rank, which owns global batches ``batch_indices`` now (any world size), or
        None when the directory holds no checkpoint yet. Not collective."""
        self._check_directory()
        manifest = self._manifest()
        if manifest is None:
            return None
        self._check_fingerprint(manifest)
        seen: set[str] = set()
        done = int(manifest["completed_layers"])
        activations = []
        if done < manifest["num_layers"]:
            for b in batch_indices:
                name = manifest["batches"].get(str(b))
                if name is None:
                    raise CalibrationCheckpointError(
                        f"{self.dir / MANIFEST}: no activations of batch {b}; the checkpoint is incomplete"
                    )
                activations.append(_read_tensor(self._verified(manifest, name, seen), f"batch{b}"))
        quant = _read_all(self._verified(manifest, manifest["quantizers"], seen))
        weights = {}
        for pname, pieces in manifest["weights"].items():
            weights[pname] = [(str(self._verified(manifest, f, seen)), a, b) for f, a, b in pieces]
        committed_at = (self.dir / MANIFEST).stat().st_mtime
        return ResumeState(done, activations, quant, list(manifest["report"]), weights, committed_at)

    # ------------------------------------------------------------------ writing
    def commit(
        self,
        completed_layers: int,
        num_layers: int,
        activations: dict[int, torch.Tensor],
        quantizer_state: dict[str, torch.Tensor],
        report: list[dict[str, Any]],
        weights: dict[str, tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        """Write this rank's part, then (rank 0, after everyone) the manifest. Collective.

        ``activations``: this rank's global batch index -> hidden states; ``weights``: parameter name -> (first
        global row, this rank's rows), or None when weights did not change.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        previous = self._manifest_or_none()  # read before the gather below: rank 0 replaces it after
        part: dict[str, Any] = {"files": {}, "batches": {}, "weights": {}, "error": ""}
        try:
            self._write_part(part, completed_layers, activations, quantizer_state, weights)
        except CalibrationCheckpointError as exc:
            part["error"] = str(exc)
        fault_point("checkpoint.commit", step="parts written", rank=self.rank)
        parts = [json.loads(p) for p in all_gather_strings(json.dumps(part))]
        errors = [p["error"] for p in parts if p["error"]]
        if errors:  # every rank stops; the previous commit stays the checkpoint
            kept = previous.get("files", {}) if previous is not None else {}
            for name in part["files"]:
                if name not in kept:
                    (self.dir / name).unlink(missing_ok=True)
            raise CalibrationCheckpointError(errors[0])
        merged = _merge_parts(parts)
        if self.rank == 0:
            manifest = {
                "format_version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "completed_layers": completed_layers,
                "num_layers": num_layers,
                "report": report,
                **merged,
            }
            try:
                atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=1))
            except OSError as exc:
                part["error"] = f"{self.dir / MANIFEST}: cannot write the checkpoint ({exc.strerror or exc})"
        fault_point("checkpoint.commit", step="manifest written", rank=self.rank)
        failure = broadcast_string(part["error"] if self.rank == 0 else "")
        if failure:
            raise CalibrationCheckpointError(failure)
        if self.rank == 0:  # the new manifest is in place: the old files can go
            self._remove_files_except(merged["files"])
        barrier()

    def _remove_files_except(self, keep: dict[str, str]) -> None:
        """Remove this checkpoint's own files (and temporaries a killed run left) that ``keep`` does not list."""
        remove_matching_files(
            self.dir, _OWN_FILE, keep, lambda: fault_point("checkpoint.commit", step="old file removed", rank=self.rank)
        )

    def _write_part(
        self,
        part: dict[str, Any],
        completed_layers: int,
        activations: dict[int, torch.Tensor],
        quantizer_state: dict[str, torch.Tensor],
        weights: dict[str, tuple[int, torch.Tensor]] | None,
    ) -> None:
        """This rank's files, recorded in ``part`` as they are written."""
        meta = {"completed_layers": str(completed_layers), "rank": str(self.rank)}
        if activations:
            name = f"activations-L{completed_layers:05d}-rank{self.rank:05d}.safetensors"
            _atomic_save({f"batch{b}": a for b, a in activations.items()}, self.dir / name, meta)
            part["files"][name] = _sha256(self.dir / name)
            part["batches"] = {str(b): name for b in activations}
        fault_point("checkpoint.commit", step="activations written", rank=self.rank)
        if weights:
            name = f"weights-L{completed_layers:05d}-rank{self.rank:05d}.safetensors"
            _atomic_save({f"{p}@{start}": rows for p, (start, rows) in weights.items()}, self.dir / name, meta)
            part["files"][name] = _sha256(self.dir / name)
            part["weights"] = {p: [[name, start, start + rows.shape[0]]] for p, (start, rows) in weights.items()}
        if self.rank == 0:
            name = f"quantizers-L{completed_layers:05d}.safetensors"
            _atomic_save(quantizer_state, self.dir / name, meta)
            part["files"][name] = _sha256(self.dir / name)
            part["quantizers"] = name

    def _manifest_or_none(self) -> dict[str, Any] | None:
        try:
            return self._manifest()
        except CalibrationCheckpointError:
            return None


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


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """The manifest's fields have the types and shapes this reader relies on (errors name the field)."""

    def bad(field: str, what: str) -> CalibrationCheckpointError:
        return CalibrationCheckpointError(f"{path}: corrupt manifest (field {field!r} {what})")

    for key in ("fingerprint", "completed_layers", "num_layers", "files", "report", "batches", "weights", "quantizers"):
        if key not in manifest:
            raise CalibrationCheckpointError(f"{path}: corrupt manifest (field {key!r} missing)")
    done, files = manifest["completed_layers"], manifest["files"]
    if not isinstance(manifest["fingerprint"], dict):
        raise bad("fingerprint", "is not an object")
    if not isinstance(done, int) or isinstance(done, bool) or done < 0:
        raise bad("completed_layers", f"is {done!r}, not a count")
    total = manifest["num_layers"]
    if not isinstance(total, int) or isinstance(total, bool) or total < done:
        raise bad("num_layers", f"is {total!r}, not a count of at least completed_layers")
    if not isinstance(files, dict) or not all(isinstance(v, str) and Path(k).name == k for k, v in files.items()):
        raise bad("files", "is not an object of file names and digests")
    report = manifest["report"]
    if not isinstance(report, list) or not all(isinstance(e, dict) for e in report):
        raise bad("report", "is not a list of objects")
    for entry in report:
        unknown = sorted(set(entry) - _REPORT_FIELDS)
        missing = sorted(_REPORT_REQUIRED - set(entry))
        if unknown or missing:
            what = f"unknown key {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
            raise bad("report", f"has an entry with {what}")
    if not isinstance(manifest["batches"], dict) or not all(
        isinstance(v, str) and v in files for v in manifest["batches"].values()
    ):
        raise bad("batches", "does not map batch indices to listed files")
    if not isinstance(manifest["quantizers"], str) or manifest["quantizers"] not in files:
        raise bad("quantizers", "does not name a listed file")
    weights = manifest["weights"]
    ok = isinstance(weights, dict) and all(
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
    if not ok:
        raise bad("weights", "is not an object of (file, first row, end row) pieces")


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise CalibrationCheckpointError(f"{path}: unreadable ({' '.join(str(exc).split())})") from None


def _read_tensor(path: Path, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise CalibrationCheckpointError(f"{path}: tensor {key!r} listed by the manifest is not in the file")
            return f.get_slice(key)[rows[0] : rows[1]] if rows is not None else f.get_tensor(key)
    except CalibrationCheckpointError:
        raise
    except Exception as exc:
        raise CalibrationCheckpointError(f"{path}: unreadable ({' '.join(str(exc).split())})") from None


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
    integers (exact and order-free, wrapping), so any split of the rows over ranks gives the same number. Collective.
    """
    config = getattr(model, "config", None)
    raw = getattr(config, "raw", None)
    if not isinstance(raw, dict) and callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    raw = raw or {}
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    checksum = torch.zeros(1, dtype=torch.int64)
    for i, (_, p) in enumerate(model.named_parameters()):
        rows = _own_rows(p)
        if rows is not None:
            checksum += _bit_sum(rows[1]) * (i + 1)
    all_reduce_(checksum, "sum", dp_group())
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "model": digest({"config": {k: v for k, v in raw.items() if k != "architectures"}, "params": shapes}),
        "model_weights": str(int(checksum)),
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
                rows = _read_tensor(Path(file), f"{name}@{a}", (lo - a, hi - a))
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
    return remove_manifested_dir(directory, MANIFEST, _OWN_FILE)
