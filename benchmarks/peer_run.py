"""One peer PTQ tool (llm-compressor, NVIDIA modelopt or auto-round) on one scheme, on CPU: calibration time and
perplexity.

    .venv-peers/bin/python benchmarks/peer_run.py --tool llmcompressor --scheme fp8 --model-dir DIR \\
        --calib calib.safetensors --eval eval.safetensors --out result.json [--variant NAME]

Runs in the peers' own venv (``make bench-peers`` creates ``.venv-peers``); it never imports shardcal.
``benchmarks/vs_peers.py`` writes the inputs (an HF-format SmolLM2 directory, ``input_ids`` int64 [N, L] token
files) and calls this script once per tool and scheme. Each scheme uses the tool's documented recipe for it
(:data:`RECIPES` says which; ``None`` where the tool documents none), or with ``--variant`` one of
:data:`VARIANTS`, changed to match shardcal's recipe more closely (e.g. the same SmoothQuant alpha):

* calibration: the tool's own entry point on the calibration blocks in batches of 8 (llm-compressor: ``oneshot``
  with a ``datasets.Dataset``, or its ``datafree`` pipeline where the recipe needs no data, as its QuIP and SpinQuant
  examples do; modelopt: ``mtq.quantize`` with a forward loop; auto-round: ``AutoRound(...)`` and its ``quantize()``
  on the blocks as a list of batches); ``calib_seconds`` times that call;
* perplexity: ``exp(mean cross-entropy)`` of every next-token prediction of the evaluation blocks, the tool's
  fake-quantized model in memory, float32 — the definition ``shardcal.data.perplexity.perplexity`` uses.

llm-compressor 0.14's AWQ pins every cached activation (``IntermediatesCache`` -> ``tensor.pin_memory()``), which
raises "Cannot access accelerator device when none is available" on a CPU-only host; ``--cpu-pin-patch`` (which
``vs_peers.py`` passes for that run, and the result records) makes the pinning a no-op when no accelerator exists.
Pinning only speeds host-to-device copies, so the numbers are what the tool computes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

BATCH = 8
EVAL_BATCH = 8  # a 262k vocabulary (Gemma 3) wants fewer: the logits of 8 x 256 tokens are 2 GB
GROUP = 64
TOOLS = ("llmcompressor", "modelopt", "auto-round")
PACKAGES = {"llmcompressor": "llmcompressor", "modelopt": "nvidia-modelopt", "auto-round": "auto-round"}
#: AutoRound's tuning steps per decoder layer (llm-compressor's AutoRoundModifier and the auto-round package both
#: default to 200); fewer keep a CPU run affordable, it being the slowest of the comparison (``--autoround-iters``
#: changes it).
AUTOROUND_ITERS = 50
#: scheme -> tool -> the documented recipe used (None, or no entry: the tool documents none for this scheme).
RECIPES: dict[str, dict[str, str | None]] = {
    "fp8": {
        "llmcompressor": 'QuantizationModifier(scheme="FP8"): fp8 per-tensor weights and static per-tensor inputs',
        "modelopt": "mtq.FP8_DEFAULT_CFG: fp8 per-tensor weights and inputs, max calibration",
    },
    "fp8-dynamic": {
        "llmcompressor": 'QuantizationModifier(scheme="FP8_DYNAMIC") (their fp8 example): per-channel weights, '
        "dynamic per-token inputs",
        "modelopt": "mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG: per-channel weights, dynamic per-token inputs",
    },
    "fp8-dynamic-kv": {
        "llmcompressor": 'QuantizationModifier(scheme="FP8_DYNAMIC", kv_cache_scheme=fp8 per tensor)',
        "modelopt": "mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG + FP8_KV_CFG's k/v bmm quantizers",
    },
    "w8a8-int8-sq": {
        "llmcompressor": None,  # its documented W8A8 recipe is dynamic per token (the next scheme)
        "modelopt": "mtq.INT8_SMOOTHQUANT_CFG (SmoothQuant, default alpha 1.0): int8 per-channel weights, "
        "int8 static per-tensor inputs",
    },
    "w8a8-int8-dynamic-sq": {
        "llmcompressor": "SmoothQuantModifier(smoothing_strength=0.8) + GPTQModifier(scheme='W8A8') (their int8 "
        "example): int8 per-channel weights (GPTQ), int8 dynamic per-token inputs",
        "modelopt": None,  # no per-token int8 activation config
    },
    "w4a16-gptq": {
        "llmcompressor": "GPTQModifier, W4A16 preset with group_size G (int4 symmetric; defaults: block 128, "
        "dampening 0.01, actorder static, minmax scales)",
        "modelopt": "mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, block G, algorithm gptq (layerwise; no act-order, max scales)",
    },
    "w4a16-awq": {
        "llmcompressor": "AWQModifier(duo_scaling='both') + W4A16_ASYM group G (their AWQ example; asymmetric int4)",
        "modelopt": "mtq.INT4_AWQ_CFG, block G (awq_lite; int4 symmetric)",
    },
    "nvfp4": {
        "llmcompressor": 'QuantizationModifier(scheme="NVFP4"): fp4 e2m1 weights and inputs, 16-wide fp8 block scales',
        "modelopt": "mtq.NVFP4_DEFAULT_CFG: fp4 e2m1 weights and inputs, 16-wide fp8 block scales, max calibration",
    },
    # rotations and learned rounding (SmolLM2 only: vs_peers' w4a16-*-g64 schemes beside shardcal's w4a16-gptq)
    "w4a16-quip": {
        "llmcompressor": "QuIPModifier(rotations=['v', 'u'], transform_block_size=128, transform_type='hadamard') + "
        "QuantizationModifier W4A16 preset at group G (their QuIP example; datafree pipeline; round to nearest)",
    },
    "w4a16-spinquant": {
        "llmcompressor": "SpinQuantModifier(rotations=['R1', 'R2', 'R4'], transform_block_size=64, "
        "transform_type='hadamard') + QuantizationModifier W4A16 preset at group G (their SpinQuant example; "
        "datafree pipeline; round to nearest)",
    },
    "w8a8-int8-spinquant": {
        "llmcompressor": "SpinQuantModifier(rotations=['R1', 'R2', 'R4'], transform_block_size=64, "
        "transform_type='hadamard') (their SpinQuant example) + QuantizationModifier: the W8A8 preset's int8 "
        "per-channel weights with int8 static per-tensor inputs (default observer: minmax, moving average 0.01)",
    },
    "w4a16-autoround": {
        "llmcompressor": "AutoRoundModifier W4A16 preset at group G, iters=ITERS (their AutoRound W4A16 example: "
        "iters 200), batch 8, its defaults otherwise (torch.compile on)",
        "auto-round": "auto_round.AutoRound(scheme='W4A16', group_size=G, iters=ITERS, amp=False) (default iters 200; "
        "nsamples 32, seqlen 256, batch 8, device cpu; float32 tuning, where its CPU default is bfloat16) and "
        "quantize(): its in-memory fake-quantized model (int4 symmetric, lm_head kept)",
    },
}
#: (scheme, tool) -> variant -> what it changes: closer to shardcal's recipe than the tool's documented one
#: (``--variant``; ``vs_peers.py`` runs each after the documented recipe, on SmolLM2, and on every model those in
#: :data:`EVERY_MODEL_VARIANTS`).
VARIANTS: dict[tuple[str, str], dict[str, str]] = {
    ("fp8", "llmcompressor"): {
        "gptq": 'GPTQModifier(scheme="FP8") (defaults: block 128, dampening 0.01, actorder static): fp8 per-tensor '
        "weights chosen by GPTQ, static per-tensor fp8 inputs; the algorithm of shardcal's `fp8-gptq`",
    },
    ("w8a8-int8-sq", "llmcompressor"): {
        "sq-0.8-static": "SmoothQuantModifier(smoothing_strength=0.8) + QuantizationModifier: int8 per-channel weights, "
        "int8 static per-tensor inputs (static_minmax observer), round to nearest",
    },
    ("w8a8-int8-sq", "modelopt"): {
        "alpha-0.8": "mtq.INT8_SMOOTHQUANT_CFG with algorithm {'method': 'smoothquant', 'alpha': 0.8}",
    },
    ("w4a16-gptq", "llmcompressor"): {
        "mse": "GPTQModifier, int4 symmetric group G, weight observer 'mse' (block 128, dampening 0.01, actorder "
        "static)",
    },
    ("w4a16-awq", "modelopt"): {
        "awq-full": "mtq.INT4_AWQ_CFG, block G, algorithm 'awq_full' (awq_lite + clip search)",
    },
    # the example's hadamard blocks of 128 do not divide SmolLM2's 576: random-hadamard (the example's advice for
    # such sizes, a known Hadamard matrix of 576 = 36 x 16) or Sylvester blocks of 64
    ("w4a16-quip", "llmcompressor"): {
        "random-hadamard": "QuIPModifier(rotations=['v', 'u'], transform_type='random-hadamard') (full-size "
        "matrices) + QuantizationModifier W4A16 group G (datafree)",
        "hadamard-64": "QuIPModifier(rotations=['v', 'u'], transform_block_size=64, transform_type='hadamard') + "
        "QuantizationModifier W4A16 group G (datafree)",
        "v-hadamard-64-gptq": "QuIPModifier(rotations=['v'], transform_block_size=64, transform_type='hadamard') + "
        "GPTQModifier W4A16 group G: the input rotations of shardcal's [rotation] block 64, then GPTQ",
    },
    ("w4a16-spinquant", "llmcompressor"): {
        "gptq": "SpinQuantModifier(rotations=['R1', 'R2', 'R4'], transform_block_size=64, transform_type='hadamard') "
        "+ GPTQModifier W4A16 group G",
    },
    ("w8a8-int8-spinquant", "llmcompressor"): {
        "static-minmax": "SpinQuantModifier(R1, R2, R4, block 64, hadamard) + QuantizationModifier: int8 "
        "per-channel weights, int8 static per-tensor inputs with the static_minmax observer (running min/max)",
    },
}
#: (scheme, tool, variant): the variants ``vs_peers.py`` runs on every model, not on SmolLM2 only.
EVERY_MODEL_VARIANTS: set[tuple[str, str, str]] = {("fp8", "llmcompressor", "gptq")}


def load_ids(path: str) -> torch.Tensor:
    ids = load_file(path)["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise SystemExit(f"{path}: input_ids must be int64 [N, L], got {ids.dtype} {list(ids.shape)}")
    return ids


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    for i in range(0, ids.shape[0], EVAL_BATCH):
        x = ids[i : i + EVAL_BATCH]
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(total / count)


def load_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config.use_cache = False
    return model


# ----------------------------------------------------------------------------------------------- llm-compressor


def _w4_group(symmetric: bool) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}


def llmcompressor_recipe(scheme: str, variant: str = "default") -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ignore = ["lm_head"]
    if scheme == "w4a16-quip":
        from llmcompressor.modifiers.transform import QuIPModifier

        quip = {
            "default": dict(rotations=["v", "u"], transform_block_size=128, transform_type="hadamard"),
            "random-hadamard": dict(rotations=["v", "u"], transform_type="random-hadamard"),
            "hadamard-64": dict(rotations=["v", "u"], transform_block_size=64, transform_type="hadamard"),
            "v-hadamard-64-gptq": dict(rotations=["v"], transform_block_size=64, transform_type="hadamard"),
        }[variant]
        quantize = GPTQModifier if variant.endswith("gptq") else QuantizationModifier
        return [QuIPModifier(**quip), quantize(config_groups=_w4_group(True), ignore=ignore)]
    if scheme in ("w4a16-spinquant", "w8a8-int8-spinquant"):
        from llmcompressor.modifiers.transform import SpinQuantModifier

        spin = SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_block_size=64, transform_type="hadamard")
        if scheme == "w4a16-spinquant":
            quantize = GPTQModifier if variant == "gptq" else QuantizationModifier
            return [spin, quantize(config_groups=_w4_group(True), ignore=ignore)]
        int8 = dict(num_bits=8, type="int", symmetric=True)
        observer = {"observer": "static_minmax"} if variant == "static-minmax" else {}
        groups = {
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(**int8, strategy="channel"),
                input_activations=QuantizationArgs(**int8, strategy="tensor", dynamic=False, **observer),
            )
        }
        return [spin, QuantizationModifier(config_groups=groups, ignore=ignore)]
    if scheme == "w4a16-autoround":
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        return [AutoRoundModifier(config_groups=_w4_group(True), ignore=ignore, iters=AUTOROUND_ITERS)]
    if (scheme, variant) == ("w8a8-int8-sq", "sq-0.8-static"):
        int8 = dict(num_bits=8, type="int", symmetric=True)
        groups = {
            "group_0": QuantizationScheme(
                targets=["Linear"],
                weights=QuantizationArgs(**int8, strategy="channel"),
                input_activations=QuantizationArgs(**int8, strategy="tensor", dynamic=False, observer="static_minmax"),
            )
        }
        return [SmoothQuantModifier(smoothing_strength=0.8), QuantizationModifier(config_groups=groups, ignore=ignore)]
    if (scheme, variant) == ("w4a16-gptq", "mse"):
        groups = _w4_group(True)
        groups["group_0"].weights.observer = "mse"
        return [GPTQModifier(targets="Linear", config_groups=groups, ignore=ignore)]
    if scheme == "fp8":
        quantize = GPTQModifier if variant == "gptq" else QuantizationModifier
        return [quantize(targets="Linear", scheme="FP8", ignore=ignore)]
    if scheme == "fp8-dynamic":
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)]
    if scheme == "fp8-dynamic-kv":
        kv = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore, kv_cache_scheme=kv)]
    if scheme == "w8a8-int8-dynamic-sq":
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore),
        ]
    if scheme == "w4a16-gptq":
        return [GPTQModifier(targets="Linear", config_groups=_w4_group(True), ignore=ignore)]
    if scheme == "w4a16-awq":
        return [AWQModifier(duo_scaling="both"), QuantizationModifier(config_groups=_w4_group(False), ignore=ignore)]
    if scheme == "nvfp4":
        return [QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore)]
    raise ValueError(f"llmcompressor documents no recipe for {scheme!r}")


def datafree(scheme: str, variant: str) -> bool:
    """Whether an llm-compressor recipe is transforms and round-to-nearest weights only (their ``datafree`` pipeline)."""
    return scheme in ("w4a16-quip", "w4a16-spinquant") and not variant.endswith("gptq")


def patch_cpu_pin() -> str:
    """Make llm-compressor's activation pinning a no-op without an accelerator (see the module docstring)."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache._pin_intermediate.__func__

    def _pin_intermediate(cls, intermediate):
        if not torch.accelerator.is_available():
            return None
        return original(cls, intermediate)

    IntermediatesCache._pin_intermediate = classmethod(_pin_intermediate)
    return "IntermediatesCache._pin_intermediate is a no-op without an accelerator (CPU-only host)"


