"""Layer-wise PTQ algorithms (SmoothQuant, GPTQ, AWQ) inside calibrate: function-preserving folding, GPTQ beating
round-to-nearest, world-size independence on FSDP2-sharded models (gloo), resume, export round trip, recipes."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after
from torch import nn

from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import NumericsError, RecipeError
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import QuantizerSpec, TensorQuantizer, iter_quantizers, set_quantizer_mode
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

LLAMA = dict(TINY_CONFIGS["llama"], num_hidden_layers=3)


def _model(cfg: dict = LLAMA, seed: int = 0, outliers: bool = False) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=seed)
    if outliers:  # a few hidden channels 30x larger, as in real LLMs: per-tensor int8 inputs suffer
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight[:3] *= 30.0
                layer.post_attention_layernorm.weight[5:7] *= 30.0
    return model.eval()


def _data(n: int = 5, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _recipe(algorithm: str, weight_only: bool = True, **params) -> object:
    """A test recipe: int4 groups of 32 weight-only (tiny hidden sizes; ``symmetric=False``: asymmetric), W8A8 int8
    per-tensor inputs, or (``nvfp4=True``) nvfp4 weights and inputs."""
    symmetric = params.pop("symmetric", True)
    nvfp4 = params.pop("nvfp4", False)  # nvfp4 weights and inputs instead
    extra = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in params.items())
    if nvfp4:
        quant = '[weight]\nformat = "nvfp4"\n[input]\nformat = "nvfp4"\n'
    elif weight_only:
        quant = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\nobserver = "mse"\n'
        quant += "" if symmetric else "symmetric = false\n"
    else:
        quant = '[weight]\nformat = "int8"\ngranularity = "channel"\naxis = 0\n[input]\nformat = "int8"\n'
    return parse_recipe(
        f'name = "t-{algorithm}"\n{quant}[algorithm]\nname = "{algorithm}"\n{extra}', f"t-{algorithm}.toml"
    )


def _logits(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(data)


# ------------------------------------------------------------------------------------ SmoothQuant


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen2_moe", "mixtral"])
def test_smoothquant_folding_keeps_the_fp_function(model_type):
    cfg = dict(TINY_CONFIGS[model_type], num_hidden_layers=2)
    data = _data()
    want = _logits(_model(cfg, outliers=model_type == "llama"), data)
    model = _model(cfg, outliers=model_type == "llama")
    norms = [layer.input_layernorm.weight.detach().clone() for layer in model.model.layers]
    calibrate(model, data, _recipe("smoothquant", weight_only=False), batch_size=2, progress=False)
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norms[0])  # something was folded
    set_quantizer_mode(model, "disabled")
    got = _logits(model, data)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_smoothquant_pairs_and_gqa_v_o_mapping():
    from shardcal.algorithms.mappings import layer_smoothings

    model = _model(dict(LLAMA, num_attention_heads=4, num_key_value_heads=2))
    layer = model.model.layers[0]
    pairs = {m.kind: m for m in layer_smoothings(layer)}
    assert set(pairs) == {"attn_in", "v_o", "mlp_in", "up_down"}
    v_o = pairs["v_o"]
    assert v_o.index.tolist()[:16] == list(range(16))  # query head 0 reads kv head 0
    assert v_o.index.tolist()[16:32] == list(range(16))  # query head 1 too (2 query heads per kv head)
    assert v_o.index.tolist()[32:48] == list(range(16, 32))  # query head 2 reads kv head 1


def test_layer_without_known_pairs_warns_and_is_left_alone():
    from types import SimpleNamespace

    from shardcal.algorithms.smoothquant import SmoothQuant
    from shardcal.calib.attach import quantize_modules

    layer = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    quantize_modules(layer, _recipe("smoothquant", weight_only=False), prefix="blocks.0")
    with pytest.warns(UserWarning, match="no foldable"):
        assert SmoothQuant().smoothings(SimpleNamespace(layer=layer, name="blocks.0")) == []


def test_smoothquant_reduces_w8a8_error_with_outlier_channels():
    data = _data(n=8)
    want = _logits(_model(outliers=True), data)
    errors = {}
    for algorithm in ("rtn", "smoothquant"):
        model = _model(outliers=True)
        calibrate(model, data, _recipe(algorithm, weight_only=False), batch_size=4, progress=False)
        errors[algorithm] = (_logits(model, data) - want).pow(2).mean().item()
    assert errors["smoothquant"] < 0.5 * errors["rtn"], errors


def _input_max(
    model: nn.Module, data: torch.Tensor, batch_size: int, chosen: Callable[[str, nn.Module], bool]
) -> dict[str, float]:
    """Per ``chosen`` module: max |x| of its input over ``data`` in the model's own full-precision forward
    (quantizers off) — what a max observer would record."""
    found: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda m, args, n=n: found.__setitem__(n, max(found.get(n, 0.0), args[0].abs().max().item()))
        )
        for n, m in model.named_modules()
        if chosen(n, m)
    ]
    set_quantizer_mode(model, "disabled")
    with torch.no_grad():
        for batch in data.split(batch_size):
            model(batch)
    for h in hooks:
        h.remove()
    set_quantizer_mode(model, "quantize")
    return found


def _consumer_input_max(model: nn.Module, data: torch.Tensor, batch_size: int) -> dict[str, float]:
    """:func:`_input_max` of every Linear with an input quantizer."""
    return _input_max(model, data, batch_size, lambda n, m: getattr(m, "input_quantizer", None) is not None)


def _count_layer_calls(model: nn.Module) -> dict[int, int]:
    """Decoder layer index -> how often it runs from now on (a forward pre-hook that stays)."""
    counts: dict[int, int] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
    return counts


@pytest.mark.parametrize("alpha_grid", [[], [0.5, 0.9]])
def test_smoothquant_input_amax_is_the_smoothed_inputs_max_in_one_pass(alpha_grid):
    """Static per-tensor max inputs of smoothed Linears take ``max_j act_max_j / s_j`` from SmoothQuant's own
    statistics: equal to what observing the smoothed model's inputs gives, and the layer runs over the data as often
    as under round to nearest (one pass, plus the SQNR batch)."""
    data = _data(n=8)
    calls: dict[str, dict[int, int]] = {}
    for algorithm in ("rtn", "smoothquant"):
        model = _model(outliers=True)
        calls[algorithm] = _count_layer_calls(model)
        params = {"alpha_grid": alpha_grid} if alpha_grid and algorithm == "smoothquant" else {}
        calibrate(model, data, _recipe(algorithm, weight_only=False, **params), batch_size=4, progress=False)
    assert calls["smoothquant"] == calls["rtn"], calls
    observed = _consumer_input_max(model, data, 4)
    assert len(observed) == 7 * LLAMA["num_hidden_layers"]
    for name, want in observed.items():
        got = model.get_submodule(name).input_quantizer.amax.item()
        assert got == pytest.approx(want, rel=1e-5), name


def test_smoothquant_kept_outputs_are_dropped_before_an_observing_pass(monkeypatch):
    """A percentile input observer still needs the observing passes: the outputs SmoothQuant's statistics pass kept
    are freed before them (never two sets of a layer's outputs alive)."""
    import weakref

    from shardcal.algorithms.stats import InputStats
    from shardcal.quant import QuantMode

    kept: list[list[weakref.ref]] = []
    alive_while_observing: list[int] = []
    collect = InputStats.collect

    def spy(self, step, keep_outputs=False):
        out = collect(self, step, keep_outputs)
        if keep_outputs:
            kept.append([weakref.ref(t) for t in step.outputs])
        return out

    def check(module, args):
        if module.input_quantizer.mode is QuantMode.COLLECT and kept:
            alive_while_observing.append(sum(r() is not None for r in kept[-1]))

    monkeypatch.setattr(InputStats, "collect", spy)
    model = _model(outliers=True)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(check)
    recipe = parse_recipe(
        'name = "t"\n[weight]\nformat = "int8"\ngranularity = "channel"\naxis = 0\n'
        '[input]\nformat = "int8"\nobserver = { name = "percentile", percentile = 99.0 }\n'
        '[algorithm]\nname = "smoothquant"\n',
        "t.toml",
    )
    calibrate(model, _data(n=8), recipe, batch_size=4, progress=False)
    assert len(kept) == LLAMA["num_hidden_layers"]
    assert alive_while_observing and set(alive_while_observing) == {0}, alive_while_observing


# ------------------------------------------------------------------------------------ GPTQ


def _correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5
    return torch.randn(n, dim, generator=g) @ mix + 0.5 * torch.randn(n, 1, generator=g) + torch.randn(dim, generator=g)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(act_order):
    from shardcal.algorithms.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=g) * 0.05
    x = _correlated_inputs(4096, 256)
    quantizer = TensorQuantizer(QuantizerSpec("int4", "group", group_size=128, observer="mse"), (96, 256))
    quantizer.calibrate_from(weight)
    amax = quantizer.amax.clone()
    q = gptq_quantize(weight, x.double().T @ x.double(), quantizer, act_order=act_order, static_groups=True)
    rtn = quantizer(weight)
    err = lambda w: (x @ (w - weight).T).pow(2).sum().item()
    assert err(q) < 0.8 * err(rtn), (err(q), err(rtn))
    assert torch.equal(quantizer(q), q)  # static groups: the quantizer's scales reproduce GPTQ's result exactly
    assert torch.equal(quantizer.amax, amax)


