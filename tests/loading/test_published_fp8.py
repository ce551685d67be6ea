"""A checkpoint published in FP8 with block scales (DeepSeek-V3's layout: ``quant_method: "fp8"``,
``weight_block_size``, ``<linear>.weight`` float8_e4m3fn and ``<linear>.weight_scale_inv``) reads as the weights it
stands for: every loader (plain, sharded on 1 and 2 ranks, streamed) gives exactly what the same checkpoint
dequantized to bf16 by the published formula — written out here block by block — gives, and the command calibrates
it to the dequantized copy's export, byte for byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from shardcal.errors import CheckpointError
from shardcal.models import from_pretrained

from _dist import run_on_ranks
from _tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: Blocks that divide neither the Linears' widths (64, 96) nor a rank's half of their rows: every edge is a partial
#: block, and a rank's rows start inside one.
BLOCK = (24, 40)


def _blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The publisher's side, block by block: ``(fp8 values, scale_inv [ceil(out / bo), ceil(in / bi)], the weight the
    pair stands for, float32)`` with ``scale_inv = max |w| / 448`` per block."""
    bo, bi = block
    out, inp = weight.shape
    w = weight.float()
    scale = torch.empty(math.ceil(out / bo), math.ceil(inp / bi))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    dequantized = torch.empty(out, inp)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * bo, (r + 1) * bo), slice(c * bi, (c + 1) * bi)
            s = float(w[rows, cols].abs().max()) / 448.0 or 1.0
            scale[r, c] = s
            q[rows, cols] = (w[rows, cols] / s).to(torch.float8_e4m3fn)
            dequantized[rows, cols] = q[rows, cols].float() * scale[r, c]
    return q, scale, dequantized


def make_published_pair(root: Path, block: tuple[int, int] = BLOCK, seed: int = 3) -> tuple[Path, Path, Path]:
    """A tiny bf16 Llama published in FP8 blocks (its decoder Linears), its copy dequantized to bf16, and its copy
    whose dequantized Linears are kept exactly (float32; the other tensors bf16 as published)."""
    base = make_tiny_checkpoint(root, "llama", torch.bfloat16, seed=seed, num_hidden_layers=2)
    weights = load_file(str(base / "model.safetensors"))
    fp8, copy, exact = {}, {}, {}
    for key, tensor in weights.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            q, scale, dequantized = _blockwise(tensor, block)
            fp8[key], fp8[f"{key}_scale_inv"] = q, scale
            copy[key], exact[key] = dequantized.to(torch.bfloat16), dequantized
        else:
            fp8[key] = copy[key] = exact[key] = tensor
    config = json.loads((base / "config.json").read_text())
    folders = []
    for name, tensors, quant in (
        ("fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": list(block)}),
        ("dequantized", copy, None),
        ("exact", exact, None),
    ):  # fmt: skip
        folder = root / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
        folders.append(folder)
    return folders[0], folders[1], folders[2]


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, Path, Path]:
    return make_published_pair(tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
def pair(published) -> tuple[Path, Path]:
    return published[0], published[1]


def test_plain_load_is_the_dequantized_copy(pair):
    fp8, copy = pair
    got, want = from_pretrained(fp8), from_pretrained(copy)
    assert got.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_readers_hide_the_scales_and_read_rows_inside_a_block(pair):
    from shardcal.models.checkpoint import CheckpointReader
    from shardcal.models.reads import ReadingReader

    fp8, copy = pair
    key = "model.layers.1.mlp.down_proj.weight"  # [64, 96]
    want = load_file(str(copy / "model.safetensors"))[key].float()
    for reader_class in (CheckpointReader, ReadingReader):
        with reader_class(fp8) as reader:
            assert not any(k.endswith("_scale_inv") for k in reader.keys()) and f"{key}_scale_inv" not in reader
            assert reader.floating_dtype() == torch.bfloat16 if hasattr(reader, "floating_dtype") else True
            assert torch.equal(reader.get(key).bfloat16().float(), want)
            for start, stop in ((0, 64), (5, 29), (24, 48), (47, 64), (32, 33)):
                rows = reader.get_rows(key, start, stop)
                assert rows.dtype == torch.float32 and torch.equal(rows.bfloat16().float(), want[start:stop])
                # read as the parameter's dtype: rounded once from the float32 product, so the copy's values
                rows = reader.get_rows(key, start, stop, torch.bfloat16)
                assert rows.dtype == torch.bfloat16 and torch.equal(rows.float(), want[start:stop])
            assert torch.equal(reader.get(key, torch.bfloat16).float(), want)
            # read into a slot of a larger tensor, as a stacked parameter is: contiguous rows, or strided columns
            assert (
                reader.value_dtype(key) == torch.float32 and reader.value_dtype("model.norm.weight") == torch.bfloat16
            )
            rows, cols = reader.shape(key)
            for dtype in (torch.float32, torch.bfloat16):
                stack = torch.full((2, rows, cols), float("nan"), dtype=dtype)
                wide = torch.full((rows, cols + 4), float("nan"), dtype=dtype)
                for slot in (stack[1], wide[:, 4:]):
                    assert reader.read_into(key, slot).data_ptr() == slot.data_ptr()
                    assert torch.equal(slot.float(), want if dtype == torch.bfloat16 else reader.get(key))
                assert stack[0].isnan().all() and wide[:, :4].isnan().all()  # nothing outside the slot written
            norm = torch.empty(reader.shape("model.norm.weight"), dtype=torch.float32)
            reader.read_into("model.norm.weight", norm)
            assert torch.equal(norm, reader.get("model.norm.weight").float())
            with pytest.raises(
                ValueError, match=rf"cannot read rows 0:{rows} into a tensor of shape \[{rows}, {cols - 1}\]"
            ):
                reader.read_into(key, torch.empty(rows, cols - 1))
            with pytest.raises(ValueError, match=rf"cannot read rows 4:{rows + 1} into"):
                reader.read_into(key, torch.empty(rows - 3, cols), 4)


def test_sources_read_in_the_parameters_dtype(pair):
    """A parameter's source read as its dtype: experts stacked from per-expert keys (none asked for: an empty stack of
    that dtype too), and a tensor the checkpoint stores unquantized, cast."""
    from shardcal.loading.sources import Source
    from shardcal.models.reads import ReadingReader

    fp8, copy = pair
    want = load_file(str(copy / "model.safetensors"))
    keys = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]
    with ReadingReader(fp8) as reader:
        experts = Source([[k] for k in keys], stacked=True)
        got = experts.full(reader, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.stack([want[k] for k in keys]))
        got = experts.rows(reader, 1, 2, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got[0], want[keys[1]])
        none = experts.rows(reader, 1, 1, torch.bfloat16)
        assert none.dtype == torch.bfloat16 and none.shape == (0, *want[keys[0]].shape)
        norm = Source([["model.norm.weight"]])
        got = norm.full(reader, torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, want["model.norm.weight"].float())
        got = norm.rows(reader, 3, 9, torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, want["model.norm.weight"][3:9].float())


