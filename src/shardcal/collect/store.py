"""Raw activations on disk: what ``collect_activations(..., save_dir=DIR)`` writes, and :class:`ActivationDataset`.

Layout of ``DIR``::

    activations.json                  the manifest (written last, by rank 0)
    L00003-B000001.safetensors        decoder layer 3, global batch 1: one tensor per target of that layer

Each file holds, per target of its layer (key: the target's name, ``"model.layers.3:output"``), the activations of
the batch's real tokens as ``[tokens, channels]`` in the saved dtype: the batch's samples one after the other,
each sample's tokens in order, padding left out. Batches are global (formed before they are dealt to ranks), so a
file's name and content do not depend on the world size: each rank writes the files of the batches it owns, as
its layers are stepped, one layer's worth at a time. Every file is written to a temporary name and renamed.

The manifest maps the data to files: per sample its token count (``lengths``), per batch its sample range and
global token range, per file its layer, batch, sample and token ranges, targets and size, and per target its layer
and channel count. :class:`ActivationDataset` reads it back in sample order, whatever the world size that wrote it.
A ``DIR`` must be new, empty, an unfinished collection's (files of this layout and no manifest: they are rewritten),
or hold the finished collection of the very same run; anything else is refused before anything is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CollectionError
from ..layerwise.batches import Batch
from ..runtime.distributed import barrier, world
from ..runtime.fsutil import atomic_path, atomic_write_text, check_creatable, read_json_object

MANIFEST = "activations.json"
FORMAT = "shardcal-activations"
FORMAT_VERSION = 1
#: The dtypes raw activations can be saved in, by name.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_FILE = re.compile(r"L\d{5}-B\d{6}\.safetensors")
_TEMPORARY = re.compile(r"\.(L\d{5}-B\d{6}\.safetensors|activations\.json)\..*")  # atomic writes' temporary files


def _is(name: str, pattern: str | re.Pattern) -> bool:
    return name == pattern if isinstance(pattern, str) else bool(pattern.fullmatch(name))


def file_name(layer: int, batch: int) -> str:
    """The file of decoder layer ``layer``'s activations on global batch ``batch``."""
    return f"L{layer:05d}-B{batch:06d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any, default: torch.dtype) -> torch.dtype:
    """``value`` (a torch dtype, its name, or None for ``default``) as one of :data:`DTYPES`."""
    if value is None:
        value = default
    if isinstance(value, str):
        if value not in DTYPES:
            raise CollectionError(f"save_dtype {value!r}: not one of {', '.join(DTYPES)}")
        return DTYPES[value]
    if value not in DTYPES.values():
        raise CollectionError(f"save_dtype {value!r}: not one of {', '.join(DTYPES)}")
    return value


def sample_lengths(batches: Sequence[Batch]) -> list[list[int]]:
    """Per batch, the number of real tokens of each of its samples."""
    out = []
    for b in batches:
        if b.attention_mask is None:
            out.append([int(b.input_ids.shape[1])] * int(b.input_ids.shape[0]))
        else:
            out.append([int(n) for n in b.attention_mask.bool().sum(dim=1)])
    return out


class ActivationWriter:
    """Writes one run's raw activations into ``directory`` (see the module docstring); ``run`` identifies the run."""

    def __init__(self, directory: str | Path, dtype: torch.dtype, batches: Sequence[Batch], run: str):
        self.dir = Path(directory)
        self.dtype = dtype
        self.run = run
        self.lengths = sample_lengths(batches)

    def check(self) -> None:
        """Refuse a directory that cannot take this run's files, before anything is written. Not collective."""
        if self.dir.exists() and not self.dir.is_dir():
            raise CollectionError(f"save_dir {self.dir}: exists and is not a directory")
        check_creatable(self.dir, CollectionError, f"cannot save activations to {self.dir}")
        if not self.dir.is_dir():
            return
        manifest = self.dir / MANIFEST
        if manifest.exists():
            existing = read_json_object(manifest, CollectionError)
            if existing.get("run") != self.run:
                raise CollectionError(
                    f"save_dir {self.dir}: already holds collected activations ({MANIFEST}) of another run; choose "
                    "another save_dir or delete it"
                )
        ours = (MANIFEST, _FILE, _TEMPORARY)
        others = sorted(p.name for p in self.dir.iterdir() if not any(_is(p.name, o) for o in ours))
        if others:
            raise CollectionError(
                f"save_dir {self.dir}: holds other files ({others[0]}); it must be new, empty, or a collection's"
            )

    def write(self, layer: int, batch: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write global batch ``batch``'s activations of layer ``layer``'s targets (``[tokens, channels]`` each)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        first = sum(len(x) for x in self.lengths[:batch])
        where = {"layer": layer, "batch": batch, "samples": [first, first + len(self.lengths[batch])]}
        meta = {FORMAT: json.dumps(where, sort_keys=True)}  # one key: safetensors orders several arbitrarily
        data = {k: v.detach().to(device="cpu", dtype=self.dtype).contiguous() for k, v in tensors.items()}
        with atomic_path(self.dir / file_name(layer, batch)) as tmp:
            save_file(data, str(tmp), metadata=meta)

    def finish(self, targets: dict[str, dict[str, Any]], fingerprint: dict[str, str]) -> None:
        """Write the manifest (rank 0) once every rank's files are in place, and remove files of this layout it does
        not list (an earlier unfinished run's), and temporaries a killed writer left. ``targets``: name ->
        ``{"layer", "channels", "pattern"}``. Collective."""
        barrier()
        if world()[0] == 0:
            manifest = self._manifest(targets, fingerprint)
            listed = {f["name"] for f in manifest["files"]}
            atomic_write_text(self.dir / MANIFEST, json.dumps(manifest, indent=1))
            for path in self.dir.iterdir():
                if (_FILE.fullmatch(path.name) and path.name not in listed) or _TEMPORARY.fullmatch(path.name):
                    path.unlink(missing_ok=True)
        barrier()

    def _manifest(self, targets: dict[str, dict[str, Any]], fingerprint: dict[str, str]) -> dict[str, Any]:
        self.dir.mkdir(parents=True, exist_ok=True)
        layers = sorted({t["layer"] for t in targets.values()})
        batches, files = [], []
        sample, token = 0, 0
        for b, lengths in enumerate(self.lengths):
            entry = {"samples": [sample, sample + len(lengths)], "tokens": [token, token + sum(lengths)]}
            batches.append(entry)
            for layer in layers:
                name = file_name(layer, b)
                path = self.dir / name
                if not path.is_file():
                    raise CollectionError(
                        f"save_dir {self.dir}: {name} is missing (every rank must write to one shared directory)"
                    )
                names = [n for n, t in targets.items() if t["layer"] == layer]
                files.append({"name": name, "layer": layer, "batch": b, **entry, "targets": names})
                files[-1]["bytes"] = path.stat().st_size
            sample, token = entry["samples"][1], entry["tokens"][1]
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "run": self.run,
            "fingerprint": dict(fingerprint),
            "dtype": dtype_name(self.dtype),
            "num_samples": sample,
            "num_tokens": token,
            "lengths": [n for lengths in self.lengths for n in lengths],
            "targets": targets,
            "batches": batches,
            "files": files,
        }


