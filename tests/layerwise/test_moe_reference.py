"""MoE calibration against a hand-routed reference: exact token counts and ranges per expert, and the fallback.

The reference never touches the runner's MoE code: a plain model runs each row alone (no padding), hooks record each
MoE block's input, and the routing is redone by hand (``topk`` of the router's logits). For every expert that gives
the tokens it is routed (or, in all-experts mode, all tokens), hence the exact element count and ``abs().amax`` its
gate/up input quantizers must report, and its down_proj input ``act(x W_gate^T) * (x W_up^T)``. A dead expert's
quantizers must get exactly the largest amax of the experts that saw tokens. The calibrated runs use padded batches
(the pad token's embedding made huge) on two ranks, so masks and cross-rank merges are part of what is checked.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_, starve_experts_2_and_3

pytestmark = pytest.mark.numerics

CFG = dict(TINY_CONFIGS["qwen3_moe"], num_hidden_layers=2)
HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 4, 2
LENGTHS = (16, 9, 13, 16, 6, 12, 16, 8)
ROWS = [torch.randint(1, 250, (n,), generator=torch.Generator().manual_seed(100 + n)) for n in LENGTHS]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _model(dead_experts: bool = False) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[0] *= 300.0  # the pad id: any padded token that counts is seen at once
    if dead_experts:  # a constant residual feature makes every router pick experts 0 and 1 only
        starve_experts_2_and_3(model)
    return model.eval()


def _hand_routed(dead_experts: bool, all_experts: bool) -> dict[str, tuple[int, float]]:
    """``{quantizer name: (elements observed, amax)}`` from a plain model, each row alone, routing by hand."""
    model = _model(dead_experts).requires_grad_(False)
    block_inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.model.layers))}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, args, i=i: block_inputs[i].append(args[0].reshape(-1, HIDDEN)))
    with torch.no_grad():
        for row in ROWS:
            model(row[None])
    expected = {}
    for i, layer in enumerate(model.model.layers):
        x = torch.cat(block_inputs[i])  # [real tokens, hidden]
        chosen = torch.topk(x @ layer.mlp.gate.weight.T, TOP_K, dim=-1).indices
        for e, expert in enumerate(layer.mlp.experts):
            tokens = x if all_experts else x[(chosen == e).any(dim=-1)]
            down_in = F.silu(tokens @ expert.gate_proj.weight.T) * (tokens @ expert.up_proj.weight.T)
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            for p in ("gate_proj", "up_proj"):
                expected[f"{prefix}.{p}.input_quantizer"] = (tokens.numel(), _amax(tokens))
            expected[f"{prefix}.down_proj.input_quantizer"] = (down_in.numel(), _amax(down_in))
    return expected


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _calibrated(dead_experts: bool, all_experts: bool) -> dict:
    model = _model(dead_experts)
    fsdp2_wrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = calibrate(
            model, list(ROWS), "w8a8-int8", batch_size=3, progress=False, calibrate_all_experts=all_experts
        )
    return {
        "observed": {
            n: (q.num_observed, float(q.amax.max()))
            for n, q in iter_quantizers(model)
            if ".experts." in n and n.endswith("input_quantizer")
        },
        "fallbacks": sorted(f for entry in report.layers for f in entry.fallbacks),
    }


@pytest.mark.parametrize("all_experts", [True, False], ids=["all-experts", "routed"])
def test_each_expert_observes_exactly_its_tokens(all_experts):
    expected = _hand_routed(False, all_experts)
    real_tokens = sum(LENGTHS)
    if all_experts:  # every token once per expert: not once more for the routed pass
        assert {n: c for n, (c, _) in expected.items()} == {
            n: real_tokens * (INTER if ".down_proj." in n else HIDDEN) for n in expected
        }
    else:  # each token is routed to TOP_K experts: the counts add up to that
        for i in range(2):
            gate = [c for n, (c, _) in expected.items() if n.startswith(f"model.layers.{i}.") and ".gate_proj." in n]
            assert sum(gate) == real_tokens * TOP_K * HIDDEN
    for result in run_on_ranks(2, _calibrated, False, all_experts):
        assert result["fallbacks"] == []
        assert result["observed"].keys() == expected.keys()
        for name, (count, amax) in expected.items():
            got_count, got_amax = result["observed"][name]
            assert got_count == count, (name, got_count, count)
            assert got_amax == pytest.approx(amax, rel=1e-5), name


WEIGHT_ONLY = '[weight]\nformat = "int8"\ngranularity = "channel"\n'


def _expert_tokens(recipe: str, all_experts: bool) -> list[int]:
    """The tokens each expert of the first layer is called with over a calibration."""
    from shardcal.calib.recipes import parse_recipe

    model = _model()
    calls = [0] * EXPERTS
    for e, expert in enumerate(model.model.layers[0].mlp.experts):
        expert.register_forward_pre_hook(lambda m, args, e=e: calls.__setitem__(e, calls[e] + args[0].shape[0]))
    fsdp2_wrap(model)
    spec = parse_recipe(recipe, "r.toml") if recipe.startswith("[") else recipe
    calibrate(model, list(ROWS), spec, batch_size=1, progress=False, calibrate_all_experts=all_experts)
    return calls


@pytest.mark.parametrize(
    "recipe", [WEIGHT_ONLY, "w8a8-int8-dynamic", "w8a8-int8"], ids=["weights", "dynamic", "static"]
)
def test_all_experts_mode_runs_every_expert_only_for_quantizers_that_observe(recipe):
    """Every expert on every token is the price of its input quantizers seeing them all: with static input scales,
    all-experts mode calls each expert with every real token once more than routing does (rows alone: no padding);
    without them, it calls the experts exactly as routing does."""
    (all_experts,) = run_on_ranks(1, _expert_tokens, recipe, True)
    (routed,) = run_on_ranks(1, _expert_tokens, recipe, False)
    extra = sum(LENGTHS) if recipe == "w8a8-int8" else 0
    assert min(routed) > 0 and [a - r for a, r in zip(all_experts, routed)] == [extra] * EXPERTS


def _shared_expert_observed() -> tuple[dict[str, tuple[int, float]], dict[str, tuple[int, float]]]:
    """Qwen2-MoE's shared expert in all-experts mode: ``{input quantizer: (elements, amax)}`` calibrated, and by hand
    (its block's input captured from a plain model, each row alone)."""
    cfg = dict(TINY_CONFIGS["qwen2_moe"])  # layer 1: routed experts and a shared expert
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    plain = copy.deepcopy(model).eval().requires_grad_(False)
    inputs: list[torch.Tensor] = []
    plain.model.layers[1].mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0].reshape(-1, HIDDEN)))
    with torch.no_grad():
        for row in ROWS:
            plain(row[None])
    x = torch.cat(inputs)
    shared = "model.layers.1.mlp.shared_expert"
    want = {f"{shared}.{p}.input_quantizer": (x.numel(), _amax(x)) for p in ("gate_proj", "up_proj")}
    fsdp2_wrap(model)
    calibrate(model, list(ROWS), "w8a8-int8", batch_size=1, progress=False, calibrate_all_experts=True)
    got = {n: (q.num_observed, float(q.amax.max())) for n, q in iter_quantizers(model) if n in want}
    return got, want


