"""GPT-OSS's experts published in MXFP4 (``quant_method: "mxfp4"``: ``<experts>.gate_up_proj_blocks`` /
``_scales``): the readers give what transformers' own ``convert_moe_packed_tensors`` gives, bit for bit, whole and
expert by expert; the sharded load (1 and 2 ranks) is the dequantized copy's; the command calibrates it to the
dequantized copy's export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _hf_models import hf_model
from safetensors.torch import load_file, save_file

from _dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The publisher's side: ``weight`` [E, out, in] as blocks [E, out, in / 32, 16] (two nearest FP4 codes a byte,
    the low nibble first) and E8M0 scales [E, out, in / 32] (``floor(log2 max|w|) - 2``, FP4's largest exponent)."""
    e, out, inp = weight.shape
    groups = weight.float().reshape(e, out, inp // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.full_like(amax, -127))
    scaled = (groups / torch.exp2(exponent).unsqueeze(-1)).clamp(-6.0, 6.0)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)  # the nearest code (+0 before -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny GPT-OSS saved by transformers, its experts re-published in MXFP4; and its copy with those experts
    dequantized by transformers' own function (float32, the rest as saved)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    model = hf_model("gpt_oss", hidden_size=64)
    model.save_pretrained(root / "saved")
    weights = {}
    for file in sorted((root / "saved").glob("*.safetensors")):
        weights.update(load_file(str(file)))
    packed, copy = {}, {}
    for key, tensor in weights.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4(tensor.transpose(1, 2))  # the module holds [E, in, out]; published: [E, out, in]
            packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
            copy[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[key] = copy[key] = tensor
    config = json.loads((root / "saved" / "config.json").read_text())
    folders = []
    for name, tensors, quant in (("mxfp4", packed, {"quant_method": "mxfp4"}), ("dequantized", copy, None)):
        folder = root / name
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        body = {k: v for k, v in config.items() if k != "quantization_config"}
        (folder / "config.json").write_text(json.dumps({**body, **({"quantization_config": quant} if quant else {})}))
        folders.append(folder)
    return folders[0], folders[1]


def test_the_readers_give_transformers_dequantization(published):
    from shardcal.models.checkpoint import CheckpointReader
    from shardcal.models.reads import ReadingReader

    packed, copy = published
    want = load_file(str(copy / "model.safetensors"))
    key = "model.layers.1.mlp.experts.gate_up_proj"
    for reader_class in (CheckpointReader, ReadingReader):
        with reader_class(packed) as reader:
            assert key in reader and not any(k.endswith(("_blocks", "_scales")) for k in reader.keys())
            assert set(reader.keys()) == set(want) and reader.shape(key) == tuple(want[key].shape)
            for name in (key, "model.layers.0.mlp.experts.down_proj"):
                assert torch.equal(reader.get(name), want[name]), name
                assert torch.equal(reader.get_rows(name, 1, 3), want[name][1:3]), name  # experts 1 and 2 only
                got = reader.get_rows(name, 1, 3, torch.bfloat16)  # read as a bf16 parameter: cast once
                assert got.dtype == torch.bfloat16 and torch.equal(got, want[name][1:3].bfloat16()), name
                assert torch.equal(reader.get(name, torch.bfloat16), want[name].bfloat16()), name
                assert reader.value_dtype(name) == torch.float32, name
                into = torch.full(want[name].shape, float("nan"), dtype=torch.bfloat16)
                assert reader.read_into(name, into) is into and torch.equal(into, want[name].bfloat16()), name


def _sharded(folder: str) -> dict[str, list]:
    from shardcal.loading.foreign import load_transformers_sharded

    model = load_transformers_sharded(folder)
    return {n: p.to_local().float().tolist() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ranks", [1, 2])
def test_sharded_load_is_the_dequantized_copys(published, ranks):
    packed, copy = published
    assert run_on_ranks(ranks, _sharded, str(packed)) == run_on_ranks(ranks, _sharded, str(copy))


def test_the_command_calibrates_it_to_the_dequantized_copys_export(published, tmp_path):
    from shardcal.pipeline import calibrate as pipeline_calibrate

    packed, copy = published
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, size=(4, 16)))
    for folder in (packed, copy):
        pipeline_calibrate.calibrate_to_checkpoint(
            folder, tmp_path / folder.name, "fp8-dynamic", data=tmp_path / "ids.npy", export_dtype="bfloat16"
        )
    skip = ("calibration_report.json", "calibration_sqnr.png", "shardcal_export.json", "config.json")
    files = [sorted(p.name for p in (tmp_path / f.name).iterdir() if p.name not in skip) for f in (packed, copy)]
    assert files[0] == files[1]
    for name in files[0]:
        assert (tmp_path / packed.name / name).read_bytes() == (tmp_path / copy.name / name).read_bytes(), name
    config = json.loads((tmp_path / packed.name / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors" and len(files[0]) > 0


def test_the_planner_counts_the_bytes_as_published(published):
    """The plan reads MXFP4 experts as stored (half a byte a value and one scale byte per 32), not a byte a value:
    its checkpoint size is the tensor data the header gives, and one rank reads exactly that."""
    from shardcal.layerwise.options import CalibrationOptions
    from shardcal.plan.planner import PlanSettings, plan_calibration

    mxfp4 = published[0]
    with open(mxfp4 / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    stored = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    settings = PlanSettings(world_size=1, num_samples=8, seq_len=16, options=CalibrationOptions(batch_size=2))
    plan = plan_calibration(mxfp4, "fp8-dynamic", settings)
    assert plan.model["checkpoint_bytes"] == stored
    assert plan.ranks[0].bytes_read == stored
