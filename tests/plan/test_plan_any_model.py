"""The planner on models shardcal has no class for (transformers' classes, built on the meta device): Gemma 3,
Phi-3, transformers' Qwen3-MoE with fused 3-D experts, and a Llava VLM (vision tower not quantized).

The models are sized so that their tensors, not the fixed runtime allowance, dominate the peak (a pooled rank
process has paid that allowance before its baseline). Independent references: the bytes each rank's sharded load reports reading (counted by the loader, not the
planner), the export's files on disk, and each rank's measured peak resident growth (``VmHWM``) of the real
load -> calibrate -> export, held to the planner's bound (-20 % / +25 %)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardcal.layerwise.options import CalibrationOptions
from shardcal.plan import planner as planning
from shardcal.plan.planner import PlanSettings, plan_calibration

from _dist import fresh_ranks, run_on_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

LOW, HIGH = -0.20, 0.25  # the planner's memory bound: measured / predicted - 1
SAMPLES, SEQ, BATCH = 8, 64, 2


def _gemma3():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=32768, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, sliding_window=16, layer_types=types, max_position_embeddings=512,
    ))  # fmt: skip


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=32768, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        norm_topk_prob=True, max_position_embeddings=512,
    ))  # fmt: skip


#: Tiny transformers models with no shardcal class: fused qkv / gate_up, a VLM, MLA with a router bias buffer,
#: transposed interleaved fused experts with biases.
FOREIGN = ("phi3", "llava", "deepseek_v3", "gpt_oss")


def _tiny(family: str):
    from _hf_models import hf_model

    return hf_model(family)


BUILDERS = {"gemma3": _gemma3, "qwen3_moe": _qwen3_moe, **{f: lambda f=f: _tiny(f) for f in FOREIGN}}


def _checkpoint(tmp_path: Path, family: str) -> Path:
    torch.manual_seed(0)
    model = BUILDERS[family]()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    folder = tmp_path / family
    model.save_pretrained(folder)
    return folder


def _settings(world: int) -> PlanSettings:
    return PlanSettings(
        world_size=world, num_samples=SAMPLES, seq_len=SEQ, options=CalibrationOptions(batch_size=BATCH)
    )


def _pipeline(model_dir: str, recipe: str, ids: torch.Tensor, out_dir: str) -> dict:
    """One rank (a pooled process, its imports and thread pools already paid): transformers' class, sharded load -> calibrate -> export, each phase's peak resident growth."""
    from shardcal.calib.runner import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.loading.foreign import build_transformers_on_meta, load_transformers_sharded
    from shardcal.runtime.distributed import barrier
    from shardcal.runtime.hostmem import peak_rss_bytes, pin_mmap_threshold, reset_peak_rss, rss_bytes

    pin_mmap_threshold()
    build_transformers_on_meta(model_dir)  # transformers' modules imported before the baseline
    barrier()
    base = rss_bytes()
    measured: dict[str, int] = {}

    def phase(name: str) -> None:
        measured[name] = peak_rss_bytes() - base
        barrier()
        reset_peak_rss()

    reset_peak_rss()
    model = load_transformers_sharded(model_dir)
    measured["bytes_read"] = model._shardcal_distribution_plan["bytes_read"]
    phase("load")
    calibrate(model, ids, recipe, batch_size=BATCH, progress=False)
    phase("calibrate")
    export_checkpoint(model, out_dir, recipe=recipe, overwrite=True)
    phase("export")
    measured["peak"] = max(measured[k] for k in ("load", "calibrate", "export"))
    return measured


@pytest.mark.parametrize(("family", "recipe"), [("gemma3", "w8a8-int8"), ("qwen3_moe", "fp8")])
def test_reads_export_and_peak_of_a_transformers_model(tmp_path, family, recipe):
    folder = _checkpoint(tmp_path, family)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))
    plan = plan_calibration(folder, recipe, _settings(2), impl="transformers")
    fresh_ranks(2)  # memory freed by earlier tests in a pooled process would hide this run's growth
    got = run_on_ranks(2, _pipeline, str(folder), recipe, ids, str(tmp_path / "out"), timeout=600)
    assert [r.bytes_read for r in plan.ranks] == [g["bytes_read"] for g in got]
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert plan.disk["export_files"] == len(files)
    assert plan.disk["export_bytes"] == sum(f.stat().st_size for f in files)
    errors = [g["peak"] / r.peak - 1 for g, r in zip(got, plan.ranks, strict=True)]
    print(f"{family} {recipe}: predicted {[r.peak for r in plan.ranks]}, measured {[g['peak'] for g in got]}, {errors}")
    assert all(LOW <= e <= HIGH for e in errors), (errors, got, [r.phases for r in plan.ranks])


def _bytes_read(model_dir: str) -> int:
    from shardcal.loading.foreign import load_transformers_sharded

    return load_transformers_sharded(model_dir)._shardcal_distribution_plan["bytes_read"]


@pytest.mark.parametrize("family", FOREIGN)
def test_bytes_read_of_models_shardcal_has_no_class_for(tmp_path, family):
    folder = _checkpoint(tmp_path, family)
    plan = plan_calibration(folder, "w8a8-int8", _settings(2))
    assert plan.model["model_type"] == family
    assert [r.bytes_read for r in plan.ranks] == run_on_ranks(2, _bytes_read, str(folder))


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("family", FOREIGN)
def test_export_size_of_models_shardcal_has_no_class_for(tmp_path, family):
    from shardcal import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.loading.foreign import load_transformers_plain

    folder = _checkpoint(tmp_path, family)
    model = load_transformers_plain(folder)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    calibrate(model, ids, "w8a8-int8", batch_size=2, progress=False)
    out = export_checkpoint(model, tmp_path / "out", recipe="w8a8-int8")
    files = sorted(out.glob("*.safetensors"))
    plan = plan_calibration(folder, "w8a8-int8", PlanSettings(num_samples=4, seq_len=16))
    assert plan.disk["export_bytes"] == sum(f.stat().st_size for f in files)
    if family == "llava":  # the vision tower is stored as it is, never quantized
        quantized = {t.linear.name for t in planning.PreparedModel(planning.read_source(folder),
                                                                   planning.load_recipe("w8a8-int8")).targets}  # fmt: skip
        assert quantized and not any("vision_tower" in n for n in quantized)


def test_a_model_type_only_transformers_has_is_plannable(tmp_path):
    folder = _checkpoint(tmp_path, "phi3")
    assert planning.plannable(folder)
    planning.check_plannable(folder)
