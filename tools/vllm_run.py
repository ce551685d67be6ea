"""Prompt logprobs of checkpoints as vLLM computes them: run inside the vLLM venv (``make test-vllm`` creates
``.venv-vllm``), never imported by shardcal or its tests (tests/export/test_vllm.py and benchmarks/vllm_check.py
start it as a subprocess).

    .venv-vllm/bin/python tools/vllm_run.py JOB.json
    .venv-vllm/bin/python tools/vllm_run.py --probe       # what this machine's vLLM CPU lacks, as JSON

``JOB.json``: ``{"prompts": [[token ids], ...], "runs": [{"name", "model", "dtype", "wna16_dtype"}, ...], "out":
"result.json", "isa": "native" | "avx2"}``. ``isa: "avx2"`` runs vLLM CPU as on an x86 CPU without AVX-512 (a laptop or
an older server): vLLM told the CPU has no AVX-512, AVX-512 BF16, VNNI or AMX (it then loads its AVX2 library), and
oneDNN and torch held to AVX2 kernels (:func:`emulate_avx2`).
Each run loads ``model`` with ``vllm.LLM`` (``dtype``, ``enforce_eager``, no tokenizer: the prompts are token ids;
an fp8 KV cache when the checkpoint has a ``kv_cache_scheme``) and asks for the logprob of every prompt token after
the first (``prompt_logprobs=0``). The out file gets ``{"machine": <probe>, "runs": {name: {"logprobs": [[...],
...], "references": [...], "dtype"} or {"error": "..."}}}`` (the error: what vLLM raised, in a line: a scheme vLLM CPU cannot
run here). Written after each run, so a crash keeps the others.

Where vLLM CPU lacks a kernel on this machine (:func:`probe`), a reference stands in for that one step and the run
lists it under ``references`` when it computed something; everything else (config parsing, weight loaders, fused
layers, scale processing, activation quantization) is vLLM's own:

- ``nvfp4_emulation`` (vLLM CPU has no NVFP4 kernel): vLLM's own ``EmulationNvFp4LinearKernel`` (its
  dequantize-and-matmul reference, which its CUDA and ROCm builds fall back to), registered for the CPU platform;
- ``dense_hadamard`` (no ``hadacore_transform`` in vLLM CPU): the online Hadamard transform as vLLM's own dense
  branch computes other transforms: the stored matrix (divided by ``sqrt(size)`` at load, as vLLM does) as a matmul;
- ``wna16_gemm`` (``cpu_gemm_wna16`` is built for AVX-512 only): vLLM's CPU W4A16 kernel class loads the weights as
  always (GPTQ layout), and the GEMM is written out: ``x @ ((q - zp) * s)``;
- ``int8_gemm`` (oneDNN's int8 GEMM saturates without VNNI): vLLM's int8 kernel class loads the weights and
  quantizes the activations as always; the product of those int8 operands and their scales is taken in float;
- ``fp8_static_quant`` (``static_scaled_fp8_quant`` and ``silu_and_mul_quant`` have no CPU kernel): the per-tensor
  quantization written out, ``fp8(clamp(x / scale, -448, 448))``, and vLLM's own unfused SiLU-and-mul before it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

#: The environment of the vLLM process: the engine in this process (the references must reach the model), a small KV
#: cache, no thread pinning on a shared machine, and vLLM CPU's W4A16 kernel for int4 weights (on AMX CPUs it would
#: otherwise quantize the activations to int8: W4A8, not what the checkpoint says).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_INT4_W4A8": "0",
}
#: What a vLLM CPU user should know where a reference stood in (``status``; the recipe chooser shows it).
REFERENCE_NOTES = {
    "nvfp4_emulation": "vLLM CPU has no NVFP4 kernel (a GPU build of vLLM has); checked with vLLM's own NVFP4 emulation",
    "dense_hadamard": "online Hadamard: vLLM CPU lacks hadacore_transform; checked with the stored matrices as a matmul",
    "wna16_gemm": "vLLM CPU's W4A16 GEMM needs an AVX-512 CPU; checked with vLLM's loaded int4 weights multiplied in "
    "float",
    "int8_gemm": "vLLM CPU's int8 GEMM (oneDNN) is wrong on x86 CPUs without VNNI (AVX2 only); checked with vLLM's own "
    "int8 operands multiplied in float",
    "fp8_static_quant": "static fp8 needs a GPU build of vLLM (vLLM CPU has no static_scaled_fp8_quant); checked with "
    "that quantization written out",
}
#: Errors vLLM CPU raises for what it cannot run on this machine (a piece of the message -> what a user should know).
KNOWN_LIMITS = {
    "FP8 KV cache on CPU requires": "vLLM CPU's FP8 KV cache needs an x86 CPU with AVX-512 or AMX (not this one); "
    "where it runs, its FP8 KV-cache writer rounds toward zero (issue 44), not to nearest like shardcal's model",
    "not supported by CPUWNA16": "vLLM CPU's weight-only GEMM takes 4-bit weights only (W8A16 runs on vLLM's GPU "
    "builds: Marlin); the export's weights are checked against compressed-tensors' decompressor and transformers",
    "Marlin FP4 not available": "vLLM CPU has no NVFP4 weight-only kernel (vLLM's GPU builds run Marlin FP4); the "
    "export's weights are checked against compressed-tensors' decompressor and transformers",
    "implement the MXFP4 linear layer": "vLLM CPU has no MXFP4 kernel, and its MXFP4 emulation needs the amd-quark "
    "package; the export's weights are checked against compressed-tensors and transformers",
    "implement the MXFP8 linear layer": "vLLM CPU has no MXFP8 kernel (its MXFP8 emulation runs bf16 weights without "
    "quantizing activations: no check of the scheme); the export is checked against compressed-tensors and "
    "transformers",
    "requires AMX tile support": "vLLM CPU's FP8 block GEMMs need AMX tiles (Sapphire Rapids or newer; not this "
    "machine): unchecked on CPU; the export is checked against compressed-tensors and transformers",
    "No compressed-tensors compatible scheme": "vLLM has a W4A8-FP8 kernel for Hopper GPUs only (elsewhere, its CPU "
    "build included, no compressed-tensors scheme matches); the export is checked against compressed-tensors and "
    "transformers",
}


#: What a reference standing in means for a vLLM CPU user without it (:func:`verdict`): the kernel is missing (vLLM
#: fails), or it is there and computes something else.
MISSING_KERNELS = {"nvfp4_emulation", "dense_hadamard", "wna16_gemm", "fp8_static_quant"}
WRONG_KERNELS = {"int8_gemm"}


def verdict(result: dict) -> str:
    """What vLLM CPU itself does with one run's export on the machine the run emulates: ``"runs"``, ``"refuses"``
    (an error, or a kernel it lacks: a reference had to stand in) or ``"wrong outputs"`` (a kernel that computes
    something else stood in for) — shardcal.export.consumers' words."""
    if "error" in result:
        return "refuses"
    used = set(result["references"])
    if used & MISSING_KERNELS:
        return "refuses"
    return "wrong outputs" if used & WRONG_KERNELS else "runs"