def test_gptq_dead_columns_and_unseen_expert_round_to_nearest():
    from shardcal.algorithms.gptq_solve import gptq_quantize

    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    quantizer = TensorQuantizer(QuantizerSpec("int4", "group", group_size=32), (8, 64))
    quantizer.calibrate_from(weight)
    assert torch.equal(gptq_quantize(weight, torch.zeros(64, 64), quantizer, static_groups=True), quantizer(weight))
    x = _correlated_inputs(512, 64)
    x[:, 10] = 0.0
    q = gptq_quantize(weight, x.T @ x, quantizer, static_groups=True)
    assert torch.equal(q[:, 10], quantizer(weight)[:, 10]) and torch.isfinite(q).all()


def test_gptq_damping_grows_tenfold_until_positive_definite():
    """An indefinite Hessian (eigenvalue -0.05, mean diagonal 0.65): percdamp 0.01 adds 0.0065 and 0.1 adds 0.065,
    the first positive definite one; a Hessian no damping of the schedule fixes is an error."""
    from shardcal.algorithms.gptq_solve import DAMPING_TRIES, gptq_quantize

    weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    quantizer = TensorQuantizer(QuantizerSpec("int8", "channel", axis=0), (4, 3))
    quantizer.calibrate_from(weight)
    info: dict = {}
    q = gptq_quantize(weight, torch.diag(torch.tensor([1.0, 1.0, -0.05])), quantizer, percdamp=0.01, info=info)
    assert info == {"damping": pytest.approx(0.1)} and torch.isfinite(q).all()
    gptq_quantize(weight, torch.eye(3), quantizer, percdamp=0.01, info=info)
    assert info == {"damping": 0.01}
    hopeless = torch.diag(torch.tensor([1.0, 1.0, -(10.0**DAMPING_TRIES)]))  # mean diagonal < 0: no damping helps
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite even with damping"):
        gptq_quantize(weight, hopeless, quantizer, percdamp=0.01)


def _gptq_with_indefinite_hessians(shift: float) -> dict:
    """GPTQ on 2 sharded ranks where down_proj's Hessians get ``-shift`` on their diagonal (an indefinite Hessian,
    as bf16 round-off can make): the schedule's damping is reported per Linear, or the run stops naming it."""
    from shardcal.algorithms import gptq_solve

    solve = gptq_solve._upper_cholesky_of_inverse

    def shifted(h: torch.Tensor):
        if h.shape[0] == LLAMA["intermediate_size"]:  # only down_proj's input has this width
            h = h - shift * torch.eye(h.shape[0], dtype=h.dtype)
        return solve(h)

    gptq_solve._upper_cholesky_of_inverse = shifted
    model = _model(dict(LLAMA, num_hidden_layers=2))
    fsdp2_wrap(model)
    try:
        report = calibrate(model, _data(n=4), _recipe("gptq"), batch_size=2, progress=False)
    except NumericsError as exc:
        return {"error": str(exc)}
    finally:
        gptq_solve._upper_cholesky_of_inverse = solve  # the worker process is reused
    return {"damping": [layer_report.algorithm["gptq_damping"] for layer_report in report.layers]}


