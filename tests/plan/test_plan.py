"""The planner (``shardcal plan``, and the refusal in ``shardcal calibrate``): every part of a tiny model's plan against
numbers worked out by hand below (dense and MoE), the export size and the bytes each rank reads against the real
export and the real sharded load, the ``--json`` schema, a config-only directory, bad input, and the refusal."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_inputs import snapshot
from test_gguf_tokenizer import byte_level_tokenizer_json

from shardcal.calib.recipe import Recipe, Rotation
from shardcal.calib.recipes import load_recipe, recipe_from_dict, shipped_recipes
from shardcal.cli import main as cli
from shardcal.errors import ConfigError, RecipeError
from shardcal.layerwise.options import CalibrationOptions
from shardcal.loading.build import build_on_meta
from shardcal.models.config import ModelConfig
from shardcal.plan import planner as planning
from shardcal.plan.planner import PlanSettings, plan_calibration
from shardcal.plan.render import PART_LABELS
from shardcal.runtime import hostmem

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 2**20
RUNTIME = 34 * MiB + 2 * (MiB // 10)  # the fixed allowance of a 2-layer model
#: vocab 256, hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 kv heads, float32, untied.
LLAMA = {**TINY_CONFIGS["llama"], "torch_dtype": "float32"}
GPTQ_INT8 = recipe_from_dict(
    {
        "name": "int8-gptq",
        "weight": {"format": "int8", "granularity": "channel", "axis": 0},
        "algorithm": {"name": "gptq"},
    }
)


def config_dir(tmp_path: Path, raw: dict, name: str = "cfg") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def settings(world: int, **kw) -> PlanSettings:
    return PlanSettings(
        world_size=world, num_samples=8, seq_len=16, options=CalibrationOptions(batch_size=2, sqnr_tokens=32), **kw
    )


# ---------------------------------------------------------------------------------------------- the tensor list


@pytest.mark.parametrize(
    "raw",
    [
        *TINY_CONFIGS.values(),
        {**TINY_CONFIGS["llama"], "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        {**TINY_CONFIGS["qwen2"], "num_hidden_layers": 3},
    ],
    ids=[*TINY_CONFIGS, "llama-tied-biases", "qwen2-3-layers"],
)
def test_tensor_list_is_the_models(raw):
    """The planner's parameters, derived from the config alone, are the model's, name for name, in order."""
    cfg = ModelConfig.from_dict(raw)
    model = build_on_meta(cfg, torch.float32)
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert planning.model_tensors(cfg)[0] == expected
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {lin.name for lin in planning.model_tensors(cfg)[1]} == linears


# ---------------------------------------------------------------------------------------------- parts, by hand


def test_dense_parts_by_hand(tmp_path):
    """Tiny Llama, fp32, 2 ranks, 8 x 16 tokens in batches of 2 (rank 0: batches 0-1), w8a8-int8, CPU, the SQNR on
    the first 32 tokens (batch 0)."""
    plan = plan_calibration(config_dir(tmp_path, LLAMA), "w8a8-int8", settings(2))
    # elements: embed 256*64 = 16384; layer: q 64*64, k 32*64, v 32*64, o 64*64, norms 2*64, gate/up/down 3*128*64
    layer = 4096 + 2048 + 2048 + 4096 + 128 + 3 * 8192  # 36992
    total = 16384 + 2 * layer + 64 + 16384  # 106816, every dim even: each rank holds half
    r0, r1 = plan.ranks
    assert r0.parts == {
        "param_shards": total * 4 // 2,  # 213632
        "largest_gathered_unit": layer * 4,  # a decoder layer (147968 B) > the root (embed + norm, 65792 B)
        # 4 rows x 16 tokens x 64 x 4 B, twice, + cos and sin: 4 rows x 16 x 16 (head_dim) x 4 B each
        "activation_cache": 2 * 4 * 16 * 64 * 4 + 2 * 4 * 16 * 16 * 4,
        # one batch (32 tokens) through the MLP: 4 B x 32 x (3*64 + 3*128); + the fake-quantized gate weight
        # (9 B per element of 128*64); + the SQNR of rank 0's batch 0: 32 x 64 x 32 B
        "layer_intermediates": 4 * 32 * (3 * 64 + 3 * 128) + 9 * 8192 + 32 * 64 * 32,
        # per layer: weight amax [out, 1] (64+32+32+64+128+128+64 outs) + 7 input amax [1], float32; + one layer's
        # seven max observers (amax 4 B + count 8 B)
        "quantizer_state": 2 * (4 * 512 + 7 * 4) + 7 * 12,
        "weight_observer": 4 * 8192,  # the max observer's |w| of the largest weight, float32
        "algorithm_state": 0,
        "export_buffers": 20 * 8192,  # encoding the largest int8 weight of the layer rank 0 writes
        "checkpoint_pages": total * 4 // 2,
        "runtime": RUNTIME,
    }
    assert r1.parts["layer_intermediates"] == 4 * 32 * (3 * 64 + 3 * 128) + 9 * 8192  # no SQNR batch on rank 1
    # phases: the load maps this rank's checkpoint rows beside the shards; layer 1's quantize-mode forward peaks
    shards, qstate = 213632, 2 * 2076
    base = shards + qstate + layer * 4
    assert r0.phases == {
        "load": 2 * shards + RUNTIME,
        "embed": shards + 2 * (16384 + 64) * 4 + (4 * 16 * 64 * 4 + 2 * 4 * 16 * 16 * 4) + RUNTIME,  # root gathered x2
        "layers": base + (4 * 32 * 576 + 9 * 8192) + (2 * 16384 + 8192) + RUNTIME,
        "export": shards + qstate + layer * 4 + 20 * 8192 + RUNTIME,
    }
    assert plan.peak_bytes_per_rank == r0.peak == r0.phases["layers"] and r0.peak_phase == "layers"
    assert r0.required == r0.peak  # nothing reclaimable at the peak
    assert plan.io == {
        "allgather_bytes_per_layer": layer * 4,
        "allgather_sent_per_layer_per_rank": layer * 4 // 2,
        # gathered: root + 2 layers to calibrate; 2 layers + lm_head + root to export; each rank sends half
        "allgather_sent_total_per_rank": (2 * layer * 4 + 65792) // 2 * 2 + 65536 // 2,
        "allreduce_bytes_per_layer": 7 * 12,
        "allreduce_sent_per_layer_per_rank": 7 * 12,
    }
    # --checkpoint-dir: activations (8 x 16 x 64 x 4) + 1 layer's amax at the first commit, beside the last; each
    # commit's metadata: 512 B per quantizer of its finished layers (14 per layer), 4096 B per rank
    assert plan.disk["checkpoint_dir_bytes"] == (32768 + 2076 + 512 * 14 + 8192) + (4152 + 512 * 28 + 8192)


def test_padding_and_own_rows_at_three_ranks(tmp_path):
    """FSDP2 pads every parameter to ceil(rows / 3) rows on every rank; each rank reads only its own rows."""
    plan = plan_calibration(config_dir(tmp_path, LLAMA), "w8a8-int8", settings(3))
    # ceil(256/3)=86, ceil(64/3)=22, ceil(32/3)=11, ceil(128/3)=43 rows
    layer = 22 * 64 + 11 * 64 + 11 * 64 + 22 * 64 + 22 + 22 + 43 * 64 + 43 * 64 + 22 * 128
    assert plan.ranks[0].parts["param_shards"] == 4 * (86 * 64 + 2 * layer + 22 + 86 * 64)
    assert plan.ranks[0].parts["largest_gathered_unit"] == 3 * 4 * layer
    # rank 2 owns rows [172, 256) of 256, [44, 64) of 64, [22, 32) of 32, [86, 128) of 128
    layer_rows = 20 * 64 + 10 * 64 + 10 * 64 + 20 * 64 + 20 + 20 + 42 * 64 + 42 * 64 + 20 * 128
    assert plan.ranks[2].bytes_read == 4 * (84 * 64 + 2 * layer_rows + 20 + 84 * 64)
    assert sum(r.bytes_read for r in plan.ranks) == 4 * 106816


MOE = {**TINY_CONFIGS["qwen3_moe"]}  # hidden 64, 4 experts of 32, top-2, head_dim 16, every layer sparse


def test_moe_gptq_state_by_hand(tmp_path):
    """Qwen3-MoE: GPTQ holds one [in, in] exact sum (16 B/element) per quantized Linear of the layer, all at once."""
    folder = config_dir(tmp_path, {**MOE, "torch_dtype": "float32"})
    # per layer: q, k, v, o (in 64) and 4 experts x (gate, up: in 64; down: in 32); the router is excluded
    hessians = 16 * (12 * (64 * 64 + 1) + 4 * (32 * 32 + 1))
    solve_q = 9 * 8 * 64 * 64 + 4 * 64 * 64  # the float64 solve of q_proj (in 64, out 64) and its float32 weight
    one = plan_calibration(folder, GPTQ_INT8, settings(1))
    assert one.ranks[0].parts["algorithm_state"] == hessians + solve_q  # merged in place (one rank), then solved
    two = plan_calibration(folder, GPTQ_INT8, settings(2))
    assert [r.parts["algorithm_state"] for r in two.ranks] == [2 * hessians] * 2  # the flat all-reduce buffer
    assert two.io["allreduce_bytes_per_layer"] == hessians  # weight-only: no observer statistics beside them
    # one batch through the sparse block: every expert observes all 32 tokens (32-wide) but attention is wider
    fwd = 4 * 32 * (max(3 * 64 + 3 * 32, 2 * 64 + 6 * 64) + 2 * 4)
    assert two.ranks[0].parts["layer_intermediates"] == fwd + 9 * 64 * 64 + 32 * 64 * 32


def test_float32_router_is_replicated(tmp_path):
    """A bf16 MoE checkpoint that stores its routers in float32: they stay whole on every rank (FSDP2 ignores them)."""
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    state = load_file(folder / "model.safetensors")
    for i in range(2):
        state[f"model.layers.{i}.mlp.gate.weight"] = state[f"model.layers.{i}.mlp.gate.weight"].float()
    save_file(state, str(folder / "model.safetensors"))
    plan = plan_calibration(folder, "w8a8-int8", settings(2))
    # bf16 elements besides the routers: embed, lm_head 2 x 16384; per layer q 4096, k 2048, v 2048, o 4096,
    # q/k norms 2 x 16, 2 norms x 64, experts 4 x 3 x 2048; final norm 64. Halved; routers 4 x 64 x 4 B whole.
    bf16 = 2 * 16384 + 2 * (4096 + 2048 + 2048 + 4096 + 32 + 128 + 4 * 6144) + 64
    assert plan.ranks[1].parts["param_shards"] == 2 * bf16 // 2 + 2 * 1024
    assert plan.ranks[1].bytes_read == 2 * bf16 // 2 + 2 * 1024
    assert plan.model["dtype"] == "bfloat16" and plan.model["source"] == "config.json + safetensors headers"


# ---------------------------------------------------------------------------------------------- against the code


def _load_and_report_read(model_dir: str) -> int:
    from shardcal.models import load_pretrained

    return load_pretrained(model_dir)._shardcal_distribution_plan["bytes_read"]


def test_bytes_read_are_what_the_sharded_load_reads(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama", vocab_size=255, num_key_value_heads=1)  # odd rows: uneven split
    read = run_on_ranks(2, _load_and_report_read, str(folder))
    assert [r.bytes_read for r in plan_calibration(folder, "w8a8-int8", settings(2)).ranks] == read


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_read_are_counted_in_the_files_dtype(tmp_path, dtype):
    """A bf16 checkpoint loaded as float32 (and as it is): each rank reads its rows in bf16, what a recording
    safetensors reader put below the loader (tests/loading/test_reads_own_rows.py) is asked for, whatever the dtype
    the rows are then held in."""
    from test_reads_own_rows import _recorded_load

    folder = make_tiny_checkpoint(tmp_path, "llama", dtype=torch.bfloat16, vocab_size=255, num_key_value_heads=1)
    requested = [
        sum(count for *_, count in r["log"]) for r in run_on_ranks(2, _recorded_load, str(folder), None, dtype)
    ]
    plan = plan_calibration(folder, "w8a8-int8", settings(2), dtype=dtype)
    assert plan.model["dtype"] == dtype
    assert [r.bytes_read for r in plan.ranks] == requested


@pytest.mark.usefixtures("single_process_group")
def test_checkpoint_dir_holds_what_a_weight_changing_run_commits(tmp_path):
    """GPTQ changes the weights, so each commit also stores every calibrated layer's weights: the planned
    ``--checkpoint-dir`` size is at least a commit beside the previous one, from the directory's real size after each
    commit (its files on disk, summed), and at most twice that."""
    from shardcal import calibrate
    from shardcal.models import from_pretrained
    from shardcal.runtime.faults import armed

    folder = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)
    directory = tmp_path / "ckpt"
    sizes: list[int] = []

    def measure(completed_layers: int) -> None:
        sizes.append(sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()))

    with armed("calibrate.committed", measure):
        calibrate(from_pretrained(folder), torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0)),
                  GPTQ_INT8, batch_size=2, progress=False, checkpoint_dir=directory)  # fmt: skip
    measure(3)  # the last commit (no fault point after it)
    assert len(sizes) == 3 and sizes[0] < sizes[1] < sizes[2]
    planned = plan_calibration(folder, GPTQ_INT8, settings(1)).disk["checkpoint_dir_bytes"]
    beside = max(a + b for a, b in itertools.pairwise(sizes))
    assert beside <= planned <= 2 * beside, (sizes, planned)


@pytest.mark.usefixtures("single_process_group")
def test_export_size_is_the_real_exports(tmp_path):
    from shardcal import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.models import from_pretrained

    folder = make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=300)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    for recipe in ("w8a8-int8", "fp8", "nvfp4", "w4a16"):  # w4a16: groups of 128 fall back to 64 (64-wide Linears)
        model = from_pretrained(folder)
        calibrate(model, ids, recipe, batch_size=2, progress=False)
        out = export_checkpoint(model, tmp_path / f"out-{recipe}", recipe=recipe)
        files = sorted(out.glob("*.safetensors"))
        plan = plan_calibration(folder, recipe, settings(1))
        assert plan.disk["export_files"] == len(files)
        assert plan.disk["export_bytes"] == sum(f.stat().st_size for f in files), recipe


@pytest.fixture(scope="module")
def tied_bf16_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tied"), "llama", torch.bfloat16, tie_word_embeddings=True)


def _export_variants(recipe: Recipe) -> list[tuple[str, Recipe]]:
    """``(load dtype, recipe)``: the recipe as shipped, loaded as stored (bf16) and as float32; without its
    weight-changing algorithm (round to nearest); with a residual rotation too (every weight changed, the tied head
    untied: the export stores it; float32, as the probe after a residual rotation refuses the bf16 weights' rounding)."""
    variants = [("bfloat16", recipe), ("float32", recipe)]
    if recipe.algorithm.get("name", "rtn") != "rtn":
        variants.append(("float32", replace(recipe, algorithm={"name": "rtn"}, name=f"{recipe.name}-rtn")))
    residual = (
        Rotation(None, residual="hadamard")
        if recipe.rotation is None
        else replace(recipe.rotation, residual="hadamard")
    )
    return [*variants, ("float32", replace(recipe, rotation=residual, name=f"{recipe.name}-residual"))]


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("name", shipped_recipes())
def test_planned_export_size_is_the_written_exports_for_every_shipped_recipe(tmp_path, tied_bf16_llama, name):
    """Every shipped recipe on a tiny tied bf16 Llama, each variant of :func:`_export_variants` calibrated and
    exported: the planned files and bytes are those on disk (online rotations' Hadamard matrices, KV-cache scales,
    the untied head included), with the unquantized tensors in the checkpoint's own dtype (bf16, ``--export-dtype
    auto``, whatever the load dtype) and, for a float32 load, in float32 too (``--export-dtype float32``)."""
    from shardcal import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.models import from_pretrained

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    shipped = load_recipe(name)
    if shipped.weight.granularity == "block":  # the tiny Llama's 64-wide inputs: blocks of 48 x 32 (partial rows)
        shipped = replace(
            shipped,
            weight=replace(shipped.weight, block_size=(48, 32)),
            input=replace(shipped.input, group_size=32),
        )
    for dtype, recipe in _export_variants(shipped):
        model = from_pretrained(tied_bf16_llama, dtype=dtype)
        calibrate(model, ids, recipe, batch_size=2, progress=False)
        for stored in sorted({"bfloat16", dtype}):
            out = export_checkpoint(model, tmp_path / f"{recipe.name}-{dtype}-{stored}", recipe=recipe, dtype=stored)
            files = sorted(out.glob("*.safetensors"))
            asked = "auto" if stored == "bfloat16" else stored
            plan = plan_calibration(tied_bf16_llama, recipe, replace(settings(1), export_dtype=asked), dtype=dtype)
            written = sum(f.stat().st_size for f in files)
            assert (plan.disk["export_files"], plan.disk["export_bytes"]) == (len(files), written), (
                recipe.name, dtype, stored
            )  # fmt: skip


def test_config_only_directory_plans_from_the_config(tmp_path):
    with_weights = make_tiny_checkpoint(tmp_path, "llama")
    only_config = config_dir(tmp_path, json.loads((with_weights / "config.json").read_text()), "only-config")
    a = plan_calibration(with_weights, "fp8", settings(2)).to_dict()
    b = plan_calibration(only_config, "fp8", settings(2)).to_dict()
    assert a["model"].pop("source") != b["model"].pop("source") == "config.json"
    a["model"].pop("dir"), b["model"].pop("dir")
    assert a == b


def test_recipe_that_does_not_fit_a_module_is_refused_before_loading(tmp_path):
    strict = tmp_path / "strict.toml"
    strict.write_text(
        'group_size_fallback = false\n[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 128\n'
    )
    folder = config_dir(tmp_path, LLAMA)
    with pytest.raises(RecipeError, match=r"does not fit module 'model.layers.0.self_attn.q_proj'.*group_size 128"):
        plan_calibration(folder, strict, settings(1))
    plan_calibration(folder, "w4a16", settings(1))  # fits: its groups fall back


# ---------------------------------------------------------------------------------------------- fit and fixes


def test_shortfall_and_the_cheapest_fix(tmp_path):
    folder = config_dir(tmp_path, LLAMA)
    source = planning.read_source(folder)
    recipe = planning.load_recipe("w8a8-int8")
    s = settings(2, device="cuda")
    plan = planning.plan_source(source, recipe, s)
    peak = plan.peak_bytes_per_rank
    assert planning.shortfall(plan, planning.Budget(peak, None)) is None
    short = planning.shortfall(plan, planning.Budget(peak - 1, None))
    assert short is not None and short.need == peak and short.available == peak - 1
    # shards to the host free the device: --cpu-offload is the cheapest fix that keeps the result
    assert planning.cheapest_fix(source, recipe, s, planning.Budget(peak - 1, None)) == "--cpu-offload"
    # on CPU the node's ranks share the host: two ranks need twice; fewer samples shrink only the cache
    cpu = planning.plan_source(source, recipe, settings(2))
    need = sum(r.required for r in cpu.ranks)
    assert planning.shortfall(cpu, planning.Budget(None, need)) is None
    assert planning.shortfall(cpu, planning.Budget(None, need - 1)).need == need
    assert planning.cheapest_fix(source, recipe, settings(2), planning.Budget(None, 1000)) is None
    message = planning.refusal_message(cpu, planning.shortfall(cpu, planning.Budget(None, 1000)), None)
    assert message.startswith("not enough memory: predicted ") and "per rank x 2 rank(s) on this node" in message
    assert "no option fits" in message and message.endswith("--force runs anyway") and "\n" not in message


@pytest.mark.parametrize(
    ("text", "value"), [("80GB", 80 * 10**9), ("80 GiB", 80 * 2**30), ("1.5MiB", 3 * 2**19), ("8e3", 8000)]
)
def test_parse_bytes(text, value):
    assert planning.parse_bytes(text) == value


def test_host_memory_readers(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert hostmem.available_bytes(tmp_path / "meminfo", cgroup) == 2048 * 1024  # no limit: MemAvailable
    (cgroup / "memory.max").write_text("1500000\n")
    (cgroup / "memory.current").write_text("1000000\n")
    assert hostmem.available_bytes(tmp_path / "meminfo", cgroup) == 500000  # the container's limit is tighter
    (cgroup / "memory.max").write_text("max\n")
    assert hostmem.available_bytes(tmp_path / "meminfo", cgroup) == 2048 * 1024
    assert hostmem.available_bytes(tmp_path / "missing", tmp_path / "none") is None
    rss, peak = hostmem.rss_bytes(), hostmem.peak_rss_bytes()
    assert rss is not None and peak >= rss > 0 and isinstance(hostmem.pin_mmap_threshold(), bool)


# ---------------------------------------------------------------------------------------------- the command


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_plan_json_schema(capsys, tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "mixtral")
    status, out, err = run_cli(capsys, "plan", folder, "--recipe", "fp8", "--nproc-per-node", "2", "--num-samples", 8,
                               "--seq-len", 16, "--batch-size", 2, "--json", "--host-memory", "1TB")  # fmt: skip
    assert status == 0 and err == "" and out.count("\n") == 1
    doc = json.loads(out)
    assert isinstance(doc["peak_bytes_per_rank"], int) and doc["peak_bytes_per_rank"] > 0
    assert (
        doc["peak_bytes_per_rank"]
        == max(r["peak_bytes"] for r in doc["ranks"])
        == doc["ranks"][doc["peak_rank"]]["peak_bytes"]
    )
    assert set(doc["parts"]) == set(PART_LABELS) and all(isinstance(v, int) for v in doc["parts"].values())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and set(doc["ranks"][0]["phases"]) == {
        "load",
        "embed",
        "layers",
        "export",
    }
    assert set(doc["io"]) >= {
        "allgather_bytes_per_layer",
        "allgather_sent_per_layer_per_rank",
        "allreduce_bytes_per_layer",
    }
    assert set(doc["disk"]) == {"export_bytes", "export_files", "checkpoint_dir_bytes"}
    assert doc["world_size"] == 2 and doc["data"] == {
        "num_samples": 8,
        "seq_len": 16,
        "batch_size": 2,
        "num_batches": 4,
    }
    assert doc["fits"] is True and doc["fix"] is None and doc["budget"]["host_bytes"] == 10**12
    assert all(isinstance(doc["ranks"][0]["bytes_read"], int) for _ in [0])


def test_plan_text_and_the_time_probe(capsys, tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "qwen2_moe")  # a dense layer 0 and a sparse layer 1: two probes
    status, out, _ = run_cli(capsys, "plan", folder, "--recipe", "w8a8-int8", "--world-size", "16", "--device", "cuda",
                             "--device-memory", "1MB", "--num-samples", 4, "--seq-len", 8, "--probe", "--json")  # fmt: skip
    # the probe needs a GPU when asked for cuda
    if not torch.cuda.is_available():
        assert status == 2
    status, out, err = run_cli(capsys, "plan", folder, "--recipe", "w8a8-int8", "--num-samples", 4, "--seq-len", 8,
                               "--batch-size", 2, "--probe", "--host-memory", "1KB")  # fmt: skip
    assert status == 0, err
    assert "PEAK" in out and "bytes read from disk" in out and "all-gather per layer" in out
    *_, refusal, streamed = out.strip().splitlines()
    assert "time: about" in out and refusal.startswith("does not fit: not enough memory")
    assert streamed.startswith("streamed (--stream on): peak ")
    assert streamed.endswith("B host memory (--host-memory))") and "; does not fit either (" in streamed
    doc = json.loads(run_cli(capsys, "plan", folder, "--recipe", "w8a8-int8", "--num-samples", 4, "--seq-len", 8,
                             "--batch-size", 2, "--probe", "--json")[1])  # fmt: skip
    t = doc["time"]
    assert t["batches_per_rank"] == 2 and t["calibrate_seconds"] > 0 and t["probe_threads"] >= 1
    assert t["calibrate_seconds"] == pytest.approx(2 * (t["fixed_seconds"] + 2 * t["batch_seconds"]))
    assert t["cpu_seconds_per_rank"] > 0 and "CPU-seconds per rank" in out


def test_plan_on_a_config_only_directory(capsys, tmp_path):
    folder = config_dir(tmp_path, {**TINY_CONFIGS["qwen3"]})
    status, out, err = run_cli(capsys, "plan", folder, "--recipe", "w8a8-int8")
    assert status == 0 and "from config.json)" in out, err


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = make_tiny_checkpoint(tmp_path, "llama", vocab_size=300)
    (folder / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 300, (4, 16)))
    return folder


def _calibrate_argv(folder: Path, *extra, recipe="w8a8-int8") -> list:
    ids = folder.parent / "ids.npy"
    return ["calibrate", folder, "--recipe", recipe, "--out", folder.parent / "out", "--data", ids,
            "--num-samples", 2, "--seq-len", 16, "--batch-size", 2, *extra]  # fmt: skip


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("missing-config", ConfigError),
        ("unknown-model-type", ConfigError),
        ("recipe-typo", RecipeError),
        ("exclude-typo", RecipeError),
    ],
)
def test_bad_input_is_the_same_error_as_calibrate(capsys, model_dir, case, error):
    recipe = "w8a8-int9" if case == "recipe-typo" else "w8a8-int8"
    if case == "exclude-typo":
        recipe = model_dir.parent / "typo.toml"
        recipe.write_text('[targets]\nexclude = ["model.layer.*.mlp.down_proj"]\n[weight]\nformat = "int8"\n')
    if case == "missing-config":
        (model_dir / "config.json").unlink()
    elif case == "unknown-model-type":
        raw = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    status, out, plan_err = run_cli(capsys, "plan", model_dir, "--recipe", recipe)
    assert status == 2 and out == "" and plan_err.count("\n") == 1 and plan_err.startswith("error: ")
    if case == "unknown-model-type":  # calibrate hands it to transformers' class (--model-impl auto)
        assert "config.json" in plan_err  # the one-line ConfigError of building transformers' class
        return
    status, _, calibrate_err = run_cli(capsys, *_calibrate_argv(model_dir, recipe=recipe))
    assert status == 2 and plan_err == calibrate_err
    expected = {"missing-config": "config.json: missing", "recipe-typo": "unknown recipe 'w8a8-int9'",
                "exclude-typo": "exclude pattern 'model.layer.*.mlp.down_proj' matches no Linear"}  # fmt: skip
    assert expected[case] in plan_err


