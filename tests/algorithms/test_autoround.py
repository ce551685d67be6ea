"""AutoRound (signed-gradient rounding and clipping) inside calibrate: its starting point is round to nearest, it
lowers the model's error against round to nearest, it is bit-identical at 1 and 2 ranks (gloo, FSDP2) and on resume,
its weights are what the quantizer and the export reproduce, and bad recipes are refused."""

from __future__ import annotations

import pytest
import torch
from _injected import CalibrationInterrupted, interrupt_after
from torch import nn

from shardcal.algorithms.autoround import _TunedWeight, batch_schedule
from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import RecipeError
from shardcal.layerwise.steps import LayerStep
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import QuantizerSpec, iter_quantizers
from shardcal.quant.formats import fake_quantize
from shardcal.quant.linear import QuantLinear
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

LLAMA = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)


def _model(cfg: dict = LLAMA, seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=seed)
    return model.eval()


def _data(n: int = 6, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _recipe(algorithm: str = "autoround", symmetric: bool = True, fmt: str = "int4", **params):
    extra = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in params.items())
    weight = f'[weight]\nformat = "{fmt}"\n'
    if fmt == "int4":
        weight += 'granularity = "group"\ngroup_size = 32\n' + ("" if symmetric else "symmetric = false\n")
    return parse_recipe(f'name = "t"\n{weight}[algorithm]\nname = "{algorithm}"\n{extra}', "t.toml")