#: torch's CPU feature checks that vLLM reads (its kernel library, its attention's FP8 KV-cache check, AMX paths).
_CPU_FEATURES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
                 "_is_amx_fp16_supported")  # fmt: skip
#: The environment that holds oneDNN and torch to AVX2 kernels; set before torch is imported.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}


def emulate_avx2() -> None:
    """This process as on an x86 CPU with AVX2 and nothing newer: oneDNN and torch held to AVX2 kernels (which
    :data:`AVX2_ENV` did before torch was imported), and torch's CPU feature checks, which vLLM reads to choose its
    kernel library (``_C_AVX2``) and paths, answering no for AVX-512, AVX-512 BF16, VNNI and AMX."""
    import torch

    for name in _CPU_FEATURES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
    torch.backends.cpu.get_cpu_capability()  # the capability torch took from the environment


def status(result: dict) -> tuple[str, str]:
    """``(vllm_cpu, note)`` of one run's result: ``"checked"``, ``"checked (emulation)"`` (a reference stood in
    for a kernel) or ``"unchecked"`` (vLLM CPU could not run it: the note says why)."""
    if "error" in result:
        return "unchecked", next((n for k, n in KNOWN_LIMITS.items() if k in result["error"]), result["error"])
    refs = result["references"]
    return ("checked (emulation)" if refs else "checked"), "; ".join(REFERENCE_NOTES[r] for r in refs)