@pytest.mark.usefixtures("single_process_group")
def test_calibrate_refuses_before_loading_and_force_proceeds(capsys, model_dir, monkeypatch):
    import shardcal.loading.sharded as sharded

    tiny = planning.Budget(None, 1000, host_what="MemAvailable")
    monkeypatch.setattr(planning, "local_budget", lambda device, device_index=None: tiny)
    loads = []
    real_load = sharded.load_pretrained
    monkeypatch.setattr(sharded, "load_pretrained", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    before = snapshot(model_dir.parent)
    status, out, err = run_cli(capsys, *_calibrate_argv(model_dir))
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: not enough memory: predicted ") and "but 1000 B host memory (MemAvailable)" in err
    assert "--force runs anyway" in err
    assert loads == [] and snapshot(model_dir.parent) == before  # nothing loaded, nothing written
    status, out, err = run_cli(capsys, *_calibrate_argv(model_dir, "--force"))
    assert status == 0 and "exported -> " in out and len(loads) == 1, err
    shutil.rmtree(model_dir.parent / "out")
    monkeypatch.setattr(planning, "local_budget", lambda device, device_index=None: replace(tiny, host=10**12))
    status, out, err = run_cli(capsys, *_calibrate_argv(model_dir))  # enough memory: no --force needed
    assert status == 0 and len(loads) == 2, err


@pytest.mark.usefixtures("single_process_group")
def test_calibrate_refuses_a_model_only_transformers_runs_before_loading(capsys, tmp_path, monkeypatch):
    """Phi-3 has no shardcal class: it is planned from transformers' class on the meta device, so ``calibrate``
    refuses it before loading when it does not fit, as it does shardcal's own models."""
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    hf_model("phi3").save_pretrained(tmp_path / "phi3")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, (2, 12)))
    capsys.readouterr()
    assert planning.plannable(tmp_path / "phi3")
    monkeypatch.setattr(planning, "local_budget", lambda device, device_index=None: planning.Budget(None, 1000))
    argv = ["calibrate", tmp_path / "phi3", "--recipe", "fp8", "--out", tmp_path / "out", "--data",
            tmp_path / "ids.npy", "--batch-size", 2]  # fmt: skip
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == "" and "error: not enough memory: predicted " in err, err
    status, out, err = run_cli(capsys, *argv, "--force")
    assert status == 0 and "exported -> " in out, err