def test_a_shared_expert_observes_every_token_once_in_all_experts_mode():
    """The all-experts hook silences the routed experts' quantizers only: the shared expert beside them observes the
    block's every real token, once."""
    ((got, want),) = run_on_ranks(1, _shared_expert_observed)
    assert got.keys() == want.keys() and all(got[n][0] == want[n][0] for n in want), (got, want)
    assert all(got[n][1] == pytest.approx(want[n][1], rel=1e-5) for n in want), (got, want)


def test_all_experts_hook_gives_back_exactly_the_modes_it_took():
    """Around each block call the hook silences the experts' collecting quantizers and gives them back, and only
    those: a disabled weight quantizer stays disabled; a later call with nothing collecting changes nothing."""
    from shardcal.calib.attach import quantize_modules
    from shardcal.calib.recipes import load_recipe
    from shardcal.layerwise.moe import AllExpertsObserve
    from shardcal.quant.quantizer import QuantMode
    from shardcal.quant.session import begin_pass_all, start_calibration_all

    layer = _model().model.layers[0]
    quantize_modules(layer, load_recipe("w8a8-int8"), prefix="model.layers.0")
    experts = dict(iter_quantizers(layer.mlp.experts))
    inputs = [q for n, q in experts.items() if n.endswith("input_quantizer")]
    for q in experts.values():
        q.mode = QuantMode.DISABLED
    start_calibration_all(inputs)
    begin_pass_all(inputs, 0)
    before = {n: q.mode for n, q in experts.items()}
    assert set(before.values()) == {QuantMode.COLLECT, QuantMode.DISABLED}
    x = torch.randn(1, 5, HIDDEN)
    with AllExpertsObserve(layer), torch.no_grad():
        layer.mlp(x)
        assert {n: q.mode for n, q in experts.items()} == before
        for q in inputs:
            q.mode = QuantMode.DISABLED
        layer.mlp(x)
        assert all(q.mode is QuantMode.DISABLED for q in experts.values())