def run_vllm(
    python: str, prompts: list[list[int]], runs: list[dict], work: Path, timeout: float, isa: str = "native"
) -> dict:
    """This script in the vLLM venv's ``python`` (a subprocess) on ``runs``, on this machine's CPU or (``isa=
    "avx2"``) as on one with AVX2 only; its out file's contents."""
    import subprocess

    job, out = work / f"vllm-job-{isa}.json", work / f"vllm-result-{isa}.json"
    job.write_text(json.dumps({"prompts": prompts, "runs": runs, "out": str(out), "isa": isa}))
    env = {**os.environ, **VLLM_ENV, **(AVX2_ENV if isa == "avx2" else {})}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [python, __file__, str(job)], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if not out.is_file():
        raise RuntimeError(f"{python} {__file__} failed (exit {proc.returncode}): {proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def use_nvfp4_emulation(mark) -> None:
    """vLLM's NVFP4 emulation kernel as the CPU platform's NVFP4 linear kernel."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    EmulationNvFp4LinearKernel.apply_weights = mark("nvfp4_emulation", EmulationNvFp4LinearKernel.apply_weights)
    linear._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [EmulationNvFp4LinearKernel]


def use_dense_hadamard(mark) -> None:
    """Online Hadamard transforms as a matmul with the stored (normalized) matrix, per block of ``head_dim``."""
    from vllm.model_executor.layers.quantization.compressed_tensors.transform import module

    def forward(self, value, part_id: int = 0):
        if part_id not in self.weight.partitions:
            return value
        weight = self.weight.partitions[part_id]
        weight = weight if self.transforms[part_id].args.inverse else weight.T  # as vLLM's dense branch
        blocks = value.unflatten(-1, (-1, weight.size(0)))
        return (blocks.to(weight.dtype) @ weight.T).to(value.dtype).flatten(-2, -1)

    module.HadamardTransform.forward = mark("dense_hadamard", forward)


def wna16_kernel_missing() -> bool:
    """vLLM CPU builds its W4A16 GEMM (``cpu_gemm_wna16``) into the AVX-512 library only."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return not hasattr(torch.ops._C, "cpu_gemm_wna16")


def use_reference_wna16(mark) -> None:
    """Where vLLM CPU lacks its W4A16 GEMM: its own CPU W4A16 kernel class loads and lays out the weights as always
    (GPTQ format: ``[in / 8, out]`` codes, ``[groups, out]`` scales, ``[groups, out / 8]`` zero points), and the GEMM
    is the kernel's documented arithmetic written out: ``x @ ((q - zp) * s)``, zero point 8 when symmetric."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision import cpu
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    def keep_gptq_layout(self, layer):
        layer.isa_hint = "reference"

    def apply_weights(self, layer, x, bias=None):
        w_q, w_s, w_zp = self._get_weight_params(layer)
        q = unpack_quantized_values_into_int32(w_q, self.config.weight_type, 0)  # [in, out]
        if w_zp is not None:
            zp = unpack_quantized_values_into_int32(w_zp, self.config.weight_type, 1)  # [groups, out]
        else:
            zp = torch.full_like(w_s, 8, dtype=torch.int32)
        group = self.config.group_size if self.config.group_size != -1 else q.shape[0]
        rows = torch.arange(q.shape[0]) // group
        w = (q - zp[rows]).float() * w_s.float()[rows]
        out = x @ w.to(x.dtype)
        return out if bias is None else out + bias

    cpu.CPUWNA16LinearKernel._process_gptq_weights_w4a16 = keep_gptq_layout
    cpu.CPUWNA16LinearKernel.apply_weights = mark("wna16_gemm", apply_weights)


def int8_gemm_wrong() -> bool:
    """Whether vLLM CPU's int8 GEMM (oneDNN) misses a plain float product of its own int8 operands: on x86 CPUs
    without VNNI, oneDNN sums pairs of u8 x s8 products in saturating int16 (seen here on an AVX2-only CPU)."""
    import torch
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 256, generator=gen), torch.randn(128, 256, generator=gen)
    w_s = w.abs().amax(1, keepdim=True) / 127
    w_q = torch.round(w / w_s).to(torch.int8)
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    handler = ops.create_onednn_scaled_mm(w_q.t(), w_s, torch.float32, True, False, 32)
    out = torch.empty(16, 128)
    ops.onednn_scaled_mm(handler, x_q, out, x_s, None, None, None)
    ref = (x_q.float() * x_s) @ (w_q.float() * w_s).T
    return bool((out - ref).abs().max() > 1e-4 * ref.abs().max())


def use_reference_int8_gemm(mark) -> None:
    """Where vLLM CPU's int8 GEMM is wrong (:func:`int8_gemm_wrong`): its kernel class loads the weights and scales
    and quantizes the activations (``onednn_scaled_int8_quant``) as always; the product of those int8 operands and
    their scales is computed in float."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    original = cpu.CPUInt8ScaledMMLinearKernel.process_weights_for_onednn

    def keep_weight(self, layer):
        w_q_name, w_s_name, *_ = self.layer_param_names
        weight_kn = getattr(layer, w_q_name).detach().t().float()  # [K, N], as oneDNN gets it
        original(self, layer)  # per-tensor scales made channelwise, input scales combined; the weight goes to oneDNN
        layer.reference_weight = weight_kn * getattr(layer, w_s_name).float().reshape(1, -1)

    def apply(self, layer, x, bias=None):
        _, _, i_s, i_zp, _ = self._get_layer_params(layer)
        shape = x.shape
        x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x.reshape(-1, shape[-1]), i_s, i_zp, self.config.input_symmetric)
        assert x_zp is None, "asymmetric int8 inputs: no reference"
        out = ((x_q.float() * x_s.float().reshape(-1, 1)) @ layer.reference_weight).to(x.dtype)
        out = out if bias is None else out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

    cpu.CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = keep_weight
    cpu.CPUInt8ScaledMMLinearKernel._apply_weights_onednn = mark("int8_gemm", apply)