def test_mmap_threshold_from_the_environment(monkeypatch):
    from shardcal.errors import UsageError

    called = []
    real = hostmem.ctypes.util.find_library
    monkeypatch.setattr(hostmem.ctypes.util, "find_library", lambda name: called.append(name) or real(name))
    monkeypatch.setenv("SHARDCAL_MMAP_THRESHOLD", "0")
    assert hostmem.pin_mmap_threshold() is False and called == []  # glibc's default left alone
    monkeypatch.setenv("SHARDCAL_MMAP_THRESHOLD", "lots")
    with pytest.raises(UsageError, match="SHARDCAL_MMAP_THRESHOLD='lots': expected a number of bytes"):
        hostmem.pin_mmap_threshold()
    monkeypatch.setenv("SHARDCAL_MMAP_THRESHOLD", str(hostmem.DEFAULT_MMAP_THRESHOLD))
    assert hostmem.pin_mmap_threshold() is (real("c") is not None) and called == ["c"]


def test_plan_command_plans_a_model_only_transformers_runs(capsys, tmp_path):
    """``shardcal plan`` on Phi-3 (no shardcal class) plans it from transformers' class, as calibrate does; the
    bytes each rank reads are the checkpoint's, counted here from the safetensors header."""
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    hf_model("phi3").save_pretrained(tmp_path / "phi3")
    status, out, err = run_cli(capsys, "plan", tmp_path / "phi3", "--recipe", "fp8", "--world-size", 2, "--json")
    assert status == 0, err
    plan = json.loads(out)
    header = json.loads(_header_bytes(tmp_path / "phi3" / "model.safetensors"))
    stored = sum(end - start for k, v in header.items() if k != "__metadata__" for start, end in [v["data_offsets"]])
    read = [r["bytes_read"] for r in plan["ranks"]]
    assert sum(read) >= stored and max(read) < stored  # every byte read at least once, no rank reads them all
    status, out, err = run_cli(capsys, "plan", tmp_path / "phi3", "--recipe", "fp8", "--model-impl", "shardcal")
    assert status == 2 and "model_type 'phi3' is not supported" in err, err