def test_staged_reads_reuse_one_buffer_per_thread(pair, monkeypatch):
    """While a thread stages (a streamed layer's read), FP8 codes go through one buffer: the next read reuses it, a
    tensor over the limit gets its own, none is kept after; two threads staging at once each read their own
    tensors' values; rows read into a tensor of the stored dtype go straight into it."""
    import threading

    from shardcal.models import reads
    from shardcal.models.reads import ReadingReader

    fp8, copy = pair
    want = load_file(str(copy / "model.safetensors"))
    keys = [f"model.layers.{i}.mlp.{p}.weight" for i in (0, 1) for p in ("down_proj", "up_proj")]
    with ReadingReader(fp8) as reader:
        rows = reader.shape(keys[0])[0]
        held = [reader._raw_get_staged(keys[0], 0, rows) for _ in range(2)]  # not staging: each its own
        assert held[0].data_ptr() != held[1].data_ptr()
        with reader.staging():
            first = reader._raw_get_staged(keys[0], 0, rows)
            pointer, codes = first.data_ptr(), first.clone()
            second = reader._raw_get_staged(keys[2], 3, rows)  # fewer rows of another tensor: the same buffer
            assert second.data_ptr() == pointer and not torch.equal(
                second.view(torch.uint8), codes[3:].view(torch.uint8)
            )
            assert torch.equal(second.view(torch.uint8), reader._raw_get_rows(keys[2], 3, rows).view(torch.uint8))
            monkeypatch.setattr(reads, "STAGING_MAX_BYTES", first.numel() - 1)
            over = reader._raw_get_staged(keys[0], 0, rows)  # over the limit: a new buffer
            assert over.data_ptr() != pointer and torch.equal(over.view(torch.uint8), codes.view(torch.uint8))
            monkeypatch.undo()
        assert reader._staging.buffer is None
        strided = torch.empty(rows, 2 * reader.shape(keys[0])[1], dtype=torch.float8_e4m3fn)[:, ::2]
        with pytest.raises(ValueError, match="read into contiguous memory only"):
            reader._raw_get_staged(keys[0], 0, rows, strided)
        norm = torch.empty(reader.shape("model.norm.weight"), dtype=reader.dtype("model.norm.weight"))
        assert reader.read_into("model.norm.weight", norm[2:], 2).data_ptr() == norm[2:].data_ptr()
        assert torch.equal(norm[2:], want["model.norm.weight"][2:])
        bad: list[bool] = []

        def read(key: str) -> None:
            into = torch.empty(reader.shape(key), dtype=torch.bfloat16)
            with reader.staging():
                for _ in range(40):
                    bad.append(not torch.equal(reader.read_into(key, into), want[key]))

        threads = [threading.Thread(target=read, args=(k,)) for k in (keys[0], keys[1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(bad) == 80 and not any(bad)


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_block_dequantization_is_the_published_formula(stored):
    """Rows from inside a block to the end, in float32 and rounded once to bf16: ``q * scale_inv[i // bo, j // bi]``
    computed here by indexing (e4m3 looked up in a table, other stored dtypes converted)."""
    from shardcal.models.published import BlockFP8

    block = BlockFP8(block=BLOCK)
    q = (torch.randn(70, 90, generator=torch.Generator().manual_seed(0)) * 10).to(stored)
    scale = torch.rand(3, 3, generator=torch.Generator().manual_seed(1)) + 0.5
    rows, cols = torch.arange(70)[:, None] // BLOCK[0], torch.arange(90)[None, :] // BLOCK[1]
    want = q.float() * scale[rows, cols]
    for start in (0, 5, 30):
        first, stop = block.scale_rows(start, 70)
        assert torch.equal(block.dequantize(q[start:], scale[first:stop], start), want[start:])
        got = block.dequantize(q[start:], scale[first:stop], start, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want[start:].bfloat16())
        for dtype in (torch.float32, torch.bfloat16):  # into a strided slot: its values, nothing else touched
            wide = torch.zeros(70 - start, 100, dtype=dtype)
            slot = wide[:, 10:]
            assert block.dequantize(q[start:], scale[first:stop], start, dtype, out=slot) is slot
            assert torch.equal(slot, want[start:].to(dtype)) and not wide[:, :10].any()
        with pytest.raises(ValueError, match="dequantize out= must be"):
            block.dequantize(q[start:], scale[first:stop], start, torch.bfloat16, out=torch.empty(q[start:].shape))


def _held_layer(folder: str) -> dict[str, tuple[str, list]]:
    """Decoder layer 1 of a streamed load, held: each parameter's dtype and values."""
    from shardcal.loading.streamed import load_streamed
    from shardcal.sharding.residency import RESIDENCY_ATTR

    residency = getattr(load_streamed(folder), RESIDENCY_ATTR)
    try:
        with residency.held(1, residency.layers[1]) as layer:
            return {n: (str(p.dtype), p.float().tolist()) for n, p in layer.named_parameters()}
    finally:
        residency.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_streamed_layer_is_held_in_its_parameters_dtype(pair, ranks):
    """On 2 CPU ranks each rank reads the layer whole, on 1 its rows: both hold the dequantized copy's bf16 values."""
    fp8, copy = pair
    want = run_on_ranks(1, _held_layer, str(copy))[0]
    assert {dtype for dtype, _ in want.values()} == {"torch.bfloat16"}
    for got in run_on_ranks(ranks, _held_layer, str(fp8)):
        assert got == want


def _sharded(folder: str) -> dict[str, list]:
    """This rank's rows of every parameter, loaded sharded."""
    from shardcal.loading.sharded import load_pretrained

    model = load_pretrained(folder)
    return {n: p.to_local().float().tolist() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ranks", [1, 2])
def test_sharded_load_is_the_dequantized_copys(pair, ranks):
    """Each rank reads its rows (and the scale rows they need; on 2 ranks a rank's rows start inside a block)."""
    fp8, copy = pair
    assert run_on_ranks(ranks, _sharded, str(fp8)) == run_on_ranks(ranks, _sharded, str(copy))


def _export_files(folder: Path) -> dict[str, bytes]:
    skip = ("calibration_report.json", "calibration_sqnr.png", "shardcal_export.json", "config.json")
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in skip}


@pytest.mark.parametrize(
    ("stream", "impl"), [("off", "shardcal"), ("on", "shardcal"), ("off", "transformers")],
    ids=["resident", "streamed", "transformers-class"],
)  # fmt: skip
def test_the_command_calibrates_it_to_the_dequantized_copys_export(published, tmp_path, stream, impl):
    """The published FP8 checkpoint through ``calibrate`` (resident, streamed, and as transformers' class) gives the
    export of its dequantized copy: the same tensors, and a config.json whose quantization_config is the export's
    own. shardcal's class loads in the config's bf16 (the bf16 copy's weights); transformers' class in float32, where
    the dequantized weights are kept exactly (the float32 copy's; the export's unquantized tensors in bf16 both)."""
    from shardcal.pipeline import calibrate as pipeline_calibrate

    if impl == "transformers":
        pytest.importorskip("transformers")
    fp8, copy, exact = published
    reference = exact if impl == "transformers" else copy
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, size=(4, 16)))
    for folder in (fp8, reference):
        pipeline_calibrate.calibrate_to_checkpoint(
            folder, tmp_path / folder.name, "w8a8-int8", data=tmp_path / "ids.npy", stream=stream, model_impl=impl,
            export_dtype="bfloat16",
        )  # fmt: skip
    assert _export_files(tmp_path / "fp8") == _export_files(tmp_path / reference.name)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    want = json.loads((tmp_path / reference.name / "config.json").read_text())
    assert config["quantization_config"] == want["quantization_config"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"


def test_an_fp8_checkpoint_without_blocks_is_refused_naming_its_config(pair, tmp_path):
    import shutil

    fp8, _ = pair
    per_tensor = tmp_path / "per-tensor"
    shutil.copytree(fp8, per_tensor)
    config = json.loads((per_tensor / "config.json").read_text())
    del config["quantization_config"]["weight_block_size"]
    (per_tensor / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config 'fp8' needs weight_block_size"):
        from_pretrained(per_tensor)


def _stored_bytes(folder: Path) -> int:
    """The tensor data of every safetensors file in ``folder``, from its header (the data offsets), read here."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_planner_counts_the_bytes_as_published(published, ranks):
    """The plan reads the FP8 codes and their scales as stored: the checkpoint's size is its tensor data, and each
    rank reads what a recording reader below the loader is asked for (within the scale rows that two ranks' rows
    inside one block both need), not the dequantized weights' bytes."""
    from test_reads_own_rows import _recorded_load

    from shardcal.layerwise.options import CalibrationOptions
    from shardcal.plan.planner import PlanSettings, plan_calibration

    fp8 = published[0]
    settings = PlanSettings(world_size=ranks, num_samples=8, seq_len=16, options=CalibrationOptions(batch_size=2))
    plan = plan_calibration(fp8, "fp8", settings)
    assert plan.model["checkpoint_bytes"] == _stored_bytes(fp8)
    requested = [sum(count for *_, count in r["log"]) for r in run_on_ranks(ranks, _recorded_load, str(fp8))]
    planned = [r.bytes_read for r in plan.ranks]
    if ranks == 1:
        assert planned == requested == [_stored_bytes(fp8)]
    else:
        scale_rows = 4 * 2 * 7 * math.ceil(64 / BLOCK[1])  # a generous bound: a few shared float32 scale rows
        assert all(0 <= r - p <= scale_rows for p, r in zip(planned, requested)), (planned, requested)


def test_a_residual_rotation_plans_the_tied_head_read_again_and_the_rest_as_stored(tmp_path):
    """A tied model published in FP8 blocks, planned with a residual rotation (loaded untied: the head a unit of its
    own, read from the embeddings): one rank reads the checkpoint as stored — FP8 codes and their scales — plus the
    embeddings once more for the head."""
    from dataclasses import replace

    from shardcal.calib.recipe import Rotation
    from shardcal.calib.recipes import load_recipe
    from shardcal.layerwise.options import CalibrationOptions
    from shardcal.plan.planner import PlanSettings, plan_calibration

    base = make_tiny_checkpoint(
        tmp_path, "llama", torch.bfloat16, seed=4, num_hidden_layers=2, tie_word_embeddings=True
    )
    weights, published = load_file(str(base / "model.safetensors")), {}
    for key, tensor in weights.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            published[key], published[f"{key}_scale_inv"], _ = _blockwise(tensor, BLOCK)
        else:
            published[key] = tensor
    save_file(published, str(base / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    recipe = load_recipe("fp8-dynamic")
    rotated = replace(recipe, rotation=Rotation(None, residual="hadamard"), name="fp8-dynamic-residual")
    settings = PlanSettings(world_size=1, num_samples=8, seq_len=16, options=CalibrationOptions(batch_size=2))
    embeddings = weights["model.embed_tokens.weight"]
    read = plan_calibration(base, rotated, settings, dtype="float32").ranks[0].bytes_read
    assert read == _stored_bytes(base) + embeddings.numel() * embeddings.element_size()
