"""Where each shipped recipe's export runs (shardcal.export.consumers), checked against the real transformers.

Every shipped recipe calibrates a tiny Llama, is exported, and transformers + compressed-tensors loads it: a recipe
said to run there must give exactly shardcal's logits; one said to be close, logits within its own quantization
error of shardcal's; one said to be refused, an exception; one said to compute wrong outputs (online rotations),
logits far beyond the quantization error — the silent failure ``shardcal recipes`` and the export warn about.
vLLM's side is checked by ``make test-vllm`` (vLLM's CPU build, in a venv of its own).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from shardcal.calib.recipes import load_recipe, shipped_recipes
from shardcal.calib.runner import calibrate
from shardcal.export import export_checkpoint
from shardcal.export.consumers import BF16_ONLY, CLOSE, REFUSES, RUNS, WRONG, deployment
from shardcal.models import CausalLM, ModelConfig

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(TINY_CONFIGS["llama"], hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2)  # fmt: skip
DATA = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
PROMPTS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))


def _transformers_logits(out) -> torch.Tensor:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            return hf(PROMPTS).logits


#: Recipes beyond the shipped ones whose verdict hangs on the order of the rules: the residual rotation alone (folded
#: into the weights: nothing online, so transformers runs it), and NVFP4 with an FP8 KV cache (NVFP4's refusal wins).
UNSHIPPED = {
    "residual-rotation-only": 'name = "res"\n[weight]\nformat = "int8"\ngranularity = "channel"\n'
    '[input]\nformat = "int8"\ngranularity = "tensor"\n[rotation]\nresidual = "hadamard"\n',
    "nvfp4-kv": '[weight]\nformat = "nvfp4"\n[input]\nformat = "nvfp4"\n[kv_cache]\nformat = "fp8_e4m3"\n',
}


def _unshipped(key: str, folder) -> str:
    path = folder / f"{key}.toml"
    path.write_text(UNSHIPPED[key] if UNSHIPPED[key].startswith("name") else f'name = "{key}"\n' + UNSHIPPED[key])
    return str(path)


@pytest.mark.parametrize("name", [*shipped_recipes(), *UNSHIPPED])
def test_transformers_does_what_the_recipe_says(name, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    if name in UNSHIPPED:
        name = _unshipped(name, tmp_path)
    verdict = deployment(load_recipe(name)).transformers
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    randomize_(model, seed=1)
    with torch.no_grad():
        full_precision = model(PROMPTS)
    calibrate(model, DATA, name, batch_size=4, progress=False)
    with torch.no_grad():
        ours = model(PROMPTS)
    export_checkpoint(model, tmp_path / "out", recipe=name)
    if verdict.status == REFUSES:
        with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises: it must not run
            _transformers_logits(tmp_path / "out")
        return
    theirs = _transformers_logits(tmp_path / "out")
    quantization_error = (ours - full_precision).abs().max().item()
    difference = (theirs - ours).abs().max().item()
    if verdict.status == RUNS:
        assert torch.equal(theirs, ours), difference
    elif verdict.status == CLOSE:
        assert 0 < difference <= 2 * quantization_error, (difference, quantization_error)
    else:
        assert verdict.status == WRONG and difference > 5 * quantization_error, (difference, quantization_error)


def test_the_deployment_cells_and_notes():
    """The chooser's three cells (vLLM GPU, vLLM CPU, transformers) and the notes name every limit and problem; a
    recipe runs everywhere only without any limit on GPUs and with transformers."""
    fp8 = deployment(load_recipe("fp8-dynamic"))
    assert fp8.everywhere and fp8.cells() == ("yes", "yes", "yes") and fp8.notes() == [] and fp8.failing() == []
    rotated = deployment(load_recipe("w4a16-gptq-rot"))
    assert not rotated.everywhere and rotated.cells() == ("TP 1", "no", "wrong")
    assert any("ignores its transform_config" in n for n in rotated.notes())
    assert any(n.startswith("vLLM CPU (AVX2 only): fails: it has no hadacore_transform") for n in rotated.notes())
    static = deployment(load_recipe("fp8"))
    assert static.cells() == ("yes", "no", "yes") and static.everywhere
    assert "static_scaled_fp8_quant" in static.vllm_cpu["avx512"].why
    kv = deployment(load_recipe("fp8-dynamic-kv"))
    assert kv.cells() == ("fp8 KV", "AVX-512", "close") and any("--kv-cache-dtype fp8" in n for n in kv.notes())
    assert kv.vllm_cpu["avx2"].status == REFUSES and "AVX-512 or AMX" in kv.vllm_cpu["avx2"].why
    asym = deployment(load_recipe("w4a16-awq-gptq-asym"))
    assert asym.cells() == ("yes", "AVX-512", "no") and not asym.everywhere
    int4 = deployment(load_recipe("w4a16-awq-gptq")).vllm_cpu
    assert int4["avx512"].limits == (BF16_ONLY,) and "cpu_gemm_wna16" in int4["avx2"].why
    int8 = deployment(load_recipe("w8a8-int8-dynamic-sq"))
    assert int8.cells() == ("yes", "AVX-512", "close") and int8.vllm_cpu["avx2"].status == WRONG
    w8a16 = deployment(load_recipe("w8a16"))  # vLLM CPU's weight-only GEMM: 4-bit only (make test-vllm checks it)
    assert w8a16.cells() == ("yes", "no", "yes") and "4-bit weights only" in w8a16.vllm_cpu["avx512"].why
    w4afp8 = deployment(load_recipe("w4afp8-gptq"))  # vLLM's W4A8-FP8 kernel: Hopper only; nothing on CPU
    assert w4afp8.cells() == ("Hopper", "no", "yes") and not w4afp8.everywhere
    assert "W4A8-FP8" in w4afp8.vllm_cpu["avx512"].why and "W4A8-FP8" in w4afp8.vllm_cpu["avx2"].why
    block = deployment(load_recipe("fp8-block"))  # vLLM CPU: AMX only (make test-vllm checks the refusal)
    assert block.cells() == ("yes", "no", "yes") and "AMX" in block.vllm_cpu["avx512"].why
    assert any("whole blocks" in n for n in block.notes()) and not block.everywhere
    for name, gpu in (("mxfp4", "Blackwell"), ("mxfp8", "Blackwell"), ("mxfp4a16", "yes")):  # MX: no CPU kernel
        mx = deployment(load_recipe(name))
        assert mx.cells() == (gpu, "no", "no") and "MX" in mx.vllm_cpu["avx2"].why and "MX" in mx.transformers.why
    nvfp4a16 = deployment(load_recipe("nvfp4a16-gptq"))  # FP4 weight-only kernels on most GPUs, none on CPU
    assert nvfp4a16.cells() == ("yes", "no", "no") and "NVFP4" in nvfp4a16.vllm_cpu["avx512"].why


def test_the_verdicts_of_recipes_beyond_the_shipped_ones(tmp_path):
    """The residual rotation alone rotates nothing online: it runs everywhere; NVFP4 with an FP8 KV cache is refused
    by transformers (NVFP4 fails first) and served by vLLM with both limits."""
    residual = deployment(load_recipe(_unshipped("residual-rotation-only", tmp_path)))
    assert residual.everywhere and residual.cells() == ("yes", "AVX-512", "yes")
    nvfp4_kv = deployment(load_recipe(_unshipped("nvfp4-kv", tmp_path)))
    assert nvfp4_kv.transformers.status == REFUSES and "NVFP4" in nvfp4_kv.transformers.why
    assert nvfp4_kv.cells() == ("Blackwell, fp8 KV", "no", "no")


@pytest.mark.parametrize("with_recipe", [True, False], ids=["recipe-given", "no-recipe"])
@pytest.mark.parametrize("name", ["w8a8-int8-sq-rot", "fp8-dynamic", "w4a16-awq-gptq-asym"])
def test_an_export_warns_once_naming_the_runtimes_that_fail(name, with_recipe, tmp_path):
    """The export says, once, which runtimes refuse it or compute something else with it — read from what it stores,
    so also without ``recipe=`` — and nothing when all of them serve it."""
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    randomize_(model, seed=1)
    calibrate(model, DATA, name, batch_size=4, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(model, tmp_path / "out", **({"recipe": name} if with_recipe else {}))
    said = [str(w.message) for w in caught if str(w.message).startswith(str(tmp_path / "out"))]
    failing = deployment(load_recipe(name)).failing()
    if not failing:
        assert said == []
        return
    expected = {
        "w8a8-int8-sq-rot": ["vLLM CPU (AVX-512)", "vLLM CPU (AVX2 only)", "transformers"],
        "w4a16-awq-gptq-asym": ["vLLM CPU (AVX2 only)", "transformers"],
    }
    assert [r.name for r in failing] == expected[name]
    by_name = {r.name: r for r in failing}
    if name == "w8a8-int8-sq-rot":  # vLLM's CPU build fails alike on both CPUs: named once
        parts = [f"vLLM CPU {by_name['vLLM CPU (AVX2 only)'].why}", f"transformers {by_name['transformers'].why}"]
    else:
        parts = [f"{n} {by_name[n].why}" for n in expected[name]]
    assert said == [f"{tmp_path / 'out'} will not serve everywhere: " + "; ".join(parts)]