def test_gptq_indefinite_hessian_reported_or_named_on_every_rank():
    from shardcal.algorithms.gptq_solve import DAMPING_TRIES

    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj")
    linears += ("mlp.up_proj", "mlp.down_proj")
    for r in run_on_ranks(2, _gptq_with_indefinite_hessians, 1e6):
        assert r == {"error": r["error"]} and r["error"].startswith("model.layers.0.mlp.down_proj: GPTQ cannot")
        assert f"{10.0 ** (DAMPING_TRIES - 3):g}" in r["error"]  # the last damping tried: 0.01 x 10^5
    (first, second) = run_on_ranks(2, _gptq_with_indefinite_hessians, 0.0)
    for layer, damping in enumerate(first["damping"]):
        assert damping == {f"model.layers.{layer}.{n}": 0.01 for n in sorted(linears)}
    assert first == second


@pytest.mark.parametrize("act_order", [False, True])
def test_asymmetric_gptq_beats_asymmetric_rtn_and_symmetric_gptq(act_order):
    """On weights whose groups are off-centre, asymmetric int4 (zero points) beats symmetric int4, with GPTQ as with
    round to nearest, and GPTQ's result is reproduced exactly by the quantizer's calibrated range."""
    from shardcal.algorithms.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 256, generator=g) * 0.05 + torch.rand(96, 1, generator=g) * 0.1
    x = _correlated_inputs(4096, 256)
    hessian = x.double().T @ x.double()
    err = lambda w: (x @ (w - weight).T).pow(2).sum().item()
    errors = {}
    for symmetric in (True, False):
        spec = QuantizerSpec("int4", "group", group_size=64, observer="mse", symmetric=symmetric)
        quantizer = TensorQuantizer(spec, (96, 256))
        quantizer.calibrate_from(weight)
        errors["rtn", symmetric] = err(quantizer(weight))
        q = gptq_quantize(weight, hessian, quantizer, act_order=act_order)
        errors["gptq", symmetric] = err(q)
        assert torch.equal(quantizer(q), q)
    assert errors["gptq", False] < 0.8 * errors["rtn", False], errors
    assert errors["gptq", False] < errors["gptq", True] and errors["rtn", False] < errors["rtn", True], errors


@pytest.mark.parametrize("options", [{}, {"act_order": True}, {"static_groups": True}])
def test_nvfp4_gptq_beats_round_to_nearest_and_exports_its_own_blocks(options):
    """FP4-aware GPTQ: each block of 16 columns is rounded to E2M1 with the FP8 block scale of its columns as
    updated so far; the quantizer, which derives block scales from the weight it gets, reproduces the result, and
    the global amax is kept. Reference: the output error of round to nearest (the quantizer on the weight)."""
    from shardcal.algorithms.gptq_solve import gptq_quantize
    from shardcal.quant.formats import E2M1_MAX, nvfp4_global_scale

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=g) * 0.05
    x = _correlated_inputs(4096, 256)
    quantizer = TensorQuantizer(QuantizerSpec("nvfp4"), (96, 256))
    quantizer.calibrate_from(weight)
    amax = quantizer.amax.clone()
    info: dict = {}
    q = gptq_quantize(weight, x.double().T @ x.double(), quantizer, info=info, **options)
    err = lambda w: (x @ (w - weight).T).pow(2).sum().item()
    assert err(q) < 0.4 * err(quantizer(weight)), (err(q), err(quantizer(weight)))  # 0.25-0.27 measured
    assert torch.equal(quantizer(q), q) and torch.equal(quantizer.amax, amax)
    assert 0.0 <= info["nvfp4_requantized"] < 0.01
    # every value is an E2M1 code times its block's scale: at most 8 magnitudes per block of 16
    blocks = q.reshape(96, 16, 16).abs()
    scale = blocks.amax(dim=-1, keepdim=True) / E2M1_MAX
    codes = blocks / scale
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.allclose(codes, grid[(codes.unsqueeze(-1) - grid).abs().argmin(-1)], atol=1e-5)
    assert float(nvfp4_global_scale(amax)) == pytest.approx(448 * 6 / float(weight.abs().max()))


def test_nvfp4_gptq_refuses_scale_refits_and_hessian_scale_search():
    for extra in ("refit_scales = 1", 'scale_search = "hessian"'):
        recipe = parse_recipe(f'[weight]\nformat = "nvfp4"\n[algorithm]\nname = "gptq"\n{extra}\n', "t.toml")
        with pytest.raises(RecipeError, match="nvfp4 block scales follow the weight"):
            calibrate(_model(), _data(n=2), recipe, batch_size=2, progress=False)


def test_asymmetric_gptq_refuses_scale_refits():
    with pytest.raises(RecipeError, match="refit_scales needs symmetric weights"):
        calibrate(_model(), _data(n=2), _recipe("gptq", symmetric=False, refit_scales=1), batch_size=2,
                  progress=False)  # fmt: skip


def test_gptq_calibrate_defaults_to_qdq_and_beats_rtn():
    data = _data(n=8)
    want = _logits(_model(), data)
    errors, reports = {}, {}
    for algorithm in ("rtn", "gptq"):
        model = _model()
        reports[algorithm] = calibrate(model, data, _recipe(algorithm), batch_size=4, progress=False)
        errors[algorithm] = (_logits(model, data) - want).pow(2).mean().item()
    assert reports["gptq"].propagate == "qdq" and reports["rtn"].propagate == "fp"
    assert errors["gptq"] < 0.8 * errors["rtn"], errors
    assert all(
        layer_report.sqnr_db is not None and layer_report.sqnr_db < 60 for layer_report in reports["gptq"].layers
    )  # measured vs the FP layer


