"""A streamed run reads each decoder layer into the tensors of a layer it released (the layers are alike), and
into new ones where none fits: every layer still holds exactly what the checkpoint holds for it, however the layer
before wrote into its weights, and nothing is kept once no read can use it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _dist import run_on_ranks
from _tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = 5


def _held_in_turn(folder: str, impl: str, prefetch: bool, scribble: bool) -> dict:
    """Every decoder layer held in turn: its parameters' values and storage addresses; with ``scribble`` each step
    overwrites its weights (as calibration writes quantized weights into them) before the release."""
    from shardcal.loading.streamed import load_streamed
    from shardcal.sharding.residency import RESIDENCY_ATTR

    residency = getattr(load_streamed(folder, impl=impl, prefetch=prefetch), RESIDENCY_ATTR)
    values, pointers = [], []
    try:
        for i, layer in enumerate(residency.layers):
            with residency.held(i, layer) as held:
                values.append({n: p.detach().float().tolist() for n, p in held.named_parameters()})
                pointers.append({n: p.data_ptr() for n, p in held.named_parameters()})
                if scribble:
                    with torch.no_grad():
                        for p in held.parameters():
                            p.fill_(float("nan"))
        left = sum(len(v) for v in residency._spare._free.values())
    finally:
        residency.close()
    return {"values": values, "pointers": pointers, "left": left}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("streamed-buffers")
    return {
        "llama": make_tiny_checkpoint(root, "llama", seed=4, num_hidden_layers=LAYERS),
        "qwen2_moe": make_tiny_checkpoint(root, "qwen2_moe", seed=6, num_hidden_layers=LAYERS),
    }


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("prefetch", [True, False])
def test_each_layer_holds_the_checkpoints_values_in_reused_buffers(models, ranks, prefetch):
    """shardcal's Llama against the checkpoint's own tensors; on 2 CPU ranks (each reads the layer whole and holds it
    as read) layer i + 2 is held in layer i's tensors (not prefetching: layer i + 1 in layer i's), and after the last
    layer nothing is kept."""
    folder = models["llama"]
    stored = load_file(str(folder / "model.safetensors"))
    step = 2 if prefetch else 1
    for got in run_on_ranks(ranks, _held_in_turn, str(folder), "shardcal", prefetch, True):
        for i, layer in enumerate(got["values"]):
            want = {n: stored[f"model.layers.{i}.{n}"].float().tolist() for n in layer}
            assert set(want) and layer == want, i
        assert got["left"] == 0
        if ranks == 2:
            for i in range(step, LAYERS):
                assert got["pointers"][i] == got["pointers"][i - step], i
            assert got["pointers"][1] != got["pointers"][0] if prefetch else True


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_experts_read_into_reused_buffers_are_a_fresh_reads(models, ranks):
    """transformers' Qwen2-MoE class (fused experts stacked from per-expert keys): scribbled over and read into reused
    buffers, every layer holds what a run that never writes into its weights holds — the same as a fresh read."""
    folder = str(models["qwen2_moe"])
    fresh = run_on_ranks(1, _held_in_turn, folder, "transformers", False, False)[0]
    assert any(len(layer) for layer in fresh["values"])
    for got in run_on_ranks(ranks, _held_in_turn, folder, "transformers", True, True):
        assert got["values"] == fresh["values"] and got["left"] == 0
        if ranks == 2:
            assert got["pointers"][LAYERS - 1] == got["pointers"][LAYERS - 3]