def run_llmcompressor(
    model: torch.nn.Module, calib: torch.Tensor, scheme: str, variant: str = "default"
) -> tuple[torch.nn.Module, float, str]:
    from datasets import Dataset
    from llmcompressor import oneshot

    recipe = llmcompressor_recipe(scheme, variant)
    if datafree(scheme, variant):  # as their QuIP / SpinQuant examples: nothing in the recipe reads activations
        inputs: dict = {"pipeline": "datafree"}
    else:
        data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
        inputs = dict(
            dataset=data,
            num_calibration_samples=calib.shape[0],
            max_seq_length=calib.shape[1],
            batch_size=BATCH,
            shuffle_calibration_samples=False,
        )
    start = time.perf_counter()
    model = oneshot(model=model, recipe=recipe, **inputs)
    seconds = time.perf_counter() - start
    quantized = sum(
        1 for m in model.modules() if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None)
    )
    return model, seconds, f"{quantized} Linear modules carry a quantization_scheme"


# ----------------------------------------------------------------------------------------------- modelopt


def _block(cfg: dict, size: int) -> dict:
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and entry.get("cfg"):
            entry["cfg"]["block_sizes"][-1] = size
    return cfg


def modelopt_config(scheme: str, variant: str = "default") -> dict:
    import modelopt.torch.quantization as mtq

    if (scheme, variant) == ("w8a8-int8-sq", "alpha-0.8"):
        cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
        cfg["algorithm"] = {"method": "smoothquant", "alpha": 0.8}
        return cfg
    if (scheme, variant) == ("w4a16-awq", "awq-full"):
        cfg = _block(copy.deepcopy(mtq.INT4_AWQ_CFG), GROUP)
        cfg["algorithm"] = {"method": "awq_full"}
        return cfg

    if scheme == "fp8":
        return copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if scheme == "fp8-dynamic":
        return copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)
    if scheme == "fp8-dynamic-kv":
        cfg = copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)
        cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        return cfg
    if scheme == "w8a8-int8-sq":
        return copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    if scheme == "w4a16-gptq":  # no preset: the configuration modelopt's own GPTQ test uses
        cfg = _block(copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG), GROUP)
        cfg["algorithm"] = {"method": "gptq", "layerwise": {"enable": True}}
        return cfg
    if scheme == "w4a16-awq":
        return _block(copy.deepcopy(mtq.INT4_AWQ_CFG), GROUP)
    if scheme == "nvfp4":
        return copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    raise ValueError(f"modelopt documents no recipe for {scheme!r}")


