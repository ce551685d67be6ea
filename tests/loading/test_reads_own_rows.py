"""Each rank reads only its own rows, measured outside the loader.

``load_pretrained`` counts the bytes it copies (``bytes_read`` in the distribution plan), but that counter is the
loader's own: a loader that read every tensor whole and then sliced it would count only the slice. Here the
safetensors reader itself is replaced, below the API the loader uses (``safe_open``, ``get_slice``, ``get_tensor``),
by a plain-Python one that parses the file format and records every byte range it is asked for. Every byte of the
checkpoint must be requested by exactly one rank (replicated off-dtype parameters: by every rank, whole), and a
rank's total must equal what the loader reports.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _dist import run_on_ranks
from _tiny_models import make_tiny_checkpoint

_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8,
}  # fmt: skip
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F8_E4M3": 1, "U8": 1}


class _RecordingSlice:
    def __init__(self, owner: _RecordingFile, key: str):
        self.owner, self.key = owner, key
        info = owner.header[key]
        self.dtype_name, self.shape = info["dtype"], list(info["shape"])
        self.begin, self.end = info["data_offsets"]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_name

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, tuple):
            if len(index) != 1:
                raise NotImplementedError(f"the recording reader slices dim 0 only, got {index!r}")
            index = index[0]
        if not self.shape:
            raise NotImplementedError("slicing a 0-dim tensor")
        if index is Ellipsis:
            index = slice(None)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise NotImplementedError(f"the recording reader slices dim 0 only, got {index!r}")
        start, stop, _ = index.indices(self.shape[0])
        stop = max(start, stop)
        return self.owner.read(self.key, self, start, stop)

    def whole(self) -> torch.Tensor:
        if not self.shape:
            return self.owner.read(self.key, self, 0, 1).reshape(())
        return self[:]


class _RecordingFile:
    """Stands in for ``safetensors.safe_open(path, framework="pt")``: the same methods, reads recorded."""

    log: list[tuple[str, str, int, int]] = []  # (file, key, first byte, byte count), class-wide

    def __init__(self, path: str, framework: str = "pt", device: str = "cpu"):
        self.path = str(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header, self.base = header, 8 + n
        self.file = open(self.path, "rb")

    def __enter__(self) -> _RecordingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return sorted(self.header)

    def metadata(self) -> dict:
        return {}

    def get_slice(self, key: str) -> _RecordingSlice:
        return _RecordingSlice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return _RecordingSlice(self, key).whole()

    def read(self, key: str, s: _RecordingSlice, start: int, stop: int) -> torch.Tensor:
        row = math.prod(s.shape[1:]) * _SIZES[s.dtype_name]
        offset, count = s.begin + start * row, (stop - start) * row
        type(self).log.append((Path(self.path).name, key, offset, count))
        self.file.seek(self.base + offset)
        data = bytearray(self.file.read(count))
        rows = [stop - start, *s.shape[1:]] if s.shape else []
        if count == 0:
            return torch.empty(rows, dtype=_DTYPES[s.dtype_name])
        return torch.frombuffer(data, dtype=_DTYPES[s.dtype_name]).reshape(rows).clone()


def _recorded_load(path: str, family: str | None = None, dtype: str | None = None) -> dict:
    """Load ``path`` sharded (as ``dtype``, default the checkpoint's) with the recording reader in place of
    safetensors'; return what was requested."""
    import safetensors
    import safetensors.torch

    import shardcal.models.checkpoint as checkpoint_module

    def refuse(*args, **kwargs):
        raise AssertionError("the loader read a checkpoint around safe_open")

    saved = (checkpoint_module.safe_open, safetensors.safe_open, safetensors.torch.load_file, safetensors.torch.load)
    _RecordingFile.log = []
    checkpoint_module.safe_open = safetensors.safe_open = _RecordingFile
    safetensors.torch.load_file = safetensors.torch.load = refuse
    try:
        if family is None:
            from shardcal.models import load_pretrained

            model = load_pretrained(path, dtype=dtype)
        else:
            import transformers
            from _hf_models import hf_model

            from shardcal.loading.build import meta_parameters
            from shardcal.loading.sharded import load_pretrained

            cls = type(hf_model(family))
            with meta_parameters():
                model = cls._from_config(transformers.AutoConfig.from_pretrained(path))
            model = load_pretrained(path, model=model, dtype=dtype)
    finally:
        checkpoint_module.safe_open, safetensors.safe_open, safetensors.torch.load_file, safetensors.torch.load = saved
    plan = model._shardcal_distribution_plan
    return {"log": list(_RecordingFile.log), "bytes_read": plan["bytes_read"]}


def _tensor_sizes(folder: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """(file, key) -> (first byte, byte count) of every tensor in the checkpoint, from the file headers."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for key, info in header.items():
            begin, end = info["data_offsets"]
            out[(file.name, key)] = (begin, end - begin)
    return out


def _check_each_byte_read_once(folder: Path, results: list[dict], replicated: tuple[str, ...] = ()) -> None:
    tensors = _tensor_sizes(folder)
    world = len(results)
    for r in results:  # the loader's own counter agrees with what it asked the file for
        assert sum(count for *_, count in r["log"]) == r["bytes_read"]
    requested: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for rank, r in enumerate(results):
        for file, key, offset, count in r["log"]:
            if count:
                requested.setdefault((file, key), []).append((offset, offset + count, rank))
    assert set(requested) == set(tensors), set(tensors) ^ set(requested)
    for where, (begin, size) in tensors.items():
        spans = sorted(requested[where])
        if any(part in where[1] for part in replicated):  # every rank reads it whole, once
            assert sorted(rank for *_, rank in spans) == list(range(world)), (where, spans)
            assert all(s == begin and e == begin + size for s, e, _ in spans), (where, spans)
            continue
        # no byte twice (not even by the same rank), none left out
        assert spans[0][0] == begin and spans[-1][1] == begin + size, (where, spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (where, spans)
    total = sum(size for _, size in tensors.values())
    for r in results:
        mine = sum(count for *_, count in r["log"])
        assert mine <= total / world * 1.1 + sum(
            s for w, (_, s) in tensors.items() if any(p in w[1] for p in replicated)
        )


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama", {"tie_word_embeddings": True}), ("qwen3_moe", {}), ("mixtral", {})],
    ids=["llama-tied", "qwen3_moe", "mixtral"],
)
def test_each_rank_requests_only_its_own_rows(tmp_path, family, overrides):
    folder = make_tiny_checkpoint(tmp_path, family, **overrides)
    _check_each_byte_read_once(folder, run_on_ranks(2, _recorded_load, str(folder)))


def test_off_dtype_routers_are_read_whole_by_every_rank(tmp_path):
    """A bf16 MoE checkpoint keeps its routers in float32: they stay replicated, so each rank reads them whole."""
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    path = folder / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state = {k: (v.float() if ".mlp.gate." in k else v) for k, v in state.items()}
    save_file(state, str(path), metadata={"format": "pt"})
    _check_each_byte_read_once(folder, run_on_ranks(2, _recorded_load, str(folder)), replicated=(".mlp.gate.",))


def test_one_rank_reads_everything_once(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=1)
    (single,) = run_on_ranks(1, _recorded_load, str(folder))
    _check_each_byte_read_once(folder, [single])


def test_fused_experts_of_a_transformers_module_read_per_rank(tmp_path):
    """transformers' Qwen3-MoE (fused 3-D experts) from per-expert tensors: a rank reads only its experts."""
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    hf_model("qwen3_moe").save_pretrained(tmp_path)
    _check_each_byte_read_once(tmp_path, run_on_ranks(2, _recorded_load, str(tmp_path), "qwen3_moe"))
