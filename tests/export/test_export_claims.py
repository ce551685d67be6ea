"""Export claims the mutation check found unguarded, each checked from the files on disk.

* shards hold at most ``max_shard_bytes`` of tensor data, unless a single tensor is larger (it gets its own);
* every shard is the safetensors layout: an 8-byte little-endian header length, a JSON header space-padded to a
  multiple of 8 bytes (so that tensor data are aligned), then the tensors' bytes back to back in header order;
* a router that is not an ``nn.Linear`` (transformers' Qwen3-MoE ``TopKRouter`` holds a plain 2-D weight) is listed in
  ``ignore`` like any unquantized Linear, so that no loader (vLLM's ReplicatedLinear) looks for its scales.
"""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

W4A16_G16 = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 16\n'
IDS = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(12))


def _headers(folder) -> dict[str, tuple[int, dict, int]]:
    """file -> (header length, header, file size), read byte by byte."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        raw = file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        out[file.name] = (n, json.loads(raw[8 : 8 + n]), len(raw))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = CausalLM(ModelConfig.from_dict(TINY_CONFIGS["llama"]))
    randomize_(model)
    calibrate(model, IDS, "w8a8-int8", batch_size=2, progress=False)
    return export_checkpoint(model, tmp_path_factory.mktemp("export") / "out", max_shard_bytes=40_000)


def test_shards_stay_within_max_shard_bytes(exported):
    headers = _headers(exported)
    assert len(headers) > 3
    for file, (_, header, _) in headers.items():
        sizes = [v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (file, sum(sizes), len(sizes))
    big = [f for f, (_, h, _) in headers.items() if len(h) == 2]  # the 256 x 64 float32 embeddings: 65536 bytes
    assert big


def test_shards_have_the_safetensors_layout(exported):
    for file, (n, header, size) in _headers(exported).items():
        assert n % 8 == 0, (file, n)
        tensors = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
        assert tensors[0][0][0] == 0
        assert all(a[0][1] == b[0][0] for a, b in itertools.pairwise(tensors)), file  # back to back
        assert 8 + n + tensors[-1][0][1] == size, file


def test_routers_that_are_not_linear_are_ignored(tmp_path):
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    model = hf_model("qwen3_moe")
    assert type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"  # not an nn.Linear
    recipe = parse_recipe(W4A16_G16, "w4a16-g16.toml")
    calibrate(model, IDS, recipe, batch_size=2, progress=False)
    out = export_checkpoint(model, tmp_path / "out", recipe=recipe)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]


_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _written_with(key: str) -> str:
    """``model.layers.0.self_attn.k_proj.weight_scale`` -> ``model.layers.0.self_attn.qkv``."""
    parent, _, leaf = key.rsplit(".", 1)[0].rpartition(".")
    return f"{parent}.{_FUSED.get(leaf, leaf)}"


def test_a_decoder_layer_is_written_by_every_rank_in_balanced_shares():
    """At 2 ranks each decoder layer's tensors are spread over both ranks (so that they encode at the same time),
    each module's tensors on one rank, q/k/v and gate/up (which vLLM fuses) together, and the two ranks' bytes of a
    layer differ by at most its largest such group; every tensor is written exactly once. Bytes from the entries'
    shapes and dtypes, summed here."""
    import math

    from shardcal.calib.recipes import load_recipe
    from shardcal.export.format import get_format
    from shardcal.export.layout import build_plan

    model = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=3)))
    randomize_(model, seed=3)
    calibrate(model, IDS, "w8a8-int8", batch_size=2, progress=False)
    plan = build_plan(model, load_recipe("w8a8-int8"), 2, 10**9, get_format("compressed-tensors"), None)
    stored = [e.key for s in plan.shards for e in s.entries]
    assert sorted(stored) == sorted(e.key for u in plan.units for e in u.entries) and len(set(stored)) == len(stored)
    for unit in (u for u in plan.units if u.kind == "layer"):
        ranks: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for j, e in enumerate(unit.entries):
            group = _written_with(e.key)
            ranks.setdefault(group, set()).add(unit.owner_of(j))
            sizes[group] = sizes.get(group, 0) + math.prod(e.shape) * e.dtype.itemsize
        assert all(len(r) == 1 for r in ranks.values()), ranks
        per_rank = [sum(sizes[g] for g, r in ranks.items() if rank in r) for rank in (0, 1)]
        assert min(per_rank) > 0 and abs(per_rank[0] - per_rank[1]) <= max(sizes.values()), (unit.name, per_rank)