def test_gptq_rounding_sweeps_and_scale_refits_beat_plain_gptq():
    """On a tiny model with outlier channels: the output error of the quantized model, GPTQ with rounding sweeps and
    scale refits below plain GPTQ's, which is below round to nearest's."""
    data = _data(n=8)
    want = _logits(_model(outliers=True), data)
    errors = {}
    for label, algorithm, params in (
        ("rtn", "rtn", {}),
        ("gptq", "gptq", {"act_order": True}),
        ("tuned", "gptq", {"act_order": True, "refine_sweeps": 2, "refit_scales": 2}),
    ):
        model = _model(outliers=True)
        calibrate(model, data, _recipe(algorithm, **params), batch_size=4, progress=False)
        errors[label] = (_logits(model, data) - want).pow(2).mean().item()
    assert errors["tuned"] < errors["gptq"] < errors["rtn"], errors


@pytest.mark.parametrize("symmetric", [True, False])
def test_rounding_sweeps_lower_the_output_error_of_gptq(symmetric):
    """Rounding sweeps after GPTQ lower ``tr(E H E^T)`` on the Linear's inputs; asymmetric codes move inside their
    zero-point-shifted bounds, so the quantizer's calibrated range reproduces the swept weight exactly."""
    from shardcal.algorithms.gptq_solve import gptq_quantize
    from shardcal.algorithms.scales import refine_rounding

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 256, generator=g) * 0.05 + torch.rand(96, 1, generator=g) * 0.1
    x = _correlated_inputs(4096, 256)
    hessian = x.double().T @ x.double()
    err = lambda w: (x @ (w - weight).T).pow(2).sum().item()
    spec = QuantizerSpec("int4", "group", group_size=64, observer="mse", symmetric=symmetric)
    quantizer = TensorQuantizer(spec, (96, 256))
    quantizer.calibrate_from(weight)
    q = gptq_quantize(weight, hessian, quantizer, act_order=True)
    swept = refine_rounding(weight, q, quantizer, hessian.float(), 2)
    assert err(swept) < 0.99 * err(q), (err(swept), err(q))
    assert torch.equal(quantizer(swept), swept)


# ------------------------------------------------------------------------------------ AWQ


def test_awq_beats_rtn_and_keeps_the_fp_function_before_quantization():
    data = _data(n=8)
    want = _logits(_model(outliers=True), data)
    errors = {}
    for algorithm in ("rtn", "awq"):
        model = _model(outliers=True)
        calibrate(model, data, _recipe(algorithm), batch_size=4, progress=False)
        errors[algorithm] = (_logits(model, data) - want).pow(2).mean().item()
        if algorithm == "awq":
            set_quantizer_mode(model, "disabled")
            assert torch.allclose(_logits(model, data), want, rtol=1e-4, atol=1e-4)
    assert errors["awq"] < errors["rtn"], errors


# ------------------------------------------------------------------------------------ world size, resume


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {
        n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in model.named_parameters()
    }
    out.update({f"{n}.amax": q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None})
    out.update({f"{n}.amin": q.amin.detach().clone() for n, q in iter_quantizers(model) if q.amin is not None})
    return out


def _calibrated_states(cases: list[tuple[str, bool, str, dict]]) -> list[dict]:
    """Per (algorithm, weight_only, model_type, params): calibrate an FSDP2-wrapped tiny model; weights, amax, logits."""
    results = []
    for algorithm, weight_only, model_type, params in cases:
        cfg = dict(TINY_CONFIGS[model_type], num_hidden_layers=2)
        model = _model(cfg, outliers=model_type == "llama")
        fsdp2_wrap(model)
        report = calibrate(model, _data(n=5), _recipe(algorithm, weight_only, **params), batch_size=2, progress=False)
        results.append(
            dict(
                state=_state(model),
                logits=_logits(model, _data(n=2, seed=9)),
                sqnr=[layer_report.sqnr_db for layer_report in report.layers],
            )
        )
    return results


CASES = [
    ("gptq", True, "llama", {}),  # in-order group scales, broadcast from the solving rank
    ("gptq", True, "qwen2_moe", {"act_order": True}),  # static groups; experts see their routed tokens
    ("awq", True, "llama", {}),
    ("smoothquant", False, "llama", {"alpha_grid": [0.5, 0.7, 0.9]}),  # per-pair alpha from losses merged exactly
    ("smoothquant", False, "qwen2_moe", {}),
    ("gptq", False, "llama", {"smooth": '{ name = "smoothquant", alpha = 0.8 }'}),  # W8A8: SmoothQuant, then GPTQ
    # rounding sweeps and least-squares scale refits on the solving rank, amax broadcast
    ("gptq", True, "llama", {"act_order": True, "refine_sweeps": 1, "refit_scales": 1, "scale_search": '"hessian"'}),
    # asymmetric int4: AWQ's clip search and GPTQ's in-order group ranges (amax and amin broadcast)
    ("gptq", True, "llama", {"symmetric": False, "smooth": '{ name = "awq" }'}),
    (
        "gptq",
        True,
        "qwen2_moe",
        {"symmetric": False, "act_order": True, "scale_search": '"hessian"', "refine_sweeps": 1},
    ),
    # FP4-aware GPTQ: block scales from the updated columns on the solving rank (weights broadcast); static blocks
    ("gptq", True, "llama", {"nvfp4": True}),
    ("gptq", True, "qwen2_moe", {"nvfp4": True, "act_order": True}),
    ("gptq", True, "llama", {"nvfp4": True, "act_order": True, "smooth": '{ name = "smoothquant", alpha = 0.5 }'}),
    # the asymmetric objective: paired sums of the full-precision and the quantized stream, merged exactly; nvfp4
    # inputs calibrated first; MoE experts keep the plain Hessian, W8A8 with static per-tensor inputs
    ("gptq", True, "llama", {"nvfp4": True, "act_order": True, "stream_correction": 0.25}),
    ("gptq", False, "qwen2_moe", {"stream_correction": 0.5}),
    # static input scales from the merged Hessian pass (MoE experts observe their routed tokens after the solve)
    ("gptq", False, "qwen2_moe", {"input_amax": '"hessian-pass"'}),
]


