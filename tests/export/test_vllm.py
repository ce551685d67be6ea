"""vLLM is the judge: every shipped recipe's export of a tiny Llama, loaded by vLLM CPU, computes the prompt logprobs
that shardcal's own fake-quant model of the export (its reload) computes.

vLLM runs in a venv of its own (``make test-vllm`` creates ``.venv-vllm`` and sets ``SHARDCAL_VLLM_PYTHON``; without
it this module is skipped), in one subprocess (``tools/vllm_run.py``) that loads every export in turn — once on this
machine's own kernels (AVX-512), once as on an x86 CPU with AVX2 only. Where vLLM CPU has no kernel for a step, a
reference stands in for that step only (the run names it; see tools/vllm_run.py and
docs/reference/vllm-conventions.md); a recipe vLLM CPU cannot run at all is reported as an expected failure naming
the reason, and any other failure fails. What vLLM CPU itself does with each export on each kind of CPU (runs,
refuses, wrong outputs) must be what ``shardcal recipes`` says (shardcal.export.consumers).

"Computes the same" is measured against what quantization itself moves: the mean |logprob difference| between vLLM
and shardcal's reload must stay under :data:`CLOSE` of the mean |difference| between that reload and the float
model. Kernel-level rounding (per-token scales, ties) stays far below that; a convention broken on purpose (nvfp4
global scales or fp8 weight scales not shared across q/k/v and gate/up, the bug of issue 44) lands near 1, and the
tests at the end check that this module sees it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardcal.calib.recipes import load_recipe, shipped_recipes
from shardcal.calib.runner import calibrate
from shardcal.export import export_checkpoint
from shardcal.export.consumers import CPU_ISAS, deployment
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import fused
from shardcal.quant.kv_cache import kv_cache_quantizers

from _tiny_models import TINY_CONFIGS

VLLM_PYTHON = os.environ.get("SHARDCAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="the vLLM check runs with `make test-vllm` (SHARDCAL_VLLM_PYTHON)"),
]

ROOT = Path(__file__).resolve().parents[2]
#: vLLM's distance from shardcal's reload, as a fraction of the reload's distance from the float model.
CLOSE = 0.2
#: A Llama vLLM CPU runs (head_dim 64: its attention kernel's smallest but one) and every recipe fits (in_features
#: 256 / 512: groups of 128, nvfp4 blocks, Hadamard blocks).
CONFIG = {
    **TINY_CONFIGS["llama"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "torch_dtype": "float32",
}
PROMPTS = torch.randint(3, 512, (8, 64), generator=torch.Generator().manual_seed(1))
CALIBRATION = torch.randint(3, 512, (16, 64), generator=torch.Generator().manual_seed(2))
#: How tools/vllm_run.py runs vLLM for each kind of CPU the chooser judges: this machine's own (with AVX-512), and
#: held to AVX2.
RUN_AS = {"avx512": "native", "avx2": "avx2"}
#: Exports made with a fused-layer convention broken on purpose (the rule says "nothing is shared"): the check must
#: tell them apart.
BROKEN = {"nvfp4-unshared": "nvfp4", "fp8-unshared": "fp8"}


def _vllm_run():
    spec = importlib.util.spec_from_file_location("vllm_run", ROOT / "tools" / "vllm_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_llama(folder: Path) -> Path:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def _export(model_dir: Path, recipe: str, out: Path) -> Path:
    model = from_pretrained(model_dir)
    calibrate(model, CALIBRATION, recipe, batch_size=4, progress=False, sqnr_tokens=0)
    export_checkpoint(model, out)
    return out


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """Every shipped recipe exported from the tiny Llama (and the broken exports), and what vLLM made of each."""
    work = tmp_path_factory.mktemp("vllm")
    model_dir = _tiny_llama(work / "float")
    exports = {"float": model_dir}
    for recipe in shipped_recipes():
        exports[recipe] = _export(model_dir, recipe, work / recipe)
    with pytest.MonkeyPatch.context() as patch:  # the rule broken: no fused layer shares anything
        patch.setattr(fused, "shares_range", lambda spec, role: False)
        for name, recipe in BROKEN.items():
            exports[name] = _export(model_dir, recipe, work / name)
    runs = [{"name": n, "model": str(d), "dtype": "float32", "wna16_dtype": "bfloat16"} for n, d in exports.items()]
    vllm_run = _vllm_run()
    results = {isa: vllm_run.run_vllm(VLLM_PYTHON, PROMPTS.tolist(), runs, work, timeout=3000, isa=RUN_AS[isa])
               for isa in CPU_ISAS}  # fmt: skip
    return types.SimpleNamespace(
        exports=exports, runs={isa: r["runs"] for isa, r in results.items()},
        machine={isa: r["machine"] for isa, r in results.items()}, vllm_run=vllm_run,
    )  # fmt: skip


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(PROMPTS).float(), dim=-1)
    return lp[:, :-1].gather(-1, PROMPTS[:, 1:, None])[..., 0]


def _round_toward_zero_fp8(self, x: torch.Tensor) -> torch.Tensor:
    """vLLM CPU's FP8 KV-cache writer as issue 44 measured it: ``x / scale`` rounded toward zero to float8_e4m3fn."""
    scale = self.amax.float() / 448.0
    y = torch.clamp(x.float() / scale, -448.0, 448.0)
    nearest = y.to(torch.float8_e4m3fn)
    over = nearest.float().abs() > y.abs()  # rounded away from zero: one magnitude code down (sign-magnitude codes)
    codes = nearest.view(torch.uint8) - over.to(torch.uint8)
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _shardcal_reload(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """shardcal's fake-quant model of the export; its FP8 KV cache written as vLLM CPU writes it."""
    model = from_pretrained(path, dtype=dtype)
    for _, kv in kv_cache_quantizers(model):
        for q in (kv.k_quantizer, kv.v_quantizer):
            q.forward = types.MethodType(_round_toward_zero_fp8, q)
    return model


def _distances(judged, name: str, isa: str = "avx512") -> tuple[float, float]:
    """``(mean |vLLM - reload|, mean |reload - float|)`` of the prompt logprobs."""
    run = judged.runs[isa][name]
    dtype = getattr(torch, run["dtype"])
    reload = _logprobs(_shardcal_reload(judged.exports[name], dtype))
    reference = _logprobs(from_pretrained(judged.exports["float"], dtype=dtype))
    vllm = torch.tensor(run["logprobs"])
    return float((vllm - reload).abs().mean()), float((reload - reference).abs().mean())


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_the_float_model_computes_alike(judged, isa):
    """The harness compares the same tokens: vLLM's float32 Llama equals shardcal's (as on either CPU)."""
    run = judged.runs[isa]["float"]
    assert "error" not in run, run.get("error")
    ours = _logprobs(from_pretrained(judged.exports["float"]))
    assert torch.allclose(torch.tensor(run["logprobs"]), ours, atol=1e-4)


def _skip_without_avx512(judged, isa: str) -> None:
    if isa == "avx512" and not judged.machine[isa]["avx512"]:
        pytest.skip("this machine has no AVX-512: its vLLM CPU verdicts are checked where CI has it")


@pytest.mark.parametrize("recipe", shipped_recipes())
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_vllm_cpu_runs_each_recipe_where_the_chooser_says(judged, isa, recipe):
    """What vLLM CPU itself does with each shipped recipe's export, on this machine's AVX-512 kernels and as on a CPU
    with AVX2 only (runs; refuses: an error, or a kernel it lacks; wrong outputs: a kernel that computes something
    else) is the verdict ``shardcal recipes`` and the export's warning give (shardcal.export.consumers)."""
    _skip_without_avx512(judged, isa)
    run = judged.runs[isa][recipe]
    if "error" in run and not any(piece in run["error"] for piece in judged.vllm_run.KNOWN_LIMITS):
        pytest.fail(f"vLLM could not run the {recipe} export: {run['error']}")
    said = deployment(load_recipe(recipe)).vllm_cpu[isa]
    assert judged.vllm_run.verdict(run) == said.status, (recipe, isa, run.get("references"), run.get("error"))


@pytest.mark.parametrize("recipe", shipped_recipes())
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_vllm_computes_what_shardcal_computes(judged, isa, recipe):
    _skip_without_avx512(judged, isa)
    status, note = judged.vllm_run.status(judged.runs[isa][recipe])
    if status == "unchecked":
        if not any(piece in judged.runs[isa][recipe]["error"] for piece in judged.vllm_run.KNOWN_LIMITS):
            pytest.fail(f"vLLM could not run the {recipe} export: {judged.runs[isa][recipe]['error']}")
        pytest.xfail(f"unchecked on this machine: {note}")
    to_vllm, quantization = _distances(judged, recipe, isa)
    assert quantization > 0
    assert to_vllm <= CLOSE * quantization, (
        f"{recipe}: vLLM {to_vllm:.3g} from shardcal, quantization {quantization:.3g}"
    )


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_check_sees_a_broken_fused_layer_convention(judged, name):
    """Without the shared ranges (issue 44's bug), vLLM's fused q/k/v and gate/up compute something else: the
    check above would fail. (The reload warns that vLLM will compute otherwise.)"""
    with pytest.warns(UserWarning, match="vLLM loads them as one fused layer"):
        to_vllm, quantization = _distances(judged, name)
    assert to_vllm > CLOSE * quantization
