"""Where an export runs: what vLLM (its GPU builds, its CPU build on AVX-512 and on AVX2-only x86 CPUs) and
transformers do with the compressed-tensors export of a recipe.

The rules read a few :class:`Features` of what the export stores, from a recipe (:func:`recipe_features`) or from an
export plan's modules (:func:`export_features`). Each vLLM CPU and transformers verdict is a check that runs: vLLM's
CPU build in ``make test-vllm`` (tests/export/test_vllm.py: every shipped recipe's export, on this machine's AVX-512
kernels and again with vLLM, oneDNN and torch held to AVX2, as on a CPU without AVX-512), transformers in
``tests/export/test_consumers.py``. vLLM's GPU builds are not run here (no GPU in CI): their column states vLLM's own
kernel requirements.

* **online Hadamard rotations** (``[rotation] block``): vLLM's GPU builds apply the ``transform_config`` at tensor
  parallel 1 only (its online transforms refuse a sharded input dimension); its CPU build has no
  ``hadacore_transform`` and fails; transformers loads the export without an error but ignores ``transform_config``
  (compressed-tensors' ``QuantizationConfig`` drops unknown keys), so its inputs are not rotated and it computes wrong
  outputs — there is no file-level switch that makes it refuse;
* **asymmetric int weights** (zero points): vLLM reads them; transformers refuses to load them (compressed-tensors
  up to 0.20 builds the zero-point parameters unpacked, and the packed ones do not fit);
* **static FP8 input scales**: vLLM's GPU builds; its CPU build has no static FP8 activation kernel;
* **NVFP4**: vLLM's NVFP4 kernels for FP4 activations need a Blackwell GPU (elsewhere only its emulation); NVFP4
  weights with 16-bit activations (NVFP4A16) run on its FP4 weight-only kernels (Marlin) on other GPUs too; vLLM
  CPU has no NVFP4 kernel; transformers fails in the first forward of a float32 model (compressed-tensors
  decompresses NVFP4 weights to bfloat16);
* **MXFP4 / MXFP8** (OCP microscaling): vLLM's MX kernels with MX activations need Blackwell-class GPUs (elsewhere its
  emulation); MXFP4 weights with 16-bit activations run on its weight-only kernels (Marlin) on other GPUs too; vLLM
  CPU has no MX kernel; transformers, as for NVFP4, decompresses MX weights to bfloat16 and fails in a float32 model;
* **INT4 weights with FP8 activations (W4AFP8)**: vLLM's W4A8-FP8 kernel is built for Hopper GPUs only (elsewhere,
  CPU included, it finds no compressed-tensors scheme for the export);
* **FP8 block weights** (FP8_BLOCK): vLLM's GPU builds, where each fused layer's members but the last and each
  tensor-parallel shard span whole 128-row / 128-column blocks (vLLM refuses the checkpoint otherwise, naming the
  layer); vLLM CPU's FP8 block GEMMs need AMX tiles (Sapphire Rapids or newer): on the CPUs judged here it fails;
* **INT8 weights, 16-bit activations (W8A16)**: vLLM's GPU builds (Marlin); vLLM CPU's weight-only GEMM takes 4-bit
  weights only;
* **INT4 weights, 16-bit activations**: vLLM CPU's W4A16 GEMM is built into its AVX-512 library only (and computes in
  bfloat16: no float32 path);
* **INT8 activations**: vLLM CPU's int8 GEMM (oneDNN) on a CPU without VNNI sums pairs of u8 x s8 products in
  saturating int16: wrong outputs, no error; transformers rounds per-token activations its own way (close to
  shardcal's and vLLM's, not equal);
* **FP8 KV cache** (``[kv_cache]``): vLLM with ``--kv-cache-dtype fp8``; its CPU build needs AVX-512 or AMX and
  rounds the cached values toward zero; transformers does not quantize the KV cache the same way.

Everything else (FP8 and INT8 weights with dynamic inputs, symmetric INT4 groups on AVX-512) runs in each and, in
transformers, computes exactly shardcal's logits (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..calib.recipe import Recipe

#: What a runtime does with an export: computes shardcal's outputs exactly, or to within its own activation
#: rounding; refuses it loudly; or loads it and computes something else (the one to warn about).
RUNS, CLOSE, REFUSES, WRONG = "runs", "close", "refuses", "wrong outputs"
#: The x86 CPUs vLLM's CPU build is judged on: with AVX-512 (its AVX-512 library: BF16 and VNNI where the CPU has
#: them), and with AVX2 only (its AVX2 library; oneDNN without VNNI).
CPU_ISAS: tuple[str, ...] = ("avx512", "avx2")


@dataclass(frozen=True, kw_only=True)
class Features:
    """What decides where an export runs: online input rotations, the weight formats, INT4 / INT8 weights with
    16-bit activations, INT4 weights with FP8 activations, NVFP4 activations, asymmetric INT weights (zero points),
    static FP8 inputs, INT8 inputs, an FP8 KV cache."""

    online_rotation: bool = False
    weight_formats: frozenset[str] = frozenset()
    int4_weight_only: bool = False
    int8_weight_only: bool = False
    int4_fp8_input: bool = False
    nvfp4_input: bool = False
    mx_input: bool = False
    fp8_block_weights: bool = False
    asymmetric_int_weights: bool = False
    static_fp8_input: bool = False
    int8_input: bool = False
    dynamic_int8_input: bool = False
    kv_cache: bool = False


def recipe_features(recipe: Recipe) -> Features:
    """The :class:`Features` of what ``recipe`` exports (its ``[fallback]`` scheme's included: some layers may be
    stored that way)."""
    schemes = [recipe] + ([recipe.fallback] if recipe.fallback is not None else [])
    pairs = [(r.weight, r.input) for r in schemes if r.weight is not None]
    return _features(
        pairs, online_rotation=recipe.rotation is not None and recipe.rotation.block is not None,
        kv_cache=recipe.kv_cache is not None,
    )  # fmt: skip


def export_features(modules: Iterable[object], kv_cache: bool) -> Features:
    """The :class:`Features` of an export from its quantized modules (each with ``spec_weight``, ``spec_input`` and
    ``input_rotation``: :class:`~.quant_modules.QuantModule`) and whether it stores KV-cache scales."""
    modules = list(modules)
    pairs = [(m.spec_weight, m.spec_input) for m in modules]
    return _features(pairs, online_rotation=any(m.input_rotation for m in modules), kv_cache=kv_cache)


def _features(pairs: list[tuple[object, object]], *, online_rotation: bool, kv_cache: bool) -> Features:
    """``pairs``: ``(weight spec, input spec or None)`` of every quantized scheme stored."""
    inputs = [i for _, i in pairs if i is not None]
    return Features(
        online_rotation=online_rotation,
        weight_formats=frozenset(w.format for w, _ in pairs),
        int4_weight_only=any(w.format == "int4" and i is None for w, i in pairs),
        int8_weight_only=any(w.format == "int8" and i is None for w, i in pairs),
        int4_fp8_input=any(w.format == "int4" and i is not None and i.format == "fp8_e4m3" for w, i in pairs),
        nvfp4_input=any(i.format == "nvfp4" for i in inputs),
        mx_input=any(i.format in ("mxfp4", "mxfp8") for i in inputs),
        fp8_block_weights=any(w.format == "fp8_e4m3" and w.granularity == "block" for w, _ in pairs),
        asymmetric_int_weights=any(w.format in ("int4", "int8") and not w.symmetric for w, _ in pairs),
        static_fp8_input=any(i.format == "fp8_e4m3" and not i.dynamic for i in inputs),
        int8_input=any(i.format == "int8" for i in inputs),
        dynamic_int8_input=any(i.format == "int8" and i.dynamic for i in inputs),
        kv_cache=kv_cache,
    )


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """One runtime's verdict on an export: ``status`` (:data:`RUNS`, :data:`CLOSE`, :data:`REFUSES` or
    :data:`WRONG`), the ``limits`` under which it runs, and ``why`` it does not or what to know."""

    name: str
    status: str
    limits: tuple[str, ...] = ()
    why: str = ""

    @property
    def usable(self) -> bool:
        """Whether the export serves here with the quality shardcal measured."""
        return self.status in (RUNS, CLOSE)

    def cell(self) -> str:
        """The chooser's cell: ``yes``, ``close``, the limits' short tags (``TP 1``), ``no`` or ``wrong``."""
        if not self.usable:
            return "no" if self.status == REFUSES else "wrong"
        tags = [SHORT_LIMITS[limit] for limit in self.limits if limit in SHORT_LIMITS]
        return ", ".join(tags) or ("yes" if self.status == RUNS else "close")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Where an export runs: vLLM's GPU builds, vLLM's CPU build on AVX-512 and on AVX2-only CPUs, transformers."""

    vllm_gpu: Runtime
    vllm_cpu: dict[str, Runtime]  # by :data:`CPU_ISAS`
    transformers: Runtime

    def runtimes(self) -> list[Runtime]:
        return [self.vllm_gpu, *(self.vllm_cpu[isa] for isa in CPU_ISAS), self.transformers]

    @property
    def everywhere(self) -> bool:
        """vLLM at any tensor-parallel size on the usual GPUs, and transformers."""
        return self.vllm_gpu.usable and not self.vllm_gpu.limits and self.transformers.usable

    def cpu_cell(self) -> str:
        """The chooser's vLLM CPU cell: ``yes`` (both kinds of x86 CPU), ``AVX-512`` (not on AVX2-only CPUs), ``no``."""
        avx512, avx2 = (self.vllm_cpu[isa] for isa in CPU_ISAS)
        if not avx512.usable:
            return "no"
        return avx512.cell() if avx2.usable else "AVX-512"

    def cells(self) -> tuple[str, str, str]:
        """The chooser's three columns: vLLM GPU, vLLM CPU, transformers."""
        return self.vllm_gpu.cell(), self.cpu_cell(), self.transformers.cell()

    def notes(self) -> list[str]:
        """One sentence per limit or problem, for ``shardcal recipes NAME``."""
        out = []
        for runtime in self.runtimes():
            out += [f"{runtime.name}: {limit}" for limit in runtime.limits]
            if runtime.why:
                out.append(f"{runtime.name}: {runtime.why}")
        return out

    def failing(self) -> list[Runtime]:
        """The runtimes that refuse the export or compute something else with it."""
        return [r for r in self.runtimes() if not r.usable]

    def warning(self, out_dir: object) -> str | None:
        """What the export says about the runtimes that will fail on it (None when none does): each with why, vLLM's
        CPU build once where it fails alike on both kinds of CPU."""
        said = []
        for runtime in self.failing():
            name = runtime.name
            if name.startswith("vLLM CPU") and all(r.why == runtime.why for r in self.vllm_cpu.values()):
                if said and said[-1].startswith(f"vLLM CPU {runtime.why}"):
                    continue
                name = "vLLM CPU"
            said.append(f"{name} {runtime.why}")
        return f"{out_dir} will not serve everywhere: " + "; ".join(said) if said else None


