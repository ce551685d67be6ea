"""The source model's side of an evaluation, computed once and cached: its perplexity and, for KL divergences, its
next-token log-probabilities on the same tokens.

``shardcal eval`` of an export compares it with the model it was made from. That model's forward over the same data
is the same every time, so it is cached, keyed by what it depends on: the model directory's files (name, size,
modification time of every ``.safetensors`` and ``.json`` file), the token ids, the batch size, the model class, and
the torch version and CPU kernels that compute it. A cached baseline is a directory of the cache
(``$SHARDCAL_CACHE/baselines/<key>``): ``baseline.json`` (written last) and, with log-probabilities, one safetensors
file per batch in float16 (``vocab`` x 2 bytes per token: 0.5 MB for a 262k-token vocabulary), with each position's
most likely token. It is written under a
temporary name and renamed into place; a directory whose key no longer matches is never read (a new key is a new
directory), and the cache is shardcal's own to delete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import DataError
from .divergence import scored_batches

#: Bumped when what a cached baseline holds changes, so that older ones are not read.
BASELINE_FORMAT = 2
MANIFEST = "baseline.json"
#: How the source's log-probabilities are stored (half the bytes of float32; see :mod:`.divergence` for why the
#: rounding does not move a KL divergence measurably).
STORED_DTYPE = torch.float16


@dataclass(frozen=True, kw_only=True)
class SourceBaseline:
    """A cached source model's evaluation: its perplexity over ``tokens`` predictions, and (``has_logprobs``) its
    log-probabilities, read back one batch at a time (:meth:`logprobs`)."""

    directory: Path
    perplexity: float
    tokens: int
    batches: int
    has_logprobs: bool
    cached: bool  # whether it was read from the cache (not computed by this call)

    def logprobs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The source's log-probabilities of batch ``batch`` (``[rows, L - 1, vocab]``, float16) and its most likely
        token at each position (``[rows, L - 1]``, from the float32 values)."""
        from safetensors.torch import load_file

        if not self.has_logprobs:
            raise ValueError("this baseline holds no log-probabilities")
        stored = load_file(str(self.directory / _logprobs_name(batch)))
        return stored["logprobs"], stored["top1"]


def _logprobs_name(batch: int) -> str:
    return f"logprobs-{batch:05d}.safetensors"


def baseline_key(model_dir: str | Path, input_ids: torch.Tensor, *, batch_size: int, impl: str) -> str:
    """What a cached baseline of ``model_dir`` on ``input_ids`` depends on, as a SHA-256 (see the module docstring)."""
    folder = Path(model_dir).resolve()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    ids = input_ids.to(torch.int64).contiguous()
    record = {
        "format": BASELINE_FORMAT,
        "model_dir": str(folder),
        "files": [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files],
        "ids": [list(ids.shape), hashlib.sha256(ids.numpy().tobytes()).hexdigest()],
        "batch_size": batch_size,
        "impl": impl,
        "torch": torch.__version__,
        "kernels": torch.backends.cpu.get_cpu_capability(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def source_baseline(
    model_dir: str | Path,
    input_ids: torch.Tensor,
    load: Callable[[], nn.Module],
    *,
    cache_dir: str | Path,
    batch_size: int,
    impl: str,
    logprobs: bool,
) -> SourceBaseline:
    """The baseline of the model in ``model_dir`` on ``input_ids``: read from ``cache_dir`` when a baseline with the
    same key (:func:`baseline_key`) holds what is asked (``logprobs``: its log-probabilities too), else computed with
    the model ``load()`` returns and cached there."""
    key = baseline_key(model_dir, input_ids, batch_size=batch_size, impl=impl)
    target = Path(cache_dir) / "baselines" / key[:24]
    found = _read(target, key)
    if found is not None and (found.has_logprobs or not logprobs):
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        total, count, batches = 0.0, 0, 0
        model = load()
        for i, scored in enumerate(scored_batches(model, input_ids, batch_size)):
            total, count, batches = total + scored.nll, count + scored.predictions, i + 1
            if logprobs:
                from safetensors.torch import save_file

                stored = {"logprobs": scored.logprobs.to(STORED_DTYPE).contiguous(),
                          "top1": scored.logprobs.argmax(-1).to(torch.int32).contiguous()}  # fmt: skip
                save_file(stored, str(staging / _logprobs_name(i)))
        del model
        record = {"key": key, "format": BASELINE_FORMAT, "model_dir": str(Path(model_dir).resolve()),
                  "perplexity": math.exp(total / count), "tokens": count, "batches": batches,
                  "logprobs": logprobs}  # fmt: skip
        (staging / MANIFEST).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    baseline = _read(target, key)
    if baseline is None:
        raise DataError(f"{target}: the baseline just written cannot be read back")
    return SourceBaseline(**{**baseline.__dict__, "cached": False})


def _read(folder: Path, key: str) -> SourceBaseline | None:
    """The baseline in ``folder`` when its manifest is there, of this key and format, with every file it says."""
    try:
        record = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or record.get("format") != BASELINE_FORMAT:
        return None
    has = bool(record.get("logprobs"))
    batches = int(record.get("batches", 0))
    if has and not all((folder / _logprobs_name(i)).is_file() for i in range(batches)):
        return None
    return SourceBaseline(
        directory=folder,
        perplexity=float(record["perplexity"]),
        tokens=int(record["tokens"]),
        batches=batches,
        has_logprobs=has,
        cached=True,
    )