def run_modelopt(
    model: torch.nn.Module, calib: torch.Tensor, scheme: str, variant: str = "default"
) -> tuple[torch.nn.Module, float, str]:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import TensorQuantizer

    cfg = modelopt_config(scheme, variant)

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for i in range(0, calib.shape[0], BATCH):
                m(input_ids=calib[i : i + BATCH], use_cache=False)

    start = time.perf_counter()
    model = mtq.quantize(model, cfg, forward_loop)
    seconds = time.perf_counter() - start
    enabled = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    weights = sum(n.endswith("weight_quantizer") for n in enabled)
    return model, seconds, f"{len(enabled)} enabled TensorQuantizers ({weights} weight)"


# ----------------------------------------------------------------------------------------------- auto-round


def run_autoround(
    model: torch.nn.Module, calib: torch.Tensor, scheme: str, variant: str = "default"
) -> tuple[torch.nn.Module, float, str]:
    """auto-round's own entry point, on CPU; its ``quantize()`` leaves the model with fake-quantized weights."""
    if scheme != "w4a16-autoround":
        raise ValueError(f"auto-round documents no recipe for {scheme!r}")
    from auto_round import AutoRound
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)  # required for a model object; data are ids
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    data = [
        {"input_ids": calib[i : i + BATCH], "attention_mask": torch.ones_like(calib[i : i + BATCH])}
        for i in range(0, calib.shape[0], BATCH)
    ]
    start = time.perf_counter()
    rounder = AutoRound(
        model,
        tokenizer=tokenizer,
        scheme="W4A16",
        group_size=GROUP,
        iters=AUTOROUND_ITERS,
        dataset=data,
        nsamples=calib.shape[0],
        seqlen=calib.shape[1],
        batch_size=BATCH,
        device_map="cpu",
        amp=False,  # float32 like every other row (on CPU its default casts the model to bfloat16)
    )
    model, _ = rounder.quantize()
    seconds = time.perf_counter() - start
    return model, seconds, _weight_check(model, before)


