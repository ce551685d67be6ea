"""The files an export writes beside its shards: the index, the tokenizer files, the calibration report, config.json
(the model's own config with the format's quantization config) and, last, the manifest; and what a finished
export's manifest records of the model it was made from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from ..runtime.fsutil import read_json_object, umask, write_manifest
from ..sharding.fsdp2 import dominant_dtype
from .destination import MANIFEST_NAME
from .layout import ExportPlan
from .shards import header_bytes

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
REPORT_NAME = "calibration_report.json"
#: Files copied from ``tokenizer_dir`` when present.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def export_source(out_dir: str | Path) -> Path | None:
    """The model directory a shardcal export was made from, as its manifest records it, when that directory still
    holds a model (a ``config.json``); None otherwise (no export, no source recorded, moved or deleted)."""
    try:
        source = json.loads((Path(out_dir) / MANIFEST_NAME).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(source, str) or not (Path(source) / CONFIG_NAME).is_file():
        return None
    return Path(source)


def model_config_dict(
    model: nn.Module, config_dir: Path | None = None, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The model's config.json contents, by duck typing: shardcal's ``config.raw``, anything with ``to_dict()``
    (transformers' configs), else ``config_dir/config.json``, with its dtype key set to ``dtype`` (None: the model's
    own). Raises :class:`ExportError` naming what is missing."""
    config = getattr(model, "config", None)
    raw = getattr(config, "raw", None)
    if not isinstance(raw, dict) and callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    if not isinstance(raw, dict) and config_dir is not None:
        path = config_dir / CONFIG_NAME
        if not path.is_file():
            raise ExportError(f"{path}: missing (config_dir must hold the model's config.json)")
        raw = read_json_object(path, ExportError)
    if not isinstance(raw, dict):
        raise ExportError(
            f"{type(model).__name__}: no config to write config.json from: give the model a config with to_dict() "
            "(as transformers' models have) or pass config_dir=<the directory of its config.json>"
        )
    try:
        out = json.loads(json.dumps(raw))  # a deep copy that is certainly JSON-serialisable
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{type(model).__name__}: its config is not JSON-serialisable ({exc})") from None
    if not out.get("architectures"):
        out["architectures"] = [_original_class(model).__name__]
    dtype_name = str(dtype or dominant_dtype(model)).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["torch_dtype"]
    for k in keys:  # the dtype the unquantized tensors are stored in, so that a reload picks it by default
        out[k] = dtype_name
    return out


def _original_class(model: nn.Module) -> type:
    """The model's own class (fully_shard makes ``FSDP<Name>`` subclasses)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_metadata(
    config: dict[str, Any],
    plan: ExportPlan,
    staging: Path,
    report: Any,
    tokenizer_dir: Path | None,
    source: str | None = None,
) -> None:
    """Rank 0, all shards written: check them, then index, tokenizer files, report, config.json, the manifest (last)."""
    for shard in plan.shards:
        path = staging / shard.file
        expected = len(header_bytes(shard.entries)) + shard.nbytes
        if not path.is_file() or path.stat().st_size != expected:
            found = path.stat().st_size if path.is_file() else "missing"
            raise ExportError(
                f"{path}: expected {expected} bytes, found {found} (is {staging.parent} shared by all ranks?)"
            )
    try:
        weight_map = dict(sorted(plan.weight_map.items()))
        _write_json(staging / INDEX_NAME, {"metadata": {"total_size": plan.total_size}, "weight_map": weight_map})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copyfile(tokenizer_dir / name, staging / name)
        if report is not None:
            report.save_json(staging / REPORT_NAME)
            os.chmod(staging / REPORT_NAME, 0o666 & ~umask())
        _write_json(staging / CONFIG_NAME, {**config, plan.export_format.config_key: plan.quantization_config})
        write_manifest(staging, MANIFEST_NAME, writer="shardcal export", format=plan.export_format.name, source=source)
    except OSError as exc:
        raise ExportError(f"{staging}: cannot write the export's metadata ({exc.strerror or exc})") from None