def _logits(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(data)


def test_batch_schedule_draws_every_batch_once_per_epoch_and_is_seeded():
    schedule = batch_schedule(5, 10, 2, seed=3, layer=1)
    drawn = [b for chosen in schedule for b in chosen]
    assert len(drawn) == 20 and all(len(c) == 2 for c in schedule)
    epochs = [drawn[k : k + 5] for k in range(0, 20, 5)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert schedule == batch_schedule(5, 10, 2, seed=3, layer=1)
    assert schedule != batch_schedule(5, 10, 2, seed=3, layer=2)
    assert batch_schedule(1, 3, 4, seed=0, layer=0) == [[0], [0], [0]]


def test_gradient_sums_are_exact_in_any_order():
    """The fixed-point sum of per-batch gradients does not depend on their order (float32 sums do: 1 + 3e-8 - 1 is 0),
    and equals the exact sum to 2**-39 of the largest term per term."""
    import itertools
    import math

    from shardcal.algorithms.autoround import FIXED_BITS, _fixed_point_sum

    terms = [1.0, 3e-8, -1.0, 2e-8]
    exact = math.fsum(terms)
    results = set()
    for order in itertools.permutations(terms):
        (total,) = _fixed_point_sum([[torch.tensor([t], dtype=torch.float32)] for t in order], [torch.Size([1])], None)
        results.add(float(total))
    assert len(results) == 1
    assert abs(results.pop() - exact) <= len(terms) * 2.0 ** (1 - FIXED_BITS)
    float_sums = {float(sum(torch.tensor([t], dtype=torch.float32) for t in o)) for o in itertools.permutations(terms)}
    assert len(float_sums) > 1  # the reason for fixed point


def test_round_ste_rounds_forward_and_passes_gradients_back():
    """The straight-through rounding: ``round`` forward (half to even), the incoming gradient unchanged backward."""
    from shardcal.algorithms.autoround import _round_ste

    x = torch.tensor([-2.5, -1.5, -0.5, 0.49, 0.5, 1.5, 2.5, 3.7], requires_grad=True)
    assert _round_ste(x).tolist() == [-2.0, -2.0, -0.0, 0.0, 0.0, 2.0, 2.0, 4.0]
    (grad,) = torch.autograd.grad((_round_ste(x) * torch.arange(8.0)).sum(), x)
    assert torch.equal(grad, torch.arange(8.0))


def test_one_batch_signs_are_the_fixed_point_sums_signs():
    """A step on one batch takes its signs in the gradient's own dtype: the same as the fixed-point sum's, also for
    terms too small to survive its rounding (sign 0) and for an all-zero gradient."""
    from shardcal.algorithms.autoround import _fixed_point_sum, _one_batch_signs

    g = torch.Generator().manual_seed(0)
    big = torch.randn(40, 30, generator=g) * torch.logspace(-16, 2, 30)  # columns down to 2**-53 of the largest
    grads = [big, torch.zeros(7), torch.randn(5, generator=g) * 1e-30]
    shapes = [t.shape for t in grads]
    signs, loss = _one_batch_signs([[*grads, torch.tensor([3.5])]], shapes, None)
    sums = _fixed_point_sum([grads], shapes, None)
    for got, want in zip(signs, sums):
        assert torch.equal(got.double(), torch.sign(want))
    assert (signs[0] == 0).any() and (signs[0] != 0).any()
    assert float(loss) == 3.5
    empty, zero = _one_batch_signs([], shapes, None)
    assert all(not e.any() for e in empty) and float(zero) == 0.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_untuned_weight_is_round_to_nearest_and_finish_is_reproduced_by_the_quantizer(symmetric):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 64, generator=g))
    spec = QuantizerSpec("int4", "group", group_size=32, symmetric=symmetric)
    m = QuantLinear.from_linear(linear, weight=spec, name="lin")
    m.weight_quantizer.calibrate_from(m.weight.detach())
    tuned = _TunedWeight("lin", m, clip=True)
    want = fake_quantize(m.weight.detach(), m.weight_quantizer.amax, spec, amin=m.weight_quantizer.amin)
    assert torch.allclose(tuned.quantized(), want, rtol=0, atol=1e-6)
    loss = tuned.quantized().pow(2).sum()  # gradients reach the rounding offsets and the clip factors
    grads = torch.autograd.grad(loss, tuned.params)
    assert all(gr.abs().sum() > 0 for gr in grads)
    with torch.no_grad():  # a tuned state: offsets and shrunk ranges
        tuned.v.copy_(torch.rand(24, 64, generator=g) - 0.5)
        for p in tuned.params[1:]:
            p.mul_(0.8)
    expected = tuned.quantized().detach()
    tuned.finish()
    q = m.weight_quantizer
    assert torch.allclose(q.amax, tuned.amax * 0.8)
    assert torch.allclose(m.weight, expected, rtol=0, atol=1e-6)
    assert torch.equal(q(m.weight.detach()), m.weight.detach())  # the export stores exactly this weight
    assert not torch.equal(m.weight.detach(), fake_quantize(linear.weight.detach(), tuned.amax, spec, amin=tuned.amin))


def _output_error(algorithm: str, **params) -> tuple[float, object]:
    data = _data(n=8)
    want = _logits(_model(), data)
    model = _model()
    report = calibrate(model, data, _recipe(algorithm, **params), batch_size=2, progress=False)
    return (_logits(model, data) - want).pow(2).mean().item(), report


@pytest.mark.parametrize("symmetric", [True, False])
def test_autoround_beats_round_to_nearest(symmetric):
    rtn, _ = _output_error("rtn", symmetric=symmetric)
    tuned, report = _output_error("autoround", symmetric=symmetric, iters=40)
    assert report.propagate == "qdq"
    assert tuned < 0.8 * rtn, (tuned, rtn)
    for layer in report.layers:
        loss = layer.algorithm["autoround_loss"]
        assert loss["last"] < loss["first"], loss