def _weight_check(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> str:
    """How many Linears' weights changed, and how many distinct values per row-group of GROUP they hold (int4: 16)."""
    changed, levels = 0, 0
    for name, module in model.named_modules():
        if name in before and isinstance(getattr(module, "weight", None), torch.Tensor):
            w = module.weight.detach().float()
            if w.shape == before[name].shape and not torch.equal(w, before[name]):
                changed += 1
                group = w.reshape(-1, GROUP)[0]
                levels = max(levels, int(torch.unique(group).numel()))
    return f"{changed}/{len(before)} Linear weights changed (at most {levels} values in a first group of {GROUP})"


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    global GROUP, EVAL_BATCH, AUTOROUND_ITERS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", required=True, choices=TOOLS)
    parser.add_argument("--scheme", required=True, choices=sorted(RECIPES))
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--calib", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="default", help="'default' (the documented recipe) or one of VARIANTS")
    parser.add_argument("--cpu-pin-patch", action="store_true", help="llmcompressor: no-op activation pinning on CPU")
    parser.add_argument("--group-size", type=int, default=GROUP, help="int4 group size of the w4a16 schemes")
    parser.add_argument("--eval-batch", type=int, default=EVAL_BATCH, help="sequences per perplexity forward")
    parser.add_argument("--autoround-iters", type=int, default=AUTOROUND_ITERS, help="AutoRound's steps per layer")
    args = parser.parse_args(argv)
    GROUP, EVAL_BATCH, AUTOROUND_ITERS = args.group_size, args.eval_batch, args.autoround_iters
    torch.manual_seed(0)
    variants = VARIANTS.get((args.scheme, args.tool), {})
    if args.variant != "default" and args.variant not in variants:
        parser.error(f"--variant {args.variant!r}: {args.tool} on {args.scheme} has {sorted(variants) or 'none'}")
    recipe = RECIPES[args.scheme].get(args.tool) if args.variant == "default" else variants[args.variant]
    if recipe is not None:
        recipe = re.sub(r"\bITERS\b", str(AUTOROUND_ITERS), re.sub(r"\bG\b", str(GROUP), recipe))
    result: dict = {"tool": args.tool, "scheme": args.scheme, "variant": args.variant, "recipe": recipe}
    try:
        if result["recipe"] is None:
            raise ValueError(f"{args.tool} documents no recipe for {args.scheme}")
        import importlib.metadata as md

        result.update(version=md.version(PACKAGES[args.tool]), torch=torch.__version__, threads=torch.get_num_threads())
        calib, held_out = load_ids(args.calib), load_ids(args.eval)
        model = load_model(args.model_dir)
        result["fp32_ppl"] = perplexity(model, held_out)
        if args.cpu_pin_patch and args.tool == "llmcompressor":
            result["patched"] = patch_cpu_pin()
        runner = {"llmcompressor": run_llmcompressor, "modelopt": run_modelopt, "auto-round": run_autoround}[args.tool]
        model, seconds, check = runner(model, calib, args.scheme, args.variant)
        dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()} - {"torch.float32"})
        if dtypes:  # llm-compressor's AutoRound on CPU leaves its decoder layers in bfloat16 (auto-round's amp)
            model = model.float()
            result["cast"] = f"{', '.join(dtypes)} parameters cast to float32 for perplexity"
        result.update(calib_seconds=seconds, check=check, ppl=perplexity(model, held_out))
        status = 0
    except Exception as exc:  # recorded, so that the table says what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        status = 1
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "recipe"}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