def test_dead_experts_get_their_siblings_largest_amax():
    expected = _hand_routed(True, False)
    dead = {n for n, (count, _) in expected.items() if count == 0}
    assert dead and all(".experts.2." in n or ".experts.3." in n for n in dead)
    assert len(dead) == 2 * 2 * 3  # 2 layers x experts 2 and 3 x (gate, up, down) inputs
    for result in run_on_ranks(2, _calibrated, True, False):
        assert result["fallbacks"] == sorted(dead)
        for name in dead:
            layer, role = name.split(".mlp.experts.")[0], name.split(".", 5)[-1].split(".", 1)[1]
            siblings = [
                amax for n, (count, amax) in expected.items() if n.startswith(layer) and n.endswith(role) and count
            ]
            assert len(siblings) == 2
            assert result["observed"][name][0] == 0
            assert result["observed"][name][1] == pytest.approx(max(siblings), rel=1e-5), name


def test_fused_experts_quantize_their_block_input_with_the_largest_expert_range():
    """transformers' fused experts (Qwen3-MoE): in routed mode each expert calibrates its own input range, and the
    block input is fake-quantized with the largest of them (vLLM's rule for per-expert static input scales)."""
    pytest.importorskip("transformers")
    from _hf_models import hf_model

    model = hf_model("qwen3_moe")
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(5))
    calibrate(model, ids, "w8a8-int8", batch_size=2, progress=False, calibrate_all_experts=False)
    experts = model.model.layers[1].mlp.experts
    ranges = [q.amax for n, q in iter_quantizers(experts) if n.endswith("gate_proj.input_quantizer")]
    assert len(ranges) == EXPERTS and len({float(r) for r in ranges}) > 1  # the experts' ranges differ
    largest = torch.stack(ranges).amax()
    seen = {}
    first = experts.register_forward_pre_hook(lambda m, args: seen.__setitem__("in", args[0].clone()), prepend=True)
    after = experts.register_forward_pre_hook(lambda m, args: seen.__setitem__("quantized", args[0].clone()))
    with torch.no_grad():
        model(ids[:2])
    first.remove()
    after.remove()
    scale = largest / 127.0
    want = torch.clamp(torch.round(seen["in"] / scale), -128, 127) * scale
    assert not torch.equal(seen["in"], seen["quantized"])
    torch.testing.assert_close(seen["quantized"], want, rtol=0, atol=1e-6)