def test_two_ranks_equal_one_rank_bit_exact():
    """Hessians, smoothing statistics and AWQ losses merge exactly: 3 batches split 2 + 1 give the same model."""
    (single,) = run_on_ranks(1, _calibrated_states, CASES)
    for rank_result in run_on_ranks(2, _calibrated_states, CASES):
        for case, want, got in zip(CASES, single, rank_result):
            assert want["state"].keys() == got["state"].keys()
            for name in want["state"]:
                assert torch.equal(want["state"][name], got["state"][name]), (case, name)
            assert torch.equal(want["logits"], got["logits"]), case
            assert want["sqnr"] == got["sqnr"], case


def _resume_run(directory: str, interrupt: int | None, params: dict | None = None, algorithm: str = "gptq") -> dict:
    model = _model(dict(LLAMA, num_hidden_layers=4), outliers=algorithm == "smoothquant")
    fsdp2_wrap(model)
    recipe = _recipe(algorithm, weight_only=algorithm != "smoothquant", **(params or {}))
    try:
        with interrupt_after(interrupt):
            calibrate(model, _data(n=6), recipe, batch_size=2, progress=False, checkpoint_dir=directory)
    except CalibrationInterrupted:
        return dict(interrupted=True)
    return dict(interrupted=False, state=_state(model), logits=_logits(model, _data(n=2, seed=9)))


@pytest.mark.parametrize(
    "params",
    [{}, {"act_order": True, "refine_sweeps": 1, "refit_scales": 1}, {"symmetric": False}, {"stream_correction": 0.5}],
)
def test_gptq_resume_is_bit_identical(tmp_path, params):
    """Changed weights (and refitted scales) are checkpointed: resumed on the same world size, or on another one
    (written by 2 ranks, resumed on 1 — each rank reassembles its new shard from the old ranks' rows)."""
    full = run_on_ranks(2, _resume_run, str(tmp_path / "a"), None, params)
    for resumed_on in (2, 1):
        folder = str(tmp_path / f"b{resumed_on}")
        assert all(r["interrupted"] for r in run_on_ranks(2, _resume_run, folder, 2, params))
        resumed = run_on_ranks(resumed_on, _resume_run, folder, None, params)
        for got in resumed:
            for name in full[0]["state"]:
                assert torch.equal(full[0]["state"][name], got["state"][name]), (resumed_on, name)
            assert torch.equal(full[0]["logits"], got["logits"])


def test_smoothquant_one_pass_resume_is_bit_identical(tmp_path):
    """SmoothQuant's one pass (kept outputs propagated, derived input amax) resumes bit-identically, on the same world
    size and on another one."""
    full = run_on_ranks(2, _resume_run, str(tmp_path / "a"), None, None, "smoothquant")
    for resumed_on in (2, 1):
        folder = str(tmp_path / f"b{resumed_on}")
        assert all(r["interrupted"] for r in run_on_ranks(2, _resume_run, folder, 2, None, "smoothquant"))
        for got in run_on_ranks(resumed_on, _resume_run, folder, None, None, "smoothquant"):
            for name in full[0]["state"]:
                assert torch.equal(full[0]["state"][name], got["state"][name]), (resumed_on, name)
            assert torch.equal(full[0]["logits"], got["logits"])


# ------------------------------------------------------------------------------------ stream correction


def test_corrected_weight_is_the_least_squares_map_to_the_fp_targets():
    """With the full step and a negligible damping, ``corrected_weight`` is the least-squares solution of
    ``Q W'^T = T W^T`` (torch.linalg.lstsq on the explicit token matrices); a fraction moves that far along; equal
    streams move nothing, whatever the damping."""
    from shardcal.algorithms.paired import corrected_weight

    g = torch.Generator().manual_seed(0)
    t = torch.randn(400, 12, dtype=torch.float64, generator=g) @ torch.randn(12, 12, dtype=torch.float64, generator=g)
    q = t + 0.1 * torch.randn(400, 12, dtype=torch.float64, generator=g)
    w = torch.randn(5, 12, generator=g)
    cqq, ctq = q.T @ q, t.T @ q
    expected = torch.linalg.lstsq(q, t @ w.double().T).solution.T
    assert torch.allclose(corrected_weight(w, cqq, ctq, 1.0, 1e-12).double(), expected, atol=1e-4)
    half = corrected_weight(w, cqq, ctq, 0.5, 1e-12).double()
    assert torch.allclose(half, w.double() + 0.5 * (expected - w.double()), atol=1e-4)
    assert torch.equal(corrected_weight(w, cqq, cqq, 1.0, 0.5), w)