def _header_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + size]


def test_plan_names_the_predicted_growth_and_the_process_peak_it_makes(capsys, tmp_path, monkeypatch):
    """The PEAK row is a growth over the size after imports: the screen says so, in MiB, with the process peak it
    makes with this process's baseline (what ``calibrate`` reports as measured); ``--json`` adds the baseline."""
    folder = make_tiny_checkpoint(tmp_path, "llama")
    monkeypatch.setattr(hostmem, "rss_bytes", lambda: 300 << 20)
    argv = ("plan", folder, "--recipe", "w8a8-int8", "--num-samples", 4, "--seq-len", 8, "--host-memory", "1TB")
    status, out, err = run_cli(capsys, *argv)
    assert status == 0, err
    doc = json.loads(run_cli(capsys, *argv, "--json")[1])
    assert doc["baseline_bytes"] == 300 << 20 and "peak_bytes_per_rank" in doc  # added, none renamed
    growth = doc["peak_bytes_per_rank"] / 2**20
    line = f"predicted growth per rank {growth:.1f} MiB (host memory over the process's size after imports); "
    line += f"process peak ≈ {growth:.1f} + baseline 300.0 = {growth + 300:.1f} MiB"
    assert line in out.splitlines()


def _load_untied_and_report_read(model_dir: str) -> int:
    from shardcal.models import load_pretrained

    return load_pretrained(model_dir, untie_word_embeddings=True)._shardcal_distribution_plan["bytes_read"]