class ActivationDataset:
    """Raw activations saved by ``collect_activations(..., save_dir=directory)``, in the original sample order.

    ``len(ds)`` samples; ``ds[i]`` / iterating gives, per sample, ``{target: tensor [tokens, channels]}`` (its real
    tokens, in the saved dtype); ``ds.samples(targets)`` the same for chosen targets, reading each file once;
    ``ds.tokens(target)`` one target's activations of every token, ``[num_tokens, channels]``. Files are opened
    when read; a missing or unreadable one is a :class:`~shardcal.errors.CollectionError` naming it.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not (self.dir / MANIFEST).is_file():
            raise CollectionError(f"{self.dir}: no {MANIFEST}; not a finished activation collection")
        manifest = read_json_object(self.dir / MANIFEST, CollectionError)
        where = self.dir / MANIFEST
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise CollectionError(f"{where}: not a shardcal activations manifest (format version {FORMAT_VERSION})")
        try:
            self.dtype = DTYPES[manifest["dtype"]]
            self.lengths: list[int] = [int(n) for n in manifest["lengths"]]
            self.targets: list[str] = list(manifest["targets"])
            self.channels = {n: int(t["channels"]) for n, t in manifest["targets"].items()}
            self.layer = {n: int(t["layer"]) for n, t in manifest["targets"].items()}
            self.batches = [(tuple(b["samples"]), tuple(b["tokens"])) for b in manifest["batches"]]
            self.files = {(int(f["layer"]), int(f["batch"])): str(f["name"]) for f in manifest["files"]}
            self.fingerprint: dict[str, str] = dict(manifest.get("fingerprint", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CollectionError(f"{where}: corrupt manifest (missing or bad {exc})") from None
        for name in self.files.values():
            if Path(name).name != name or not (self.dir / name).is_file():
                raise CollectionError(f"{self.dir / name}: listed in {MANIFEST} but missing")
        self._batch_of = [b for b, ((s0, s1), _) in enumerate(self.batches) for _ in range(s0, s1)]

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def _check_targets(self, targets: Sequence[str] | None) -> list[str]:
        chosen = list(self.targets if targets is None else ([targets] if isinstance(targets, str) else targets))
        for name in chosen:
            if name not in self.channels:
                raise CollectionError(f"{self.dir}: {name!r} is not a saved target (have: {', '.join(self.targets)})")
        return chosen

    def _read(self, batch: int, targets: Sequence[str]) -> dict[str, torch.Tensor]:
        out = {}
        by_file: dict[str, list[str]] = {}
        for name in targets:
            by_file.setdefault(self.files[(self.layer[name], batch)], []).append(name)
        for file, names in by_file.items():
            path = self.dir / file
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        out[name] = f.get_tensor(name)
            except Exception as exc:
                raise CollectionError(f"{path}: unreadable ({' '.join(str(exc).split())[:200]})") from None
            for name in names:
                expected = (self.batches[batch][1][1] - self.batches[batch][1][0], self.channels[name])
                if tuple(out[name].shape) != expected:
                    raise CollectionError(
                        f"{path}: {name} has shape {list(out[name].shape)}, the manifest says {list(expected)}"
                    )
        return out

    def _split(self, batch: int, tensors: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        (s0, s1), _ = self.batches[batch]
        offset = 0
        for s in range(s0, s1):
            n = self.lengths[s]
            yield {name: t[offset : offset + n] for name, t in tensors.items()}
            offset += n

    def samples(self, targets: Sequence[str] | str | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Per sample, in order: ``{target: [tokens, channels]}`` for ``targets`` (default: all)."""
        chosen = self._check_targets(targets)
        for batch in range(len(self.batches)):
            yield from self._split(batch, self._read(batch, chosen))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.samples()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        index %= len(self)
        batch = self._batch_of[index]
        for s, sample in zip(range(*self.batches[batch][0]), self._split(batch, self._read(batch, self.targets))):
            if s == index:
                return {k: v.clone() for k, v in sample.items()}
        raise AssertionError("unreachable")

    def tokens(self, target: str) -> torch.Tensor:
        """Every token's activations of ``target``, ``[num_tokens, channels]``, in sample order."""
        (name,) = self._check_targets([target])
        return torch.cat([self._read(b, [name])[name] for b in range(len(self.batches))])