def test_guard_keeps_the_start_when_tuning_made_it_worse():
    """A step size of 1 throws every rounding offset to its bound: the tuned error is above the start's, so the
    guard keeps the starting parameters — the weights of round to nearest — while without it the tuned model is far
    worse."""
    rtn_model = _model()
    calibrate(rtn_model, _data(n=8), _recipe("rtn"), batch_size=2, progress=False)
    wild, report = _output_error("autoround", iters=2, lr=1.0, guard=False)
    kept, kept_report = _output_error("autoround", iters=2, lr=1.0)
    rtn, _ = _output_error("rtn")
    assert wild > 2 * rtn, (wild, rtn)
    assert kept == pytest.approx(rtn, rel=1e-4)
    for layer in kept_report.layers:
        assert layer.algorithm["autoround_loss"]["tuned_ratio"] > 1.0
    assert "tuned_ratio" not in report.layers[0].algorithm["autoround_loss"]
    model = _model()
    calibrate(model, _data(n=8), _recipe(iters=2, lr=1.0), batch_size=2, progress=False)
    rtn_linears = dict(rtn_model.named_modules())
    for name, got in model.named_modules():
        if isinstance(got, QuantLinear):  # the weight left in the Linear is round to nearest's fake-quant weight
            want = rtn_linears[name]
            with torch.no_grad():
                rounded = want.weight_quantizer(want.weight.detach())
            assert torch.allclose(got.weight.detach(), rounded, rtol=0, atol=1e-6), name


@pytest.mark.parametrize(("iters", "lr", "want"), [(1, 0.0, [1.0]), (4, 0.0, [0.25, 0.1875, 0.125, 0.0625]),
                                                   (3, 0.3, [0.3, 0.2, 0.1])])  # fmt: skip
def test_step_sizes_decay_linearly_from_lr_over_the_iterations(monkeypatch, iters, lr, want):
    """Step t of ``iters`` moves the parameters by ``lr * (1 - t / iters)``, worked out by hand above (``lr`` 0:
    ``1 / iters``): the first step takes the whole ``lr``, none is zero."""
    rates: list[float] = []
    original = _TunedWeight.step

    def record(self, signs, lr, min_clip):
        rates.append(lr)
        original(self, signs, lr, min_clip)

    monkeypatch.setattr(_TunedWeight, "step", record)
    model = _model(dict(LLAMA, num_hidden_layers=1))
    recipe = _recipe(iters=iters, lr=lr, guard=False) if lr else _recipe(iters=iters, guard=False)
    calibrate(model, _data(n=4), recipe, batch_size=2, progress=False)
    per_step = len(rates) // iters  # every tuned Linear of the layer, each step
    assert per_step == 7 and len(rates) == 7 * iters
    assert rates[::per_step] == pytest.approx(want, rel=1e-12, abs=0)
    assert all(rates[k] == rates[k - k % per_step] for k in range(len(rates)))


def test_one_step_moves_the_weights_off_round_to_nearest():
    """A single step of size 0.25 moves each rounding offset by -0.25 * sign(gradient): the codes of the weights
    whose ``W / s`` lies within 0.25 of a rounding boundary move by one (many do), no other code moves — against the
    scales and the codes of round to nearest, computed here from the weight and its amax."""
    cfg = dict(LLAMA, num_hidden_layers=1)
    rtn = _model(cfg)
    calibrate(rtn, _data(n=4), _recipe("rtn"), batch_size=2, progress=False)
    tuned = _model(cfg)
    calibrate(tuned, _data(n=4), _recipe(iters=1, lr=0.25, guard=False, clip=False), batch_size=2, progress=False)
    original = dict(_model(cfg).named_parameters())
    moved = near_boundary = 0
    for name, module in rtn.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        w = original[f"{name}.weight"].detach().reshape(module.out_features, -1, 32)
        scale = module.weight_quantizer.amax.reshape(module.out_features, -1, 1) / 7  # int4: qmax 7, groups of 32
        x = w / scale
        nearest = torch.clamp(torch.round(x), -8, 7)
        got = tuned.get_submodule(name).weight.detach().reshape(w.shape) / scale
        codes = torch.round(got)
        assert torch.allclose(got, codes, atol=1e-4), name  # still on the grid of the same scales
        changed = codes != nearest
        reachable = (x - nearest).abs() >= 0.25 - 1e-6
        assert bool(((codes - nearest).abs() <= 1).all()), name
        assert not bool((changed & ~reachable).any()), name
        moved += int(changed.sum())
        near_boundary += int(reachable.sum())
    assert moved > 0.25 * near_boundary, (moved, near_boundary)


