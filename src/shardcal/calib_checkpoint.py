"""Checkpoint / resume for layer-by-layer calibration under FSDP2, with any number of ranks.

After a committed step every rank has written its own part — the activations it holds (the next layer's
inputs for its batches) and, when an algorithm changed weights, its own shards of them — and rank 0 has written
the merged quantizer state and then, last, ``manifest.json``. Files are safetensors (never pickle), each
written to a temporary name and renamed, with its SHA-256 recorded in the manifest. Files of the previous
commit are deleted only after the new manifest is in place, so a crash at any moment leaves either the old or
the new checkpoint intact. On resume, a manifest from another model, recipe, data or world size is refused,
and a file whose digest does not match is reported as corrupt — never silently used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .batches import Batch, data_fingerprint
from .distributed import all_gather_strings, all_reduce_, barrier, dp_group, world
from .errors import CalibrationCheckpointError
from .fsutil import atomic_path, atomic_write_text, check_creatable
from .quant.experts import expert_projections, iter_projections
from .quant.quantizer import QuantMode
from .quant.session import iter_quantizers
from .recipes import Recipe, quantize_modules

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class ResumeState:
    """What a committed checkpoint restores."""

    completed_layers: int
    activations: list[torch.Tensor]  # this rank's hidden states, one per batch it owns
    quantizer_state: dict[str, torch.Tensor]  # merged, identical on every rank
    local_weights: dict[str, torch.Tensor]  # this rank's shards of weights that algorithms changed
    report: list[dict[str, Any]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)


class CalibrationCheckpoint:
    """A checkpoint directory for one calibration run (``fingerprint`` identifies model, recipe, data, world)."""

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
        for key in ("fingerprint", "completed_layers", "files", "report"):
            if key not in manifest:
                raise CalibrationCheckpointError(f"{path}: corrupt manifest (field {key!r} missing)")
        done, files = manifest["completed_layers"], manifest["files"]
        if not isinstance(manifest["fingerprint"], dict):
            raise CalibrationCheckpointError(f"{path}: corrupt manifest (field 'fingerprint' is not an object)")
        if not isinstance(done, int) or isinstance(done, bool) or done < 0:
            raise CalibrationCheckpointError(
                f"{path}: corrupt manifest (field 'completed_layers' is {done!r}, not a count)"
            )
        if not isinstance(files, dict) or not all(isinstance(v, str) and Path(k).name == k for k, v in files.items()):
            raise CalibrationCheckpointError(
                f"{path}: corrupt manifest (field 'files' is not an object of file names and digests)"
            )
        if not isinstance(manifest["report"], list) or not all(isinstance(e, dict) for e in manifest["report"]):
            raise CalibrationCheckpointError(f"{path}: corrupt manifest (field 'report' is not a list of objects)")
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

    def _verified(self, manifest: dict[str, Any], name: str) -> Path:
        expected = manifest["files"].get(name)
        path = self.dir / name
        if expected is None or not path.is_file():
            raise CalibrationCheckpointError(
                f"{path}: listed by the manifest but missing; the checkpoint is incomplete"
            )
        if _sha256(path) != expected:
            raise CalibrationCheckpointError(
                f"{path}: contents do not match the manifest's SHA-256 (corrupt or overwritten)"
            )
        return path

    @staticmethod
    def _read(path: Path) -> dict[str, torch.Tensor]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:
            raise CalibrationCheckpointError(f"{path}: unreadable ({' '.join(str(exc).split())})") from None

    def _check_directory(self) -> None:
        """Refuse a directory that cannot hold the checkpoint now, not after the first layer is calibrated."""
        if self.dir.exists() and not self.dir.is_dir():
            raise CalibrationCheckpointError(f"{self.dir}: exists and is not a directory")
        check_creatable(self.dir, CalibrationCheckpointError, f"cannot create the checkpoint directory {self.dir}")

    def load(self) -> ResumeState | None:
        """The committed state, or None when the directory holds no checkpoint yet. Not collective."""
        self._check_directory()
        manifest = self._manifest()
        if manifest is None:
            return None
        self._check_fingerprint(manifest)
        done = int(manifest["completed_layers"])
        acts_name = self._acts_name(done, self.rank)
        acts = self._read(self._verified(manifest, acts_name)) if acts_name in manifest["files"] else {}
        activations = [acts[f"batch{i}"] for i in range(len(acts))]
        quant = self._read(self._verified(manifest, self._quant_name(done)))
        weights_name = self._weights_name(done, self.rank)
        weights = self._read(self._verified(manifest, weights_name)) if weights_name in manifest["files"] else {}
        return ResumeState(done, activations, quant, weights, list(manifest["report"]))

    # ------------------------------------------------------------------ writing
    @staticmethod
    def _acts_name(done: int, rank: int) -> str:
        return f"activations-L{done:05d}-rank{rank:05d}.safetensors"

    @staticmethod
    def _weights_name(done: int, rank: int) -> str:
        return f"weights-L{done:05d}-rank{rank:05d}.safetensors"

    @staticmethod
    def _quant_name(done: int) -> str:
        return f"quantizers-L{done:05d}.safetensors"

    def commit(
        self,
        completed_layers: int,
        activations: list[torch.Tensor],
        quantizer_state: dict[str, torch.Tensor],
        report: list[dict[str, Any]],
        local_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write this rank's part, then (rank 0, after everyone) the manifest. Collective."""
        self.dir.mkdir(parents=True, exist_ok=True)
        previous = self._manifest_or_none()  # read before the gather below: rank 0 replaces it after
        meta = {"completed_layers": str(completed_layers), "rank": str(self.rank)}
        mine: dict[str, str] = {}
        acts_name = self._acts_name(completed_layers, self.rank)
        _atomic_save({f"batch{i}": a for i, a in enumerate(activations)}, self.dir / acts_name, meta)
        mine[acts_name] = _sha256(self.dir / acts_name)
        if local_weights:
            weights_name = self._weights_name(completed_layers, self.rank)
            _atomic_save(local_weights, self.dir / weights_name, meta)
            mine[weights_name] = _sha256(self.dir / weights_name)
        if self.rank == 0:
            quant_name = self._quant_name(completed_layers)
            _atomic_save(quantizer_state, self.dir / quant_name, meta)
            mine[quant_name] = _sha256(self.dir / quant_name)
        entries = ";".join(f"{k}={v}" for k, v in sorted(mine.items()))
        files: dict[str, str] = {}
        for gathered in all_gather_strings(entries):
            for entry in filter(None, gathered.split(";")):
                name, digest = entry.split("=")
                files[name] = digest
        if self.rank == 0:
            manifest = {
                "format_version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "completed_layers": completed_layers,
                "files": files,
                "report": report,
            }
            atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=1))
        barrier()
        if previous is not None:  # the new manifest is in place: the old commit's own files can go
            for name in previous.get("files", {}):
                if name not in files and (
                    (self.rank == 0 and name.startswith("quantizers-")) or f"rank{self.rank:05d}" in name
                ):
                    (self.dir / name).unlink(missing_ok=True)

    def _manifest_or_none(self) -> dict[str, Any] | None:
        try:
            return self._manifest()
        except CalibrationCheckpointError:
            return None


