"""Dynamic per-token activation recipes (fp8-dynamic, w8a8-int8-dynamic): per-token fake quantization against plain
torch, no activation statistics collected, the observing pass stays full precision, export and exact reload."""

from __future__ import annotations

import pytest
import torch

from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import QuantizerSpec, TensorQuantizer, iter_quantizers

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.numerics

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)


def _model(seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model, seed=seed)
    return model.eval()


def _data(n: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _rows_with_outliers() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g)
    x[0, 1] *= 40.0  # one token 40x larger: it must not change the other tokens' scales
    return x


def test_fp8_per_token_matches_plain_torch():
    x = _rows_with_outliers()
    q = TensorQuantizer(QuantizerSpec("fp8_e4m3", "token", dynamic=True), (64,))
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    want = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert q.amax is None and torch.equal(q(x), want)


def test_int8_per_token_matches_plain_torch():
    x = _rows_with_outliers()
    q = TensorQuantizer(QuantizerSpec("int8", "token", dynamic=True), (64,))
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0  # vLLM's per-token rule
    want = torch.round(x / scale).clamp(-128, 127) * scale
    assert torch.equal(q(x), want)
    assert torch.equal(q(x[0, 0]), want[0, 0])  # any number of leading dims


def test_one_input_is_quantized_once_for_quantizers_of_one_spec(monkeypatch):
    """q / k / v input quantizers see one tensor: the first result is reused, never a stale one."""
    import shardcal.quant.quantizer as quantizer

    calls = []
    real = quantizer.fake_quantize
    monkeypatch.setattr(quantizer, "fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))

    def plain_fp8(x):  # large enough for the table path of the fp8 conversion
        scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    spec = QuantizerSpec("fp8_e4m3", "token", dynamic=True)
    q, k, v = (TensorQuantizer(spec, (64,)) for _ in range(3))
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert all(torch.equal(out, plain_fp8(x)) for out in (q(x), k(x), v(x))) and len(calls) == 1
        x.mul_(3.0)  # the input changed in place: quantized again
        assert torch.equal(q(x), plain_fp8(x)) and len(calls) == 2
        k(x).add_(1.0)  # a result changed in place is not handed out again
        assert torch.equal(v(x), plain_fp8(x)) and len(calls) == 3
        int8 = TensorQuantizer(QuantizerSpec("int8", "token", dynamic=True), (64,))
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
        assert torch.equal(int8(x), torch.round(x / scale).clamp(-128, 127) * scale) and len(calls) == 4
        y = x.clone()  # equal values, another tensor
        assert torch.equal(q(y), plain_fp8(x)) and len(calls) == 5
    x.requires_grad_(True)  # autograd: every call its own result
    q(x), k(x)
    assert len(calls) == 7


def test_one_input_is_quantized_once_for_static_quantizers_of_one_range(monkeypatch):
    import shardcal.quant.quantizer as quantizer

    calls = []
    real = quantizer.fake_quantize
    monkeypatch.setattr(quantizer, "fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(3))
    spec = QuantizerSpec("int8")
    q, k, v = (TensorQuantizer(spec, (64,)) for _ in range(3))
    for quant in (q, k):
        quant.set_amax(torch.tensor([2.5]))
    v.set_amax(torch.tensor([3.0]))

    def plain(amax):
        return torch.round(x / (amax / 127)).clamp(-128, 127) * (amax / 127)

    with torch.no_grad():
        assert torch.equal(q(x), plain(2.5)) and torch.equal(k(x), plain(2.5)) and len(calls) == 1
        assert torch.equal(v(x), plain(3.0)) and len(calls) == 2  # another amax
        k.set_amax(torch.tensor([3.0]))
        assert torch.equal(k(x), plain(3.0)) and len(calls) == 2  # now the same as v's
        weight = torch.nn.Parameter(x[0].clone())
        w1, w2 = TensorQuantizer(spec, weight.shape), TensorQuantizer(spec, weight.shape)
        w1.set_amax(torch.tensor([2.5]))
        w2.set_amax(torch.tensor([2.5]))
        w1(weight), w2(weight)
        assert len(calls) == 4  # parameters are not kept


def test_token_granularity_needs_dynamic_and_is_for_inputs_only():
    from shardcal.errors import RecipeError
    from shardcal.runtime.params import SpecError

    with pytest.raises(SpecError, match="dynamic = true"):
        QuantizerSpec("int8", "token")
    with pytest.raises(RecipeError, match=r"dyn\.toml: key 'weight\.granularity'"):
        parse_recipe('[weight]\nformat = "int8"\ngranularity = "token"\n', "dyn.toml")
    with pytest.raises(RecipeError, match=r"key 'input\.observer'"):
        parse_recipe(
            '[weight]\nformat = "int8"\n[input]\nformat = "int8"\ngranularity = "token"\ndynamic = true\nobserver = "max"\n',
            "dyn.toml",
        )


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "w8a8-int8-dynamic"])
def test_no_activation_statistics_and_a_full_precision_observing_pass(recipe):
    """The input quantizers never observe (no collect mode, no amax); layer 1 gets exactly the FP outputs of
    layer 0 (the dynamic quantizers are off during the observing pass)."""
    data = _data()
    reference = _model()
    seen_fp: list[torch.Tensor] = []
    hook = reference.model.layers[1].register_forward_pre_hook(lambda m, args: seen_fp.append(args[0].clone()))
    with torch.no_grad():
        reference(data[:2])
        reference(data[2:])
    hook.remove()

    model = _model()
    modes: list[str] = []
    seen: list[torch.Tensor] = []

    def watch(module: torch.nn.Module) -> None:
        for _, q in iter_quantizers(module):
            if q.spec.dynamic:
                q.register_forward_pre_hook(lambda m, args: modes.append(m.mode.value))

    original = load_recipe(recipe)
    calls = model.model.layers[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    report = calibrate(model, data, original, batch_size=2, progress=False)
    calls.remove()
    watch(model)
    with torch.no_grad():
        model(data[:1])
    assert "collect" not in modes and modes  # the hooks see the quantizers quantize afterwards
    for _, q in iter_quantizers(model):
        if q.spec.dynamic:
            assert q.amax is None and q.num_observed is None
    inputs = [q for n, q in report.layers[0].quantizers.items() if n.endswith("input_quantizer")]
    assert inputs and all(s == {"dynamic": True} for s in inputs)
    assert torch.equal(seen[0], seen_fp[0]) and torch.equal(seen[1], seen_fp[1])


def _rows_seen_by_layer_1(model: CausalLM, data: torch.Tensor, recipe: str, **options) -> tuple[int, object]:
    rows: list[int] = []
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    report = calibrate(model, data, load_recipe(recipe), batch_size=2, progress=False, **options)
    hook.remove()
    return sum(rows), report


def test_a_recipe_that_observes_nothing_runs_only_the_sqnr_sequences():
    """Round to nearest with dynamic inputs reads no statistic from the data: only the SQNR sequences (the first 2
    of 8 here) pass through the layers, and the result is the one those sequences alone give. A recipe with static
    inputs, or an MoE model (its report counts every token's routing), runs all of them."""
    data = _data(n=8)
    model = _model()
    seen, report = _rows_seen_by_layer_1(model, data, "fp8-dynamic", sqnr_tokens=32)
    assert seen == 2 * 2  # the observing pass and the SQNR pass, on the 2 sequences
    assert report.num_tokens == 8 * 16 and report.num_batches == 4  # the report describes the user's data
    alone = _model()
    _, want = _rows_seen_by_layer_1(alone, data[:2], "fp8-dynamic", sqnr_tokens=32)
    assert [r.sqnr_db for r in report.layers] == [r.sqnr_db for r in want.layers]
    for (name, q), (_, r) in zip(iter_quantizers(model), iter_quantizers(alone)):
        if q.amax is not None:
            assert torch.equal(q.amax, r.amax), name
    for name, p in model.named_parameters():  # weights: per-channel max scales of the weights themselves
        if name.endswith("proj.weight"):
            q = dict(iter_quantizers(model))[name.replace(".weight", ".weight_quantizer")]
            assert torch.equal(q.amax.reshape(-1), p.detach().abs().amax(dim=1)), name
    assert report.layer_tokens == 2 * 16 and report.data_free
    none, off = _rows_seen_by_layer_1(third := _model(), data, "fp8-dynamic", sqnr_tokens=0)
    assert none == 0 and off.layer_tokens == 0 and off.data_free  # no SQNR sample: no forward of any layer at all
    assert [r.sqnr_db for r in off.layers] == [None] * len(off.layers)
    for (name, q), (_, r) in zip(iter_quantizers(model), iter_quantizers(third)):
        if q.amax is not None and name.endswith("weight_quantizer"):
            assert torch.equal(q.amax, r.amax), name  # the same weights' scales
    assert _rows_seen_by_layer_1(_model(), data, "fp8", sqnr_tokens=32)[0] >= 8  # static inputs observe every row
    moe = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS["qwen2_moe"], num_hidden_layers=2)))
    randomize_(moe, seed=0)
    assert _rows_seen_by_layer_1(moe.eval(), data, "fp8-dynamic", sqnr_tokens=32)[0] >= 8