TP1 = "tensor parallel 1 only (online Hadamard transforms)"
BLACKWELL = "NVFP4 kernels on Blackwell GPUs (elsewhere vLLM's emulation)"
MX_BLACKWELL = "MX kernels on Blackwell-class GPUs (elsewhere vLLM's emulation)"
HOPPER = (
    "Hopper GPUs only (its W4A8-FP8 kernel, which rounds each row's group scales to FP8 at load: within 1/16 of the "
    "stored ones, not equal; elsewhere it finds no scheme for the export)"
)
BLOCKS = "a fused layer's members but the last, and each tensor-parallel shard, must span whole blocks (else refused)"
KV_FP8 = "serve with --kv-cache-dtype fp8"
KV_FP8_CPU = "serve with --kv-cache-dtype fp8; it rounds the cached values toward zero"
BF16_ONLY = "bfloat16 activations only (its W4A16 GEMM has no float32 path)"
#: The chooser's short tag of each limit (a limit without one shows as ``yes``).
SHORT_LIMITS = {
    TP1: "TP 1",
    BLACKWELL: "Blackwell",
    MX_BLACKWELL: "Blackwell",
    HOPPER: "Hopper",
    KV_FP8: "fp8 KV",
    KV_FP8_CPU: "fp8 KV",
}