def fp8_static_quant_missing() -> bool:
    """vLLM CPU registers ``static_scaled_fp8_quant`` without a kernel (static fp8 activations, and the requantizing
    of fused fp8 per-tensor weights at load)."""
    import torch
    from vllm import _custom_ops as ops

    try:
        ops.scaled_fp8_quant(torch.ones(2, 16), torch.ones(1))
    except RuntimeError:
        return True
    return False


def use_reference_fp8_static_quant(mark) -> None:
    """``scaled_fp8_quant`` with a per-tensor scale as its documentation says: ``fp8(clamp(x / scale, -448, 448))``
    (round to nearest even, torch's cast); everything else stays vLLM's."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fusion import fused_act_quant
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym

    dynamic = ops.scaled_fp8_quant

    def static(input, scale, output):
        q = torch.clamp(input.float() / scale.float(), -448.0, 448.0).to(torch.float8_e4m3fn)
        if output is None:
            return q, scale
        output.copy_(q)
        return output, scale

    static = mark("fp8_static_quant", static)

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None, use_per_token_if_dynamic=False,
                         output=None, group_shape=None):  # fmt: skip
        if scale is None or scale.numel() != 1 or num_token_padding:
            return dynamic(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        return static(input, scale, output)

    ops.scaled_fp8_quant = scaled_fp8_quant
    # SiLU-and-mul fused with the static quantization (no CPU kernel either): vLLM's unfused path, the activation
    # then the down projection's own input quantization
    fused_act_quant._FUSED_ACT_QUANT.pop((SiluAndMul, kFp8StaticTensorSym), None)


def prompt_logprobs(llm, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's logprob of token ``t`` given tokens ``< t``, for ``t = 1 ..``."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        entries = out.prompt_logprobs[1:]
        result.append([float(entry[token].logprob) for entry, token in zip(entries, prompt[1:], strict=True)])
    return result


def forget_scaled_transforms() -> None:
    """vLLM divides each loaded Hadamard matrix by ``sqrt(size)`` once, remembering the matrices it scaled by their
    memory address in a class-level set; a later engine in the same process may allocate a matrix at an address of
    the last one and would then leave it unscaled. Each run starts with the set empty."""
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform

    HadamardTransform.scaled_data_ptrs.clear()


def probe() -> dict[str, bool]:
    """Which kernels vLLM CPU lacks (or computes wrongly) on this machine: reference name -> needed; and whether vLLM
    sees AVX-512 (``avx512``)."""
    import torch
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum, current_platform

    current_platform.import_kernels()
    return {
        "avx512": torch.cpu._is_avx512_supported(),  # what vLLM sees (no under isa avx2)
        "nvfp4_emulation": not linear._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU),
        "dense_hadamard": not hasattr(torch.ops._C, "hadacore_transform"),
        "wna16_gemm": not hasattr(torch.ops._C, "cpu_gemm_wna16"),
        "int8_gemm": int8_gemm_wrong(),
        "fp8_static_quant": fp8_static_quant_missing(),
    }


#: The references, by the name :func:`probe` and the results use.
REFERENCES = {
    "nvfp4_emulation": use_nvfp4_emulation,
    "dense_hadamard": use_dense_hadamard,
    "wna16_gemm": use_reference_wna16,
    "int8_gemm": use_reference_int8_gemm,
    "fp8_static_quant": use_reference_fp8_static_quant,
}
#: The references that computed something in the current run.
USED: set[str] = set()


def _used(name: str, fn):
    def wrapper(*args, **kwargs):
        USED.add(name)
        return fn(*args, **kwargs)

    return wrapper


def run(spec: dict, prompts: list[list[int]], machine: dict[str, bool]) -> dict:
    """One run (see the module docstring). ``spec["wna16_dtype"]``: the dtype of a weight-only int checkpoint where
    vLLM CPU's own W4A16 kernel runs (it has no float32 path); the result says which dtype ran."""
    from vllm import LLM

    forget_scaled_transforms()
    USED.clear()
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    quantization = config.get("quantization_config", {})
    kv = "fp8" if quantization.get("kv_cache_scheme") else "auto"
    dtype = spec.get("dtype", "float32")
    if quantization.get("format") == "pack-quantized" and not machine["wna16_gemm"]:
        dtype = spec.get("wna16_dtype", dtype)
    try:
        llm = LLM(
            model=spec["model"],
            dtype=dtype,
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=max(len(p) for p in prompts) + 1,
            kv_cache_dtype=kv,
            seed=0,
        )
        result = {"logprobs": prompt_logprobs(llm, prompts), "references": sorted(USED), "dtype": dtype}
    except Exception as exc:  # a scheme vLLM CPU cannot run: recorded, the others still run
        traceback.print_exc()
        result = {"error": _in_a_line(exc)}
    # the engine (and its process groups) must be gone before the next one starts: no traceback may keep it
    llm = None
    gc.collect()
    return result


def _in_a_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


def main(argv: list[str]) -> int:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    job = json.loads(Path(argv[1]).read_text()) if argv[1:] != ["--probe"] else {}
    isa = job.get("isa", "native")
    if isa == "avx2":
        os.environ.update(AVX2_ENV)
        emulate_avx2()
    elif isa != "native":
        raise SystemExit(f"isa {isa!r}: expected native or avx2")
    machine = probe()
    if argv[1:] == ["--probe"]:
        print(json.dumps(machine))
        return 0
    for name, needed in machine.items():
        if needed and name in REFERENCES:
            REFERENCES[name](_used)
    out = Path(job["out"])
    results: dict[str, dict] = {}
    for spec in job["runs"]:
        results[spec["name"]] = run(spec, job["prompts"], machine)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"machine": machine, "runs": results}))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