def test_guard_keeps_tuned_parameters_that_lower_the_error():
    """With small steps the error falls: the guard keeps the tuned parameters (the same model as without it)."""
    guarded, report = _output_error("autoround", iters=12)
    unguarded, _ = _output_error("autoround", iters=12, guard=False)
    for layer in report.layers:
        assert 0.0 < layer.algorithm["autoround_loss"]["tuned_ratio"] < 1.0
    assert guarded == unguarded


def _run_handing_over(monkeypatch, hand_over: bool, recipe_text: str = "") -> tuple[dict, torch.Tensor, list]:
    """Calibrate with AutoRound; record the layers whose guard handed its outputs over, or (``hand_over`` False)
    drop them so that the runner runs every layer again as before."""
    handed: list[int] = []
    original = LayerStep.keep_final_outputs

    def keep(self: LayerStep, outputs: list[torch.Tensor]) -> None:
        handed.append(self.index)
        if hand_over:
            original(self, outputs)

    monkeypatch.setattr(LayerStep, "keep_final_outputs", keep)
    model = _model(dict(LLAMA, num_hidden_layers=3))
    weight = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\n'
    recipe = parse_recipe(f'name = "t"\n{weight}{recipe_text}[algorithm]\nname = "autoround"\niters = 12\n', "t.toml")
    calibrate(model, _data(n=8), recipe, batch_size=2, progress=False)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return state, _logits(model, _data(n=2, seed=9)), handed


@pytest.mark.parametrize("inputs", ["", '[input]\nformat = "int8"\ngranularity = "token"\ndynamic = true\n'])
def test_guard_outputs_go_on_as_the_next_inputs_bit_for_bit(monkeypatch, inputs):
    """The guard's last pass runs the layer as it is left, so its outputs go on as the next layer's inputs instead
    of the runner running the layer again: the same bits — every weight and the logits equal those of a run whose
    runner recomputes them. With input quantizers set after the algorithm (dynamic int8 here) the runner does not
    take them."""
    state, logits, handed = _run_handing_over(monkeypatch, True, inputs)
    want_state, want_logits, _ = _run_handing_over(monkeypatch, False, inputs)
    assert handed == [0, 1, 2]
    for name, want in want_state.items():
        assert torch.equal(state[name], want), name
    assert torch.equal(logits, want_logits)


def test_fp_targets_are_the_float_models_outputs():
    """``target = "fp"``: the first step's loss (round to nearest, before any update) is the error against the float
    model's own layer outputs. At layer 0 both streams are the embeddings, so it equals ``target = "layer"``'s; at
    layer 1 the propagated stream has drifted, so it is larger than the error against the layer's own output on
    that stream; the tuned model is closer to the float model than round to nearest."""
    _, own = _output_error("autoround", iters=8)
    tuned, fp = _output_error("autoround", iters=8, target='"fp"')
    first = [(a.algorithm["autoround_loss"]["first"], b.algorithm["autoround_loss"]["first"])
             for a, b in zip(own.layers, fp.layers)]  # fmt: skip
    assert first[0][0] == first[0][1]
    assert first[1][1] > first[1][0], first
    rtn, _ = _output_error("rtn")
    assert tuned < rtn, (tuned, rtn)


def _calibrated_states(cases: list[dict]) -> list[dict]:
    out = []
    for params in cases:
        model_type = params.pop("model_type", "llama")
        model = _model(dict(TINY_CONFIGS[model_type], num_hidden_layers=2))
        fsdp2_wrap(model)
        report = calibrate(model, _data(n=7), _recipe(**params), batch_size=2, progress=False)
        state = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        state.update({f"{n}.amax": q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None})
        state.update({f"{n}.amin": q.amin.clone() for n, q in iter_quantizers(model) if q.amin is not None})
        out.append(dict(state=state, logits=_logits(model, _data(n=2, seed=9)),
                        loss=[r.algorithm["autoround_loss"] for r in report.layers]))  # fmt: skip
    return out


