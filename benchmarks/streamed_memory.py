"""A model larger than this machine's memory, calibrated and exported with the plain command: streamed.

    python benchmarks/streamed_memory.py [--layers 60] [--work runs/streamed] [--keep] [--nproc 2]
                                         [--num-samples 4] [--seq-len 64] [--no-save] [--results-dir DIR]

Builds a checkpoint with Llama-3-8B's widths (hidden 4096, MLP 14336, 32 query / 8 KV heads, vocabulary 128256) and
``--layers`` decoder layers, random bf16 weights, written file by file (never whole in memory), then runs
``shardcal calibrate MODEL --recipe fp8 --nproc-per-node 2 --data ids.npy --batch-size B`` (B: every rank gets a
batch) — the plain command, which streams by
itself when the resident run does not fit (the command's warning says whether it did). Measured in the same run:

- each rank's peak resident memory (the kernel's ``VmHWM``, as the command prints it) and its growth over the
  baseline against the planner's prediction;
- the command's wall time against reading the checkpoint once (plain reads of every file, in this process) plus
  one plain forward over the same tokens (one decoder layer of these widths timed on the tokens, times the number
  of layers, plus the embedding and the LM head); then the same command with ``--sqnr-tokens 0`` (no per-layer
  SQNR, which on so few tokens is a second, quantized forward of every layer), against the same;
- the export read back with ``safetensors`` (not shardcal's reader): every unquantized tensor equal to the
  source's bytes, and the first and last layers' FP8 weights times their scales within FP8's rounding of the
  source weights.

Writes ``docs/results/streamed_memory.json``. Needs about 1.6 x the model's size free on disk (``--work``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _results import ORDER, RATIO_COLUMNS, add_save_options, machine, ratio_row, save_table  # this folder

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}  # fmt: skip
LAYERS_PER_FILE = 4


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    h, m, q, kv = 4096, 14336, 4096, 1024
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.mlp.gate_proj.weight": (m, h), f"{p}.mlp.up_proj.weight": (m, h), f"{p}.mlp.down_proj.weight": (h, m),
    }  # fmt: skip


def build_checkpoint(folder: Path, layers: int) -> int:
    """Write the checkpoint file by file (each holds a few layers); returns its bytes."""
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
        if group is None:
            shapes = {"model.embed_tokens.weight": (128256, 4096), "lm_head.weight": (128256, 4096),
                      "model.norm.weight": (4096,)}  # fmt: skip
        else:
            shapes = {k: v for i in group for k, v in layer_shapes(i).items()}
        tensors = {}
        for key, shape in shapes.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            if len(shape) == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[key] = t
            weight_map[key] = name
            total += t.numel() * 2
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def read_once(folder: Path) -> float:
    """Seconds to read every safetensors file once from the disk, with plain reads into one reused buffer: written
    pages are flushed and every file's pages dropped first (a checkpoint the benchmark has just written would
    otherwise be read from the page cache, which the streamed run, after this, is not)."""
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    os.sync()
    for path in sorted(folder.glob("*.safetensors")):
        _drop_pages(path)
    start = time.perf_counter()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
        _drop_pages(path)
    return time.perf_counter() - start


def _drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_forward(layers: int, num_samples: int, seq_len: int, threads: int) -> float:
    """Seconds of one plain forward over the tokens in bf16 (the checkpoint's dtype, which shardcal computes in):
    models of these widths with 1 and 2 decoder layers timed on them (best of 3 each); the difference is one layer,
    the rest the embedding and the LM head."""
    import torch

    from shardcal.models import CausalLM, ModelConfig

    torch.set_num_threads(threads)
    ids = torch.randint(0, 128256, (num_samples, seq_len), generator=torch.Generator().manual_seed(1))
    seconds = {}
    for n in (1, 2):
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_dict({**CONFIG, "num_hidden_layers": n}))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
            model(ids[:1, :8])  # warm-up
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                model(ids)
                best = min(best, time.perf_counter() - start)
        seconds[n] = best
        del model
    per_layer = max(seconds[2] - seconds[1], 0.0)
    return seconds[1] + (layers - 1) * per_layer


def run_command(
    model: Path, data: Path, out: Path, nproc: int, num_samples: int, seq_len: int, *extra: str, recipe: str = "fp8"
) -> dict:
    cmd = [sys.executable, "-m", "shardcal", "calibrate", str(model), "--recipe", recipe, "--out", str(out),
           "--overwrite", "--data", str(data), "--num-samples", str(num_samples), "--seq-len", str(seq_len),
           "--nproc-per-node", str(nproc), "--batch-size", str(max(1, num_samples // nproc)), *extra]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    found = re.search(r"growth ([\d, ]+) MiB \(planned ([\d, ]+) MiB\), process peak ([\d, ]+) MiB", text)
    numbers = [[float(x) for x in g.split(",")] for g in found.groups()] if found else [[], [], []]
    return {"seconds": seconds, "growth": numbers[0], "planned": numbers[1], "peak": numbers[2],
            "streamed": "streaming its decoder layers from disk" in text, "output": text}  # fmt: skip


def check_export(model: Path, out: Path, layers: int) -> tuple[int, int]:
    """(tensors compared, mismatches): the export read back with safetensors against the source."""
    import torch
    from safetensors import safe_open

    def tensor(folder: Path, key: str) -> torch.Tensor:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(folder / index[key]), "pt") as f:
            return f.get_tensor(key)

    compared, bad = 0, 0
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                f"model.layers.{layers - 1}.input_layernorm.weight"):  # fmt: skip
        compared += 1
        bad += not torch.equal(tensor(model, key).view(torch.int16), tensor(out, key).view(torch.int16))
    for i in (0, layers - 1):
        for proj in ("self_attn.q_proj", "mlp.down_proj"):
            key = f"model.layers.{i}.{proj}"
            source = tensor(model, f"{key}.weight").float()
            stored = tensor(out, f"{key}.weight").float() * tensor(out, f"{key}.weight_scale").float()
            # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of it, or of the smallest normal
            limit = 2.0**-4 * source.abs() + tensor(out, f"{key}.weight_scale").float() * 2.0**-9
            compared += 1
            bad += not bool(((stored - source).abs() <= limit).all())
    return compared, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "streamed")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and export (else removed)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
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
    np.save(data, np.random.default_rng(0).integers(0, 128256, size=(args.num_samples, args.seq_len)))
    read_s = read_once(model)
    forward_s = plain_forward(args.layers, args.num_samples, args.seq_len, threads=os.cpu_count() or 1)
    print(f"read once {read_s:.0f} s, plain forward {forward_s:.0f} s")
    run = run_command(model, data, out, args.nproc, args.num_samples, args.seq_len)
    print(run["output"][-1500:])
    compared, bad = check_export(model, out, args.layers)
    shutil.rmtree(out)  # disk: the next export is written beside the model, not beside this one too
    # the same run without the per-layer SQNR, which on this little data runs every layer a second time, quantized
    no_sqnr = run_command(model, data, out, args.nproc, args.num_samples, args.seq_len, "--sqnr-tokens", "0")
    print(no_sqnr["output"][-600:])
    peak, growth, planned = max(run["peak"]), max(run["growth"]), max(run["planned"])
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    rows = [
        ratio_row("checkpoint size", size / 2**30, "GiB", "this machine's memory", memory, "> 1"),
        ratio_row("peak resident memory per rank (VmHWM)", peak / 1024, "GiB", "4 GiB", 4.0, "<= 1"),
        ratio_row("peak growth per rank", growth, "MiB", "planned", planned, "0.80 - 1.25", digits=0),
        ratio_row(
            "calibrate + export, wall time",
            run["seconds"],
            "s",
            "read once + one plain forward",
            read_s + forward_s,
            "<= 1.3",
            digits=0,
        ),
        ratio_row(
            "the same with --sqnr-tokens 0",
            no_sqnr["seconds"],
            "s",
            "read once + one plain forward",
            read_s + forward_s,
            "<= 1.3",
            digits=0,
        ),
        [
            "export read back (safetensors)",
            f"{compared - bad} of {compared} tensors as the source",
            None,
            None,
            None,
            None,
            "all",
        ],
    ]
    tokens = args.num_samples * args.seq_len
    table = {
        "title": f"A {size / 2**30:.1f} GiB model on this machine: streamed, fp8, {args.nproc} ranks",
        "columns": RATIO_COLUMNS, "rows": rows,
        "notes": [
            f"Llama-3-8B widths, {args.layers} layers, random bf16 weights; {args.num_samples} x {args.seq_len} "
            f"random tokens; the command streamed by itself: {run['streamed']}.",
            "Plain forward: models of these widths with 1 and 2 layers timed on the tokens in bf16 (all cores); "
            "their difference times the layers, plus the rest. Read once: every file read with plain reads, its "
            "pages dropped after.",
            f"The plain command measures each layer's SQNR on the data's first 1024 tokens: here all {tokens}, so "
            "every layer runs a second time, quantized, after its weights are fake-quantized. "
            "--sqnr-tokens 0 leaves that out: what streaming itself costs beside one forward (every rank reading each "
            "layer, encoding and writing its share of it).",
            f"Machine: {machine()}.",
        ],
    }  # fmt: skip
    for row in rows:
        print(row)
    save_table(args, "streamed_memory", order=ORDER["memory"] + 5, **table)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