def _linear_inputs(model: nn.Module, data: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Each named Linear's input rows (float64) in one forward of ``model`` over ``data``."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    hooks = [
        modules[n].register_forward_pre_hook(
            lambda m, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for n in names
    ]
    with torch.no_grad():
        model(data)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v).double() for n, v in seen.items()}


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 sums over the batches: within 1e-5 of the largest entry."""
    return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_paired_sums_pair_the_fp_model_with_the_quantized_stream(monkeypatch):
    """The sums GPTQ's correction reads, against hooks on two plain forwards: the untouched float model gives the
    targets ``T``, the calibrated (fake-quantized) model the stream ``X`` of the same tokens; at layer 0 the two
    streams are one, so ``C_qq`` is ``Q^T Q`` of the input quantizer's own fake quantization of ``T`` (amax: the
    largest ``|T|``); at layer 1 ``C_tq = T^T X`` for ``q_proj``, which reads the layer's input (weight-only: no input
    quantizer; deeper Linears see the layer's full-precision function on the stream, not the final model's)."""
    import copy

    from shardcal.algorithms import gptq as gptq_module
    from shardcal.quant.formats import fake_quantize

    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    real = gptq_module.corrected_weight

    def record(weight, cqq, ctq, fraction, percdamp):
        seen.setdefault(id(weight), []).append((cqq.clone(), ctq.clone()))
        return real(weight, cqq, ctq, fraction, percdamp)

    monkeypatch.setattr(gptq_module, "corrected_weight", record)
    data = _data(n=4)
    cfg = dict(LLAMA, num_hidden_layers=2)
    for weight_only, layer in ((False, 0), (True, 1)):
        model = _model(cfg, outliers=True)
        original = copy.deepcopy(model)
        names = [f"model.layers.{layer}.self_attn.q_proj"] + ([] if weight_only else ["model.layers.0.mlp.down_proj"])
        weights = {n: dict(model.named_parameters())[f"{n}.weight"] for n in names}
        seen.clear()
        calibrate(model, data, _recipe("gptq", weight_only, stream_correction=0.5), batch_size=2, progress=False)
        targets = _linear_inputs(original, data, names)
        stream = _linear_inputs(model, data, names)
        for n in names:
            ((cqq, ctq),) = seen[id(weights[n])]
            t = targets[n]
            if weight_only:
                x = stream[n]
                assert not torch.allclose(x, t, atol=1e-3)  # the streams differ after a quantized layer
                assert _near(ctq, t.T @ x) and _near(cqq, x.T @ x)
                assert not _near(ctq, t.T @ t)
            else:
                spec = QuantizerSpec(format="int8", granularity="tensor")
                q = fake_quantize(t.float(), t.abs().max().float().reshape(1), spec).double()
                assert _near(cqq, q.T @ q) and _near(ctq, t.T @ q)
                assert not _near(cqq, t.T @ t)


def test_stream_correction_rounds_the_moved_weight_with_its_own_scales():
    """The weight GPTQ rounds after the correction is ``W* = W + α W (C_tq - C_qq)(C_qq + λ I)^-1``, worked out here
    in float64 from hooks on the float model (``T``) and the calibrated one (``X``, through a hand int8 fake
    quantization: ``Q``); its per-channel int8 scales are calibrated on ``W*`` (max observer: ``max |W*|`` per row),
    not kept from ``W``, whose rows' maxima are percents away. q/k/v read the layer's input, the same in the final
    model as when the layer was calibrated."""
    import copy

    from shardcal.quant.formats import fake_quantize

    cfg = dict(LLAMA, num_hidden_layers=2)
    data = _data(n=4)
    model = _model(cfg, outliers=True)
    original = copy.deepcopy(model)
    calibrate(model, data, _recipe("gptq", False, stream_correction=0.5), batch_size=2, progress=False)
    names = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    targets, stream = _linear_inputs(original, data, names), _linear_inputs(model, data, names)
    spec = QuantizerSpec(format="int8", granularity="tensor")
    for name in names:
        t, x = targets[name], stream[name]
        q = fake_quantize(x.float(), x.abs().max().float().reshape(1), spec).double()
        cqq, ctq = q.T @ q, t.T @ q
        damped = cqq + 0.01 * cqq.diagonal().mean() * torch.eye(cqq.shape[0], dtype=torch.float64)
        w = original.get_submodule(name).weight.detach().double()
        moved = w + 0.5 * torch.linalg.solve(damped, (w @ (ctq - cqq)).T).T
        want = moved.abs().amax(dim=1)
        got = model.get_submodule(name).weight_quantizer.amax.reshape(-1).double()
        assert torch.allclose(got, want, rtol=1e-4, atol=0), name
        assert not torch.allclose(w.abs().amax(dim=1), want, rtol=1e-2, atol=0), name  # the correction moved them


def test_reference_stream_is_the_float_models_own_layer_inputs():
    """``layer_steps(reference_stream=True)`` hands each layer the hidden states the unquantized model's own forward
    gives it (hooks on a copy), while the propagated stream carries the quantized layers' outputs."""
    import copy

    from shardcal.calib.attach import quantize_modules
    from shardcal.layerwise.batches import model_batches
    from shardcal.layerwise.steps import layer_steps

    model = _model(dict(LLAMA, num_hidden_layers=3))
    original = copy.deepcopy(model)
    data = _data(n=4)
    expected: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: expected.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
        for layer in original.model.layers
    ]
    with torch.no_grad():
        original(data)
    for h in hooks:
        h.remove()
    recipe = _recipe("rtn")
    seen = []
    for step in layer_steps(model, model_batches(model, data, 4), propagate="qdq", reference_stream=True):
        quantize_modules(step.layer, recipe, prefix=step.name)  # int4 weights: the stream drifts from here on
        for module in step.layer.modules():
            if getattr(module, "weight_quantizer", None) is not None:
                module.weight_quantizer.calibrate_from(module.weight)
        seen.append((step.reference_inputs[0], step.inputs[0].hidden_states))
    for index, (reference, stream) in enumerate(seen):
        assert torch.allclose(reference, expected[index], atol=1e-5), index
        if index:
            assert not torch.allclose(stream, expected[index], atol=1e-3), index


# ------------------------------------------------------------------------------------ export


@pytest.mark.skipif(importlib.util.find_spec("shardcal.export") is None, reason="shardcal.export is not there yet")
@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_export_reloads_with_equal_logits(algorithm, tmp_path):
    from shardcal.export import export_checkpoint
    from shardcal.models import from_pretrained

    cfg = dict(LLAMA, hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=2)
    model = _model(cfg)
    recipe = load_recipe(f"w4a16-{algorithm}")  # the shipped recipe: int4 groups of 128, pack-quantized
    calibrate(model, _data(n=4), recipe, batch_size=2, progress=False)
    out = export_checkpoint(model, tmp_path / algorithm)
    reloaded = from_pretrained(out)
    data = _data(n=3, seed=7)
    assert torch.equal(_logits(reloaded, data), _logits(model, data))


# ------------------------------------------------------------------------------------ recipes