@pytest.mark.usefixtures("single_process_group")
def test_a_residual_rotation_plans_the_untied_head_it_loads_and_exports(tmp_path):
    """A tied checkpoint under ``[rotation] residual``: loaded with a head of its own (read from the embeddings
    again), which the plan counts — parameters, bytes read, and the export, which stores the head."""
    from shardcal import calibrate
    from shardcal.calib.recipes import parse_recipe
    from shardcal.export import export_checkpoint
    from shardcal.models import from_pretrained

    folder = make_tiny_checkpoint(tmp_path, "llama", vocab_size=255, tie_word_embeddings=True)
    text = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
    plain, rotated = (parse_recipe(text + extra, "t.toml", default_name="t")
                      for extra in ("", '[rotation]\nresidual = "hadamard"\n'))  # fmt: skip
    head = 255 * TINY_CONFIGS["llama"]["hidden_size"]
    tied, untied = (plan_calibration(folder, r, settings(2)) for r in (plain, rotated))
    assert untied.model["parameters"] == tied.model["parameters"] + head
    assert "rotate" not in tied.ranks[0].phases
    rotate = untied.ranks[0].phases["rotate"]  # the probe's forward: root and head gathered together
    assert rotate >= untied.ranks[0].phases["embed"]
    read = run_on_ranks(2, _load_untied_and_report_read, str(folder))
    assert [r.bytes_read for r in untied.ranks] == read
    model = from_pretrained(folder)
    calibrate(model, torch.randint(0, 255, (4, 16)), rotated, batch_size=2, progress=False)
    files = sorted(export_checkpoint(model, tmp_path / "out", recipe=rotated).glob("*.safetensors"))
    plan = plan_calibration(folder, rotated, settings(1))
    assert plan.disk["export_bytes"] == sum(f.stat().st_size for f in files)