STATE_CASES = [
    # 4 batches split 2 + 2, all in each step: ((g0 + g1) + g2) + g3 on one rank, (g0 + g1) + (g2 + g3) on two
    dict(iters=6, batches_per_iter=4),
    dict(iters=6, batches_per_iter=2),  # a step's two batches on two ranks, or on one
    dict(iters=5, symmetric=False, model_type="qwen2_moe"),  # asymmetric; experts' Linears see their routed tokens
    dict(iters=4, fmt="int8", clip=False),  # per-channel int8, rounding only
    dict(iters=5, batches_per_iter=2, target='"fp"'),  # targets from the full-precision stream
]


def test_two_ranks_equal_one_rank_bit_exact():
    """Each step's gradient is a fixed-point sum over the drawn batches, whichever rank holds them."""
    (single,) = run_on_ranks(1, _calibrated_states, [dict(c) for c in STATE_CASES])
    for got_rank in run_on_ranks(2, _calibrated_states, [dict(c) for c in STATE_CASES]):
        for case, want, got in zip(STATE_CASES, single, got_rank):
            for name in want["state"]:
                assert torch.equal(want["state"][name], got["state"][name]), (case, name)
            assert torch.equal(want["logits"], got["logits"]), case


def _resume_run(directory: str, interrupt: int | None) -> dict:
    model = _model(dict(LLAMA, num_hidden_layers=4))
    fsdp2_wrap(model)
    try:
        with interrupt_after(interrupt):
            calibrate(model, _data(n=6), _recipe(iters=4), batch_size=2, progress=False, checkpoint_dir=directory)
    except CalibrationInterrupted:
        return dict(interrupted=True)
    return dict(interrupted=False, logits=_logits(model, _data(n=2, seed=9)),
                state={n: p.detach().full_tensor() for n, p in model.named_parameters()})  # fmt: skip


def test_resume_is_bit_identical(tmp_path):
    full = run_on_ranks(2, _resume_run, str(tmp_path / "a"), None)
    folder = str(tmp_path / "b")
    assert all(r["interrupted"] for r in run_on_ranks(2, _resume_run, folder, 2))
    for got in run_on_ranks(1, _resume_run, folder, None):
        for name in full[0]["state"]:
            assert torch.equal(full[0]["state"][name], got["state"][name]), name
        assert torch.equal(full[0]["logits"], got["logits"])


def test_export_reloads_with_equal_logits(tmp_path):
    from shardcal.export import export_checkpoint
    from shardcal.models import from_pretrained

    model = _model()
    calibrate(model, _data(n=4), _recipe(iters=4), batch_size=2, progress=False)
    reloaded = from_pretrained(export_checkpoint(model, tmp_path / "out"))
    data = _data(n=3, seed=7)
    assert torch.equal(_logits(reloaded, data), _logits(model, data))


def test_refuses_formats_it_cannot_round_and_bad_parameters():
    with pytest.raises(RecipeError, match="autoround supports int4 and int8 weights, not 'fp8_e4m3'"):
        calibrate(_model(), _data(n=2), _recipe(fmt="fp8_e4m3"), batch_size=2, progress=False)
    for table, key in (("iters = 0", "iters"), ("min_clip = 0", "min_clip"), ("batches = 2", "batches"),
                       ('target = "stream"', "target")):  # fmt: skip
        with pytest.raises(RecipeError, match=f"algorithm\\.{key}"):
            parse_recipe(f'[weight]\nformat = "int4"\n[algorithm]\nname = "autoround"\n{table}\n', "bad.toml")