def test_shipped_recipes_and_parameter_errors():
    for name, algorithm in (
        ("w8a8-int8-sq", "smoothquant"),
        ("w4a16-gptq", "gptq"),
        ("w4a16-awq", "awq"),
        ("w8a8-int8-sq-gptq", "gptq"),
    ):
        assert load_recipe(name).algorithm["name"] == algorithm
    assert load_recipe("w4a16-gptq").algorithm["propagate"] == "qdq"
    assert load_recipe("w8a8-int8-sq-gptq").algorithm["smooth"]["name"] == "smoothquant"
    bad = [
        ('name = "gptq"\npercdamp = 0', "algorithm.percdamp"),
        ('name = "gptq"\ndamp = 0.1', "algorithm.damp"),
        ('name = "smoothquant"\nalpha = 1.5', "algorithm.alpha"),
        ('name = "smoothquant"\nmappings = ["q_k"]', "algorithm.mappings"),
        ('name = "awq"\ngrid = 0', "algorithm.grid"),
        ('name = "awq"\npropagate = "int"', "algorithm.propagate"),
        ('name = "gptq"\nsmooth = { name = "gptq" }', "algorithm.smooth.name"),
        ('name = "gptq"\nsmooth = { name = "smoothquant", alpha = 2 }', "algorithm.smooth.alpha"),
        ('name = "smoothquant"\nalpha_grid = [0.5, 2]', "algorithm.alpha_grid"),
        ('name = "gptq"\nstream_correction = 1.5', "algorithm.stream_correction"),
    ]
    for table, key in bad:
        with pytest.raises(RecipeError, match=key.replace(".", r"\.")) as info:
            parse_recipe(f'[weight]\nformat = "int8"\n[algorithm]\n{table}\n', "bad.toml")
        assert "bad.toml" in str(info.value)


def test_input_stats_share_one_gram_while_points_see_one_tensor():
    """Points fed the very same tensor in every batch share one Gram sum (one ``X^T X`` per batch); a point that
    later sees another tensor gets its own sum from then on, and a module called twice counts both calls. Each
    Hessian equals the float64 sum of its own inputs, and ``same_gram`` groups by the merged values."""
    from types import SimpleNamespace

    from shardcal.algorithms.stats import InputStats

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 4, generator=g) for _ in range(3)]
    ys = [torch.randn(2, 5, 4, generator=g) for _ in range(3)]
    layer = nn.ModuleDict({k: nn.Linear(4, 3) for k in "abcd"})
    fed: dict[str, list[torch.Tensor]] = {k: [] for k in "abcd"}

    def forward(i: int) -> torch.Tensor:
        calls = [("a", xs[i]), ("b", xs[i]), ("c", xs[i] if i == 0 else ys[i]), ("d", xs[i]), ("d", ys[i])]
        for k, x in calls:
            fed[k].append(x.reshape(-1, 4).double())
            layer[k](x)
        return xs[i]

    step = SimpleNamespace(layer=layer, device=torch.device("cpu"), cache_device=torch.device("cpu"), inputs=xs)
    step.forward = forward
    stats = InputStats({k: (layer[k], "input") for k in "abcd"}, {"gram"}).collect(step)
    assert stats["a"].gram is stats["b"].gram and stats["c"].gram is not stats["a"].gram
    stats.merge(None)
    for k, rows in fed.items():
        x = torch.cat(rows)
        torch.testing.assert_close(stats[k].hessian(), x.T @ x, rtol=1e-5, atol=1e-5)
    assert stats.same_gram() == [["a", "b"], ["c"], ["d"]]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_a_prepared_hessian_equals_gptq_on_the_hessian(act_order):
    """Linears that share their inputs share one ``prepare_hessian``: the result is bit for bit GPTQ's own."""
    from shardcal.algorithms.gptq_solve import gptq_quantize, prepare_hessian

    x = _correlated_inputs(1024, 64)
    x[:, 7] = 0.0  # a dead column
    hessian = x.double().T @ x.double()
    prepared = prepare_hessian(hessian, act_order=act_order)
    for seed, spec in enumerate([QuantizerSpec("fp8_e4m3", "tensor"), QuantizerSpec("int4", "group", group_size=32)]):
        weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
        results = []
        for h in (hessian, prepared):
            quantizer = TensorQuantizer(spec, (16, 64))
            quantizer.calibrate_from(weight)
            results.append(gptq_quantize(weight, h, quantizer, act_order=act_order))
        assert torch.equal(results[0], results[1])


def test_gptq_hessian_pass_input_amax_is_the_inputs_max_before_the_solve_one_pass_fewer():
    """``input_amax = "hessian-pass"``: each static per-tensor max input quantizer takes the maximum of the inputs
    GPTQ's Hessian pass saw, the layer's inputs through its weights before the solve. On layer 0 (inputs the same in
    both streams) that is the unquantized model's own forward; the layer runs one pass over the data fewer than
    with the default, whose observers see the solved weights' inputs."""
    data = _data(n=8)
    layer0 = lambda n, m: isinstance(m, nn.Linear) and n.startswith("model.layers.0.")
    want = _input_max(_model(outliers=True), data, 4, layer0)
    calls: dict[str, dict[int, int]] = {}
    amax: dict[str, dict[str, float]] = {}
    for mode in ("observe", "hessian-pass"):
        model = _model(outliers=True)
        calls[mode] = _count_layer_calls(model)
        recipe = _recipe("gptq", weight_only=False, input_amax=f'"{mode}"')
        calibrate(model, data, recipe, batch_size=4, progress=False)
        amax[mode] = {n: model.get_submodule(n).input_quantizer.amax.item() for n in want}
    assert len(want) == 7
    assert all(calls["hessian-pass"][i] == calls["observe"][i] - 2 for i in calls["observe"]), calls
    for name, value in want.items():
        assert amax["hessian-pass"][name] == pytest.approx(value, rel=1e-6), name
    assert any(amax["observe"][n] != pytest.approx(v, rel=1e-6) for n, v in want.items())  # the solved weights'