def _vllm_gpu(f: Features) -> Runtime:
    limits = []
    if f.online_rotation:
        limits.append(TP1)
    if f.nvfp4_input:
        limits.append(BLACKWELL)
    if f.mx_input:
        limits.append(MX_BLACKWELL)
    if f.int4_fp8_input:
        limits.append(HOPPER)
    if f.fp8_block_weights:
        limits.append(BLOCKS)
    if f.kv_cache:
        limits.append(KV_FP8)
    return Runtime(name="vLLM GPU", status=RUNS, limits=tuple(limits))


def _vllm_cpu(f: Features, isa: str) -> Runtime:
    name = "vLLM CPU (AVX-512)" if isa == "avx512" else "vLLM CPU (AVX2 only)"
    refused = None
    if f.online_rotation:
        refused = "fails: it has no hadacore_transform (online Hadamard transforms run on GPUs only)"
    elif "nvfp4" in f.weight_formats:
        refused = "fails: it has no NVFP4 kernel"
    elif f.weight_formats & {"mxfp4", "mxfp8"}:
        refused = "fails: it has no MXFP4 / MXFP8 kernel"
    elif f.static_fp8_input:
        refused = "fails: it has no static FP8 activation kernel (static_scaled_fp8_quant)"
    elif f.int4_fp8_input:
        refused = "fails: it has no W4A8-FP8 kernel (no compressed-tensors scheme matches the export)"
    elif f.fp8_block_weights:
        refused = "fails: its FP8 block GEMMs need AMX tiles (Sapphire Rapids or newer), unchecked there"
    elif f.int8_weight_only:
        refused = "fails: its weight-only GEMM (cpu_gemm_wna16) takes 4-bit weights only"
    elif isa == "avx2" and "int4" in f.weight_formats:
        refused = "fails: its W4A16 GEMM (cpu_gemm_wna16) is built for AVX-512 only"
    elif isa == "avx2" and f.kv_cache:
        refused = "refuses the FP8 KV cache (it needs AVX-512 or AMX)"
    if refused is not None:
        return Runtime(name=name, status=REFUSES, why=refused)
    if isa == "avx2" and f.int8_input:
        why = "computes wrong outputs: its int8 GEMM (oneDNN) without VNNI sums u8 x s8 pairs in saturating int16"
        return Runtime(name=name, status=WRONG, why=why)
    limits = ([BF16_ONLY] if "int4" in f.weight_formats else []) + ([KV_FP8_CPU] if f.kv_cache else [])
    return Runtime(name=name, status=RUNS, limits=tuple(limits))