# ----------------------------------------------------------------------------------------------- model state


def quantizer_state(model: nn.Module, layer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The calibrated amax of every quantizer in the named layers (identical on every rank)."""
    modules = dict(model.named_modules())
    return {
        f"{n}.amax": q.amax.detach().cpu().clone()
        for layer_name in layer_names
        for n, q in iter_quantizers(modules[layer_name], layer_name)
        if q.amax is not None
    }


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
            key = f"{n}.amax"
            if key not in state:
                raise CalibrationCheckpointError(f"calibration checkpoint lacks quantizer state {key!r}")
            q.set_amax(state[key].to(q.amax.device))
            q.mode = QuantMode.QUANTIZE
        for experts in (m for m in modules[layer_name].modules() if expert_projections(m)):
            for _, _, projection in iter_projections(experts):  # fused weights hold their quantized values
                if projection.weight_quantizer is not None:
                    projection.weight_quantizer.mode = QuantMode.DISABLED


def run_fingerprint(
    model: nn.Module, recipe: Recipe, batches: list[Batch], world_size: int, options: dict[str, Any]
) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: model (config, shapes, a weight checksum), recipe, data, world."""
    from torch.distributed.tensor import DTensor

    config = getattr(model, "config", None)
    raw = getattr(config, "raw", None) or {}
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    checksum = torch.zeros(1, dtype=torch.float64)
    for i, (_, p) in enumerate(model.named_parameters()):
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor) or world()[0] == 0:
            checksum += local.detach().double().sum().cpu() * (i + 1)
    all_reduce_(checksum, "sum", dp_group())
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "model": digest({"config": {k: v for k, v in raw.items() if k != "architectures"}, "params": shapes}),
        "model_weights": repr(float(checksum)),
        "recipe": digest(recipe.to_dict()),
        "data": data_fingerprint(batches),
        "world_size": world_size,
        "options": digest(options),
    }


def local_weight_shards(model: nn.Module, layer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter of the named layers (its shard of a DTensor, else the whole tensor)."""
    from torch.distributed.tensor import DTensor

    modules = dict(model.named_modules())
    out = {}
    for layer_name in layer_names:
        for n, p in modules[layer_name].named_parameters(prefix=layer_name):
            out[n] = (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
    return out


def restore_weight_shards(model: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Copy checkpointed local parts back into the parameters (inverse of :func:`local_weight_shards`)."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in shards.items():
            if name not in params:
                raise CalibrationCheckpointError(
                    f"calibration checkpoint holds weights for {name!r}, which the model lacks"
                )
            p = params[name]
            target = p.to_local() if isinstance(p, DTensor) else p
            if tuple(target.shape) != tuple(value.shape):
                raise CalibrationCheckpointError(
                    f"calibration checkpoint weights {name!r} have shape {list(value.shape)}, expected {list(target.shape)}"
                )
            target.copy_(value)
