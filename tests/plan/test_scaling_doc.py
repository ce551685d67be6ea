"""docs/guides/scaling.md's tables are the planner's output: four published model shapes, three recipes, 8 / 16 / 64 GPUs.

``python tests/plan/test_scaling_doc.py`` prints the tables the doc carries; the test regenerates them and compares.
The configs are written here from the models' published ``config.json`` shapes (nothing is downloaded).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardcal.calib.recipes import load_recipe
from shardcal.layerwise.options import CalibrationOptions
from shardcal.models.config import ModelConfig
from shardcal.plan.planner import Budget, ModelSource, PlanSettings, PreparedModel, fmt_bytes, plan_prepared, shortfall

DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "scaling.md"
GPU_BYTES = 80 * 2**30  # "80 GB" GPUs (A100 / H100 80GB: 80 GiB)
WORLD_SIZES = (8, 16, 64)
RECIPES = ("fp8", "w8a8-int8", "w4a16-gptq")
SAMPLES, SEQ_LEN, BATCH = 512, 2048, 4
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip

CONFIGS: dict[str, dict] = {
    "Llama-3.1-70B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Llama-3.1-405B": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
        "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-235B-A22B": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Mixtral-8x22B": {
        "model_type": "mixtral", "vocab_size": 32768, "hidden_size": 6144, "intermediate_size": 16384,
        "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}  # fmt: skip


def _settings(world: int) -> PlanSettings:
    return PlanSettings(world_size=world, local_world_size=8, num_samples=SAMPLES, seq_len=SEQ_LEN, device="cuda",
                        options=CalibrationOptions(batch_size=BATCH))  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def model_table(name: str) -> str:
    """One model's rows: recipe x world size."""
    cfg = ModelConfig.from_dict(CONFIGS[name], source=name)
    source = ModelSource(config=cfg, file_dtypes=None, checkpoint_bytes=0)
    lines = [
        "| recipe | GPUs | device peak / rank (GiB) | at | fits 80 GB | largest part | host / rank (GiB) "
        "| read / rank (GiB) | all-gather / layer (GiB) | export (GiB) |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for recipe in RECIPES:
        prepared = PreparedModel(source, load_recipe(recipe))
        export = plan_prepared(prepared, _settings(WORLD_SIZES[0])).disk["export_bytes"]  # ~ the same at any N
        for world in WORLD_SIZES:
            plan = plan_prepared(prepared, _settings(world), full=False)
            peak = plan.peak_rank
            fits = shortfall(plan, Budget(GPU_BYTES, None)) is None
            part, size = max(((k, v) for k, v in peak.parts.items() if k not in ("checkpoint_pages", "runtime")),
                             key=lambda kv: kv[1])  # fmt: skip
            lines.append(
                f"| {recipe} | {world} | {_gib(peak.peak)} | {peak.peak_phase} | {'yes' if fits else '**no**'} "
                f"| {part.replace('_', ' ')} {fmt_bytes(size)} | {_gib(peak.host_peak)} | {_gib(peak.bytes_read)} "
                f"| {_gib(plan.io['allgather_bytes_per_layer'])} | {_gib(export)} |"
            )
    return "\n".join(lines)


def scaling_tables() -> dict[str, str]:
    return {name: model_table(name) for name in CONFIGS}


def _doc_tables() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    out = {}
    for name in CONFIGS:
        match = re.search(rf"### {re.escape(name)}\n\n(\|.*?)(?:\n\n|\Z)", text, flags=re.S)
        assert match, f"docs/guides/scaling.md has no table under '### {name}'"
        out[name] = match.group(1).strip()
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_docs_scaling_tables_are_the_planners(name):
    assert _doc_tables()[name] == model_table(name), "regenerate with: python tests/plan/test_scaling_doc.py"


if __name__ == "__main__":
    for model, table in scaling_tables().items():
        print(f"### {model}\n\n{table}\n")