def test_gptq_hessian_pass_leaves_moe_experts_to_observe_every_token_in_all_experts_mode():
    """``input_amax = "hessian-pass"`` with ``calibrate_all_experts``: the Hessian pass sees each expert's routed
    tokens only, so the experts' input quantizers still observe every token after the solve. Reference: the
    calibrated model's own layer 0 in full precision (the solved weights), hooks on its MoE block input; every token
    through each expert by hand (``silu(x W_gate^T) * (x W_up^T)`` for down_proj)."""
    import torch.nn.functional as F

    from shardcal.quant.session import quantizer_mode

    cfg = dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=2)
    data = _data(n=4)
    model = _model(cfg)
    recipe = _recipe("gptq", weight_only=False, input_amax='"hessian-pass"')
    calibrate(model, data, recipe, batch_size=2, progress=False, calibrate_all_experts=True)
    model.requires_grad_(False)
    block = model.model.layers[0].mlp
    seen: list[torch.Tensor] = []
    hook = block.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad(), quantizer_mode(model, "disabled"):
        model(data)
    hook.remove()
    x = torch.cat(seen).double()
    routed = torch.topk(x @ block.gate.weight.double().T, cfg["num_experts_per_tok"], dim=-1).indices
    assert all(bool((routed == e).any(dim=-1).sum() < x.shape[0]) for e in range(len(block.experts)))  # a subset each
    for e, expert in enumerate(block.experts):
        down_in = F.silu(x @ expert.gate_proj.weight.double().T) * (x @ expert.up_proj.weight.double().T)
        want = {"gate_proj": x.abs().max(), "up_proj": x.abs().max(), "down_proj": down_in.abs().max()}
        for projection, value in want.items():
            got = getattr(expert, projection).input_quantizer.amax.item()
            assert got == pytest.approx(float(value), rel=1e-5), (e, projection)


class _GemmaNorm(nn.Module):
    """Gemma's RMS norm: ``x / rms(x) * (1 + weight)``, computed in float32 as transformers does."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


@pytest.mark.parametrize(
    ("dtype", "stored"),
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
     (torch.float32, torch.float32)],
    ids=["bf16", "fp16", "fp32-exported-bf16", "fp32"],
)  # fmt: skip
def test_a_fold_into_a_gemma_norm_keeps_the_function_in_16_bits(dtype, stored):
    """Scales folded into a ``(1 + w)`` norm: ``(1 + w) / s`` is kept as ``1 + w'``, which for large ``s`` (``w'``
    near -1) keeps few digits once ``w'`` is stored in 16 bits — by the model, or by an export in bf16 of a model
    calibrated in float32. The fold takes ``w'`` as a bf16 number and gives the consumers the scales that stored
    multiplier implies: the consumers' outputs on normalized inputs stay what they were (computed here in float64
    from the parameters stored as ``stored``, Gemma's formula written out); the naive fold (the asked scales on the
    consumers, ``w'`` rounded where it is stored) is far off in 16 bits. Channels left unscaled keep their weight."""
    from shardcal.algorithms.mappings import Smoothing

    gen = torch.Generator().manual_seed(0)
    dim, out = 64, 32
    norm_weight = 0.5 * torch.randn(dim, generator=gen)
    lin_weight = torch.randn(out, dim, generator=gen)

    def pair() -> Smoothing:
        norm = _GemmaNorm(dim, dtype)
        lin = nn.Linear(dim, out, bias=False, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(norm_weight.to(dtype))
            lin.weight.copy_(lin_weight.to(dtype))
        return Smoothing(kind="attn_in", key="n", source=norm, consumers=[lin], point=(norm, "output"),
                         consumer_names=["q_proj"])  # fmt: skip

    def outputs(m: Smoothing, x: torch.Tensor) -> torch.Tensor:  # the parameters as ``stored`` keeps them
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        weight = m.consumers[0].weight.to(stored).double()
        return (normed * (1.0 + m.source.weight.to(stored).double())) @ weight.T

    x = torch.randn(16, dim, generator=gen, dtype=torch.float64)
    s = torch.exp(torch.linspace(-3.0, 5.0, dim))  # up to ~150: multipliers near 0 for the large ones
    s[5] = 1.0  # a channel left unscaled
    m = pair()
    assert m.offset == 1.0
    before = outputs(m, x)
    unscaled = m.source.weight[5].clone()
    applied = m.fold(s)
    assert m.source.weight[5] == unscaled and applied[5] == 1.0
    error = ((outputs(m, x) - before).norm() / before.norm()).item()
    assert error < 4 * torch.finfo(stored).eps, error  # the consumers' own rounding to their dtype: nothing more
    assert not torch.equal(applied, s) and bool((applied > 0).all())
    if stored == torch.float32:
        return
    naive = pair()  # the same parameters, folded with the asked scales on the consumers
    with torch.no_grad():
        naive.source.weight.copy_(((1.0 + naive.source.weight.float()) / s - 1.0).to(dtype))
        naive.consumers[0].weight.copy_((naive.consumers[0].weight.float() * s[None, :]).to(dtype))
    assert ((outputs(naive, x) - before).norm() / before.norm()).item() > 10 * error


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_gptq_beats_round_to_nearest_on_its_calibrated_blocks(fmt):
    """MX GPTQ rounds each column to the format's values with the block scales calibrated from the weight (powers of
    two, kept: the quantizer reproduces the result), and beats round to nearest; every value is a code of the format
    times its block's power of two (checked by hand: E2M1 magnitudes, or an exact float8 cast)."""
    from shardcal.algorithms.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 256, generator=g) * 0.05
    x = _correlated_inputs(4096, 256)
    quantizer = TensorQuantizer(QuantizerSpec(fmt), (64, 256))
    quantizer.calibrate_from(weight)
    amax = quantizer.amax.clone()
    q = gptq_quantize(weight, x.double().T @ x.double(), quantizer)
    err = lambda w: (x @ (w - weight).T).pow(2).sum().item()
    assert err(q) < 0.8 * err(quantizer(weight)), (err(q), err(quantizer(weight)))
    assert torch.equal(quantizer(q), q) and torch.equal(quantizer.amax, amax)
    blocks = weight.reshape(64, 8, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(blocks)) - (2 if fmt == "mxfp4" else 8))
    scale = torch.where(blocks >= 1.75 * torch.exp2(torch.floor(torch.log2(blocks))), 2 * scale, scale)
    codes = q.reshape(64, 8, 32) / scale
    if fmt == "mxfp4":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        assert torch.equal(codes.abs(), grid[(codes.abs().unsqueeze(-1) - grid).abs().argmin(-1)])
    else:
        assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float()) and codes.abs().max() <= 448