def _transformers(f: Features) -> Runtime:
    if f.asymmetric_int_weights:  # first: a refusal is what a user sees, rotated or not
        why = "refuses to load it (compressed-tensors <= 0.20 cannot load packed zero points)"
        return Runtime(name="transformers", status=REFUSES, why=why)
    if f.online_rotation:
        why = "loads it without an error but ignores its transform_config (online rotations): wrong outputs"
        return Runtime(name="transformers", status=WRONG, why=why)
    if f.weight_formats & {"nvfp4", "mxfp4", "mxfp8"}:
        kind = "NVFP4" if "nvfp4" in f.weight_formats else "MX"
        why = f"fails in the first forward of a float32 model (compressed-tensors decompresses {kind} to bfloat16)"
        return Runtime(name="transformers", status=REFUSES, why=why)
    if f.kv_cache:
        why = "does not quantize the KV cache as vLLM does: close, not equal"
        return Runtime(name="transformers", status=CLOSE, why=why)
    if f.dynamic_int8_input:
        why = "rounds the per-token int8 activations its own way: close, not equal"
        return Runtime(name="transformers", status=CLOSE, why=why)
    return Runtime(name="transformers", status=RUNS)


def deployment(what: Recipe | Features) -> Deployment:
    """Where the export of a recipe (or of an export with these :class:`Features`) runs, and under which limits (see
    the module docstring for the rules)."""
    f = recipe_features(what) if isinstance(what, Recipe) else what
    return Deployment(
        vllm_gpu=_vllm_gpu(f), vllm_cpu={isa: _vllm_cpu(f, isa) for isa in CPU_ISAS}, transformers=_transformers(f)
    )
