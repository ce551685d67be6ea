"""Where an export runs: what vLLM and transformers do with the compressed-tensors export of a recipe.

One rule per recipe feature, each checked by a test against the real consumer (transformers in
``tests/export/test_consumers.py``; vLLM's CPU build in ``make test-vllm``, see docs/design/testing.md):

* **online Hadamard rotations** (``[rotation] block``): vLLM applies the ``transform_config`` at tensor parallel 1
  only (its online transforms refuse a sharded input dimension); transformers loads the export without an error but
  ignores ``transform_config`` (compressed-tensors' ``QuantizationConfig`` drops unknown keys), so its inputs are
  not rotated and it computes wrong outputs — there is no file-level switch that makes it refuse;
* **asymmetric int weights** (zero points): vLLM reads them; transformers refuses to load them (compressed-tensors
  up to 0.20 builds the zero-point parameters unpacked, and the packed ones do not fit);
* **static FP8 input scales**: vLLM's CUDA and ROCm builds; its CPU build has no static FP8 activation kernel;
* **NVFP4**: vLLM's NVFP4 kernels need a Blackwell GPU (elsewhere only its emulation); transformers fails in the
  first forward of a float32 model (compressed-tensors decompresses NVFP4 weights to bfloat16);
* **dynamic int8 activations**: transformers rounds per-token activations its own way (close to shardcal's and
  vLLM's, not equal);
* **FP8 KV cache** (``[kv_cache]``): vLLM with ``--kv-cache-dtype fp8`` (its CPU build rounds the cached values
  toward zero); transformers does not quantize the KV cache the same way.

Everything else (FP8 and INT8 weights with static or dynamic inputs, symmetric INT4 groups) runs in both and, in
transformers, computes exactly shardcal's logits (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..calib.recipe import Recipe

#: What a runtime does with an export: computes shardcal's outputs exactly, or to within its own activation
#: rounding; refuses it loudly; or loads it and computes something else (the one to warn about).
RUNS, CLOSE, REFUSES, WRONG = "runs", "close", "refuses", "wrong outputs"


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """One runtime's verdict on a recipe's export: ``status`` (:data:`RUNS`, :data:`CLOSE`, :data:`REFUSES` or
    :data:`WRONG`), the ``limits`` under which it runs, and ``why`` it does not or what to know."""

    name: str
    status: str
    limits: tuple[str, ...] = ()
    why: str = ""

    @property
    def usable(self) -> bool:
        """Whether the export serves here with the quality shardcal measured."""
        return self.status in (RUNS, CLOSE)


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Where a recipe's export runs: vLLM and transformers."""

    vllm: Runtime
    transformers: Runtime

    @property
    def everywhere(self) -> bool:
        """vLLM at any tensor-parallel size on the usual GPUs, and transformers."""
        return self.vllm.usable and not self.vllm.limits and self.transformers.usable

    def short(self) -> str:
        """``vLLM, transformers``; ``vLLM (TP 1)``; ... — the chooser's column."""
        parts = []
        for runtime in (self.vllm, self.transformers):
            if runtime.usable:
                tags = [SHORT_LIMITS.get(limit, limit) for limit in runtime.limits]
                parts.append(runtime.name + (f" ({', '.join(tags)})" if tags else ""))
        return ", ".join(parts) or "-"

    def notes(self) -> list[str]:
        """One sentence per limit or problem, for ``shardcal recipes NAME`` and the export's warning."""
        out = []
        for runtime in (self.vllm, self.transformers):
            out += [f"{runtime.name}: {limit}" for limit in runtime.limits]
            if runtime.why:
                out.append(f"{runtime.name}: {runtime.why}")
        return out


TP1 = "tensor parallel 1 only (online Hadamard transforms)"
GPU = "GPU builds only (vLLM's CPU build has no static FP8 activation kernel)"
BLACKWELL = "NVFP4 kernels on Blackwell GPUs (elsewhere vLLM's emulation)"
KV_FP8 = "serve with --kv-cache-dtype fp8 (vLLM's CPU build rounds the cached values toward zero)"
#: The chooser's short tag of each limit.
SHORT_LIMITS = {TP1: "TP 1", GPU: "GPU", BLACKWELL: "Blackwell", KV_FP8: "fp8 KV"}


def _rotates_online(recipe: Recipe) -> bool:
    return recipe.rotation is not None and recipe.rotation.block is not None


def _asymmetric_int_weights(recipe: Recipe) -> bool:
    weight = recipe.weight
    return weight is not None and weight.format in ("int4", "int8") and not weight.symmetric


def _formats(recipe: Recipe) -> set[str]:
    return {spec.format for spec in recipe.specs.values()}


def _vllm(recipe: Recipe) -> Runtime:
    limits = []
    if _rotates_online(recipe):
        limits.append(TP1)
    if "nvfp4" in _formats(recipe):
        limits.append(BLACKWELL)
    elif recipe.input is not None and recipe.input.format == "fp8_e4m3" and not recipe.input.dynamic:
        limits.append(GPU)
    if recipe.kv_cache is not None:
        limits.append(KV_FP8)
    return Runtime(name="vLLM", status=RUNS, limits=tuple(limits))


def _transformers(recipe: Recipe) -> Runtime:
    if _asymmetric_int_weights(recipe):  # first: a refusal is what a user sees, rotated or not
        why = "refuses to load it (compressed-tensors <= 0.20 cannot load packed zero points)"
        return Runtime(name="transformers", status=REFUSES, why=why)
    if _rotates_online(recipe):
        why = "loads it without an error but ignores its transform_config (online rotations): wrong outputs"
        return Runtime(name="transformers", status=WRONG, why=why)
    if "nvfp4" in _formats(recipe):
        why = "fails in the first forward of a float32 model (compressed-tensors decompresses NVFP4 to bfloat16)"
        return Runtime(name="transformers", status=REFUSES, why=why)
    if recipe.kv_cache is not None:
        why = "does not quantize the KV cache as vLLM does: close, not equal"
        return Runtime(name="transformers", status=CLOSE, why=why)
    if recipe.input is not None and recipe.input.dynamic and recipe.input.format == "int8":
        why = "rounds the per-token int8 activations its own way: close, not equal"
        return Runtime(name="transformers", status=CLOSE, why=why)
    return Runtime(name="transformers", status=RUNS)


def deployment(recipe: Recipe) -> Deployment:
    """Where ``recipe``'s export runs, and under which limits (see the module docstring for the rules)."""
    return Deployment(vllm=_vllm(recipe), transformers=_transformers(recipe))
