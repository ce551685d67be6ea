"""A DeepSeek-V3-shaped checkpoint as published (FP8, 128 x 128 block scales), larger than this machine's memory,
calibrated with the plain command through transformers' class: streamed.

    python benchmarks/streamed_deepseek.py [--layers 136] [--work runs/streamed-deepseek] [--keep] [--nproc 2]
                                           [--num-samples 4] [--seq-len 64] [--stream auto|on] [--resident]
                                           [--no-save] [--results-dir DIR]

Builds a checkpoint with DeepSeek-V3's structure at smaller widths (MLA with q / kv LoRA ranks, one dense layer, then
MoE layers of 1 shared and 56 routed experts, 8 per token, grouped routing with a correction bias) and ``--layers``
decoder layers, published as DeepSeek publishes V3: every decoder Linear in ``float8_e4m3fn`` with a
``weight_scale_inv`` per 128 x 128 block (``quantization_config.quant_method = "fp8"``, ``weight_block_size``), the
embeddings, norms and router in bf16, the correction bias in float32, per-expert keys. Written file by file (never
whole in memory). Then runs ``shardcal calibrate MODEL --recipe int4-max.toml --nproc-per-node 2 --data ids.npy``
(INT4 weights in groups of 128, round to nearest: a recipe file the benchmark writes; ``--recipe fp8`` for FP8) — the
plain
command, which loads it with transformers' DeepseekV3 class (shardcal has none of its own), dequantizes each layer as
it reads it, and streams by itself when the resident run does not fit. Measured in the same run:

- each rank's peak resident memory (``VmHWM``) and its growth over the baseline against the planner's prediction;
- the command's wall time (and again with ``--sqnr-tokens 0``) against reading the checkpoint once (plain reads of
  every file) plus one plain forward of transformers' model over the same tokens in float32, the dtype its class
  computes in (models of these widths with 2 and 3 layers timed; their difference times the MoE layers, plus the
  rest);
- with ``--resident`` (a checkpoint that fits), the wall time against the same command with ``--stream off``:
  the same quantization work, so the ratio is what streaming itself adds;
- the export read back with ``safetensors`` against the source dequantized here, block by block from the published
  formula (``w = q * scale_inv[i // 128, j // 128]``): the norms and embeddings equal, and weights of the first, second
  and last layers (attention, an expert) the dequantized source quantized at the export's own scales (INT4 codes
  unpacked here; FP8 within e4m3's rounding).

Writes ``docs/results/streamed_deepseek.json``. Needs about 1.6 x the model's size free on disk with INT4 (``--work``;
2 x with fp8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from _results import ORDER, RATIO_COLUMNS, add_save_options, machine, ratio_row, save_table  # this folder
from streamed_memory import read_once, run_command  # this folder

ROOT = Path(__file__).resolve().parent.parent
H, VOCAB, EXPERTS, MOE_I, DENSE_I = 2048, 32000, 56, 512, 5632
HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 16, 512, 256, 64, 32, 64
BLOCK = 128
CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": H, "vocab_size": VOCAB,
    "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "n_routed_experts": EXPERTS,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "q_lora_rank": Q_RANK, "kv_lora_rank": KV_RANK, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
    "v_head_dim": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [BLOCK, BLOCK]},
}  # fmt: skip
LAYERS_PER_FILE = 4
#: ``--recipe int4-max``: INT4 weights in groups of 128 with max observers (round to nearest), written by the benchmark
#: as a recipe file: the shipped INT4 recipes search each group's clipping (mse) or run GPTQ, too slow for a model of this
#: size on a machine of a few cores.
INT4_MAX = (
    'name = "int4-max"\ndescription = "int4 weights in groups of 128, max observer"\n'
    '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 128\nobserver = "max"\n'
)


def layer_shapes(i: int) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[tuple[int, ...], str]]]:
    """Decoder layer ``i``: its Linears (published in FP8 blocks) and its other tensors (shape, dtype)."""
    p = f"model.layers.{i}"
    linears = {
        f"{p}.self_attn.q_a_proj.weight": (Q_RANK, H), f"{p}.self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_RANK),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": (KV_RANK + ROPE, H),
        f"{p}.self_attn.kv_b_proj.weight": (HEADS * (NOPE + V), KV_RANK), f"{p}.self_attn.o_proj.weight": (H, HEADS * V),
    }  # fmt: skip
    other = {f"{p}.input_layernorm.weight": ((H,), "bf16"), f"{p}.post_attention_layernorm.weight": ((H,), "bf16"),
             f"{p}.self_attn.q_a_layernorm.weight": ((Q_RANK,), "bf16"),
             f"{p}.self_attn.kv_a_layernorm.weight": ((KV_RANK,), "bf16")}  # fmt: skip
    mlps = [(f"{p}.mlp", DENSE_I)] if i == 0 else [(f"{p}.mlp.shared_experts", MOE_I)]
    if i > 0:
        mlps += [(f"{p}.mlp.experts.{e}", MOE_I) for e in range(EXPERTS)]
        other[f"{p}.mlp.gate.weight"] = ((EXPERTS, H), "bf16")
        other[f"{p}.mlp.gate.e_score_correction_bias"] = ((EXPERTS,), "f32")
    for prefix, width in mlps:
        linears |= {f"{prefix}.gate_proj.weight": (width, H), f"{prefix}.up_proj.weight": (width, H),
                    f"{prefix}.down_proj.weight": (H, width)}  # fmt: skip
    return linears, other


def _fp8_codes(shape: tuple[int, int], gen) -> object:
    """Random e4m3 codes of magnitude below 2 (no NaN code), either sign."""
    import torch

    codes = torch.randint(0, 0x40, shape, dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
    return codes.view(torch.float8_e4m3fn)


def build_checkpoint(folder: Path, layers: int) -> int:
    """Write the checkpoint file by file (each holds a few layers); returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}, indent=1))
    groups = [list(range(i, min(i + LAYERS_PER_FILE, layers))) for i in range(0, layers, LAYERS_PER_FILE)]
    files = len(groups) + 1
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for n, group in enumerate([None, *groups]):
        name = f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        tensors = {}
        if group is None:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                tensors[key] = torch.empty(VOCAB, H, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
            tensors["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        for i in group or []:
            linears, other = layer_shapes(i)
            for key, shape in linears.items():
                tensors[key] = _fp8_codes(shape, gen)
                scales = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
                tensors[f"{key}_scale_inv"] = torch.empty(scales).uniform_(0.004, 0.012, generator=gen)
            for key, (shape, dtype) in other.items():
                if key.endswith("gate.weight"):
                    tensors[key] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.05, generator=gen)
                elif dtype == "f32":
                    tensors[key] = torch.empty(shape).uniform_(-0.1, 0.1, generator=gen)
                else:
                    tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def plain_forward(layers: int, num_samples: int, seq_len: int, threads: int) -> float:
    """Seconds of one plain forward of transformers' DeepseekV3 class over the tokens in float32 (as it calibrates):
    models of these widths with 2 and 3 layers timed (best of 3); their difference is one MoE layer."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    ids = torch.randint(0, VOCAB, (num_samples, seq_len), generator=torch.Generator().manual_seed(1))
    body = {k: v for k, v in CONFIG.items() if k not in ("quantization_config", "architectures", "model_type")}
    seconds = {}
    for n in (2, 3):
        config = transformers.DeepseekV3Config(**{**body, "num_hidden_layers": n})
        model = transformers.DeepseekV3ForCausalLM(config).float().eval()
        with torch.no_grad():
            model(ids[:1, :8])  # warm-up
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                model(ids)
                best = min(best, time.perf_counter() - start)
        seconds[n] = best
        del model
    return seconds[2] + (layers - 2) * max(seconds[3] - seconds[2], 0.0)


def dequantized(folder: Path, key: str) -> object:
    """``key`` of the published checkpoint as the weight it stands for, computed here from the published formula."""
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index[key]), "pt") as f:
        q = f.get_tensor(key).float()
        scale = f.get_tensor(f"{key}_scale_inv").float()
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q * full


def _int4_codes(packed: object, columns: int) -> object:
    """compressed-tensors' pack-quantized INT4: eight values a 32-bit word, value ``8k + j`` in bits ``4j .. 4j+3``
    of word ``k``, each stored plus 8."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return nibbles.flatten(-2)[..., :columns] - 8


def _stored_weight_ok(source: object, tensors: dict) -> bool:
    """Whether the export's weight is the dequantized source quantized at the export's own scales: FP8 within e4m3's
    rounding; INT4 codes the source over its group's scale, rounded and clamped to [-8, 7] (one code off where the
    scale's own rounding moves a value across a boundary, in at most 1 % of them)."""
    import torch

    if "weight_packed" in tensors:
        rows, columns = source.shape
        scale = tensors["weight_scale"].float()
        group = columns // scale.shape[1]
        codes = _int4_codes(tensors["weight_packed"], columns)
        want = torch.clamp(torch.round(source / scale.repeat_interleave(group, 1)), -8, 7)
        off = (codes - want).abs()
        return bool(off.max() <= 1) and float((off > 0).float().mean()) <= 0.01
    scale = tensors["weight_scale"].float()
    stored = tensors["weight"].float() * scale
    # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of it, or of the smallest normal
    limit = 2.0**-4 * source.abs() + scale * 2.0**-9
    return bool(((stored - source).abs() <= limit).all())


def check_export(model: Path, out: Path, layers: int) -> tuple[int, int]:
    """(tensors compared, mismatches): the export read back with safetensors against the source."""
    import torch
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(folder: Path, key: str) -> torch.Tensor:
        where = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(folder / where[key]), "pt") as f:
            return f.get_tensor(key)

    compared, bad = 0, 0
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                f"model.layers.{layers - 1}.input_layernorm.weight"):  # fmt: skip
        compared += 1
        bad += not torch.equal(tensor(model, key).float(), tensor(out, key).float())
    for i in (0, 1, layers - 1):
        projs = ("self_attn.q_b_proj", "mlp.down_proj") if i == 0 else ("self_attn.kv_b_proj", "mlp.experts.7.up_proj")
        for proj in projs:
            key = f"model.layers.{i}.{proj}"
            stored = {k[len(key) + 1 :]: tensor(out, k) for k in index if k.startswith(f"{key}.")}
            compared += 1
            bad += not _stored_weight_ok(dequantized(model, f"{key}.weight"), stored)
    return compared, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=136)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "streamed-deepseek")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and export (else removed)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--recipe", default="int4-max",
        help="int4-max (default: INT4 weights in groups of 128, round to nearest, as a recipe file), or a shipped "
        "recipe (fp8 needs twice the model's size on disk)",
    )  # fmt: skip
    parser.add_argument(
        "--stream", choices=["auto", "on"], default="auto",
        help="on: stream a checkpoint that fits too (a smaller --layers: the same measurements, not larger than memory)",
    )  # fmt: skip
    parser.add_argument(
        "--skip-no-sqnr", action="store_true", help="leave out the second run (--sqnr-tokens 0): half the time"
    )
    parser.add_argument(
        "--resident", action="store_true",
        help="also run the same command with --stream off (a checkpoint that fits: with --stream on), to time "
        "streaming's own cost against the same quantization work done resident",
    )  # fmt: skip
    add_save_options(parser)
    args = parser.parse_args(argv)
    import numpy as np

    model, out = args.work / "model", args.work / "out"
    t0 = time.perf_counter()
    if not (model / "model.safetensors.index.json").is_file():
        build_checkpoint(model, args.layers)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"checkpoint: {size / 2**30:.1f} GiB, {args.layers} layers ({time.perf_counter() - t0:.0f} s to build)")
    data = args.work / "ids.npy"
    np.save(data, np.random.default_rng(0).integers(0, VOCAB, size=(args.num_samples, args.seq_len)))
    recipe = args.recipe
    if recipe == "int4-max":
        recipe = str(args.work / "int4-max.toml")
        Path(recipe).write_text(INT4_MAX)
    read_s = read_once(model)
    forward_s = plain_forward(args.layers, args.num_samples, args.seq_len, threads=os.cpu_count() or 1)
    print(f"read once {read_s:.0f} s, plain forward {forward_s:.0f} s", flush=True)
    run = run_command(
        model, data, out, args.nproc, args.num_samples, args.seq_len, "--stream", args.stream, recipe=recipe
    )
    print(run["output"].split("calibrate:")[0][-1500:], flush=True)  # the summary, before the progress bar
    compared, bad = check_export(model, out, args.layers)
    shutil.rmtree(out)  # disk: the next export is written beside the model, not beside this one too
    no_sqnr = {"seconds": None}
    if not args.skip_no_sqnr:
        no_sqnr = run_command(
            model, data, out, args.nproc, args.num_samples, args.seq_len, "--sqnr-tokens", "0", "--stream",
            args.stream, recipe=recipe,
        )  # fmt: skip
        print(no_sqnr["output"][-600:], flush=True)
    shutil.rmtree(out, ignore_errors=True)
    resident = {"seconds": None}
    if args.resident:
        resident = run_command(
            model, data, out, args.nproc, args.num_samples, args.seq_len, "--stream", "off", recipe=recipe
        )
        print(resident["output"].split("calibrate:")[0][-600:], flush=True)
        shutil.rmtree(out, ignore_errors=True)
    peak, growth, planned = max(run["peak"]), max(run["growth"]), max(run["planned"])
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    rows = [
        ratio_row("checkpoint size (FP8 blocks, as published)", size / 2**30, "GiB", "this machine's memory", memory,
                  "> 1"),
        ratio_row("peak resident memory per rank (VmHWM)", peak / 1024, "GiB", "4 GiB", 4.0, "<= 1"),
        ratio_row("peak growth per rank", growth, "MiB", "planned", planned, "0.80 - 1.25", digits=0),
        ratio_row("calibrate + export, wall time", run["seconds"], "s", "read once + one plain forward",
                  read_s + forward_s, "<= 1.3", digits=0),
    ]  # fmt: skip
    if no_sqnr["seconds"] is not None:  # a row per run made: none for a run left out
        rows.append(ratio_row("the same with --sqnr-tokens 0", no_sqnr["seconds"], "s", "read once + one plain forward",
                              read_s + forward_s, "<= 1.3", digits=0))  # fmt: skip
    if resident["seconds"] is not None:
        rows.append(ratio_row("calibrate + export streamed, wall time", run["seconds"], "s",
                              "the same command resident (--stream off)", resident["seconds"], "<= 1.3", digits=0))  # fmt: skip
    rows.append(["export read back (safetensors)", f"{compared - bad} of {compared} tensors as the dequantized source",
                 None, None, None, None, "all"])  # fmt: skip
    tokens = args.num_samples * args.seq_len
    table = {
        "title": f"A {size / 2**30:.1f} GiB DeepSeek-V3-shaped FP8 checkpoint on this machine: transformers' class, "
                 f"streamed, {args.recipe}, {args.nproc} ranks",
        "columns": RATIO_COLUMNS, "rows": rows,
        "notes": [
            f"DeepSeek-V3's structure at hidden {H}: MLA (q rank {Q_RANK}, kv rank {KV_RANK}, {HEADS} heads), one "
            f"dense layer then MoE layers of 1 shared + {EXPERTS} routed experts of width {MOE_I} (8 a token, "
            f"grouped routing); {args.layers} layers; decoder Linears in FP8 with 128 x 128 block scales as "
            f"DeepSeek publishes them, random codes; {args.num_samples} x {args.seq_len} random tokens; --stream "
            f"{args.stream}; the command streamed: {' streamed from disk' in run['output']}.",
            "Plain forward: transformers' DeepseekV3ForCausalLM of these widths with 2 and 3 layers timed on the "
            "tokens in float32 (all cores); their difference times the MoE layers, plus the rest. Read once: every "
            "file read with plain reads, its pages dropped after.",
            f"The plain command measures each layer's SQNR on the data's first 1024 tokens: here all {tokens}, so "
            "every layer runs a second time, quantized. --sqnr-tokens 0 leaves that out: what streaming itself "
            "costs beside one forward (every rank reading and dequantizing each layer, encoding and writing its "
            "share of it).",
            f"Machine: {machine()}.",
        ],
    }  # fmt: skip
    if resident["seconds"] is not None:
        table["notes"].insert(-1, "Resident: the same command with --stream off (only where the checkpoint fits: "
                              "--resident), which does the same quantization work with every layer in memory; the "
                              "ratio is what streaming itself adds.")  # fmt: skip
    for row in rows:
        print(row)
    larger = size / 2**30 > memory  # the run the issue asks for; a smaller forced one is kept beside it
    save_table(args, "streamed_deepseek" if larger else "streamed_deepseek_small", order=ORDER["memory"] + 6 + (not larger),
               **table)  # fmt: skip
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
