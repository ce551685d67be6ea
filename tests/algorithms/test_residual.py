"""The residual rotation folded into the weights (``[rotation] residual``): the Hadamard matrices of any width
against their constructions, the same function afterwards (shardcal's families and transformers' own classes),
layouts it cannot keep refused before anything changes, static W8A8 error on outlier channels, 1 and 2 FSDP2 ranks
bit-identical, resume, and the export reloaded by shardcal and by transformers."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from _hf_models import hf_logits, hf_model
from _injected import CalibrationInterrupted, interrupt_after

from shardcal.algorithms.residual import residual_rotation, rotate_residual
from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import ModelLayoutError, RecipeError
from shardcal.models import CausalLM, ModelConfig, from_pretrained, load_pretrained
from shardcal.quant.hadamard import FullHadamard, paley_matrix, sylvester_matrix

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, make_tiny_checkpoint, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

W8A8 = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
RESIDUAL = '[rotation]\nresidual = "random-hadamard"\nseed = 3\n'


def _recipe(text: str):
    return parse_recipe(text, source="t.toml", default_name="t")


def _model(model_type: str = "llama", seed: int = 0, **overrides) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(dict(TINY_CONFIGS[model_type], num_hidden_layers=2, **overrides)))
    randomize_(model, seed=seed)
    return model.eval()


def _data(n: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, data: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(data)


# ------------------------------------------------------------------------------------ the matrices


@pytest.mark.parametrize("m", [4, 12, 20, 24, 28, 36, 44, 60])
def test_paley_matrices_are_hadamard(m):
    h = paley_matrix(m)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, m * torch.eye(m, dtype=torch.float64))


@pytest.mark.parametrize(("n", "m"), [(576, 36), (640, 20), (896, 28), (1536, 12), (256, 1)])
def test_full_hadamard_is_the_kronecker_product_with_random_signs(n, m):
    """``Q = diag(s) (H_m ⊗ H_{n/m}) / sqrt(n)``, built densely here from the two factors: orthonormal, every entry
    ±1/sqrt(n), and what ``right`` / ``left_transposed`` multiply by."""
    rotation = FullHadamard(n, seed=5)
    assert rotation.m == m
    factor = torch.ones(1, 1, dtype=torch.float64) if m == 1 else paley_matrix(m)
    dense = torch.kron(factor, sylvester_matrix(n // m)) / math.sqrt(n)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(5)) * 2 - 1
    dense = signs.double()[:, None] * dense
    x = torch.randn(3, n, dtype=torch.float64)
    assert torch.allclose(rotation.right(x), x @ dense, atol=1e-12)
    assert torch.allclose(rotation.left_transposed(x.T), dense.T @ x.T, atol=1e-12)
    assert torch.allclose(dense @ dense.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="no Hadamard matrix of size 18"):
        FullHadamard(18)


# ------------------------------------------------------------------------------------ the function


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("tied", [False, True])
def test_rotation_keeps_the_function_of_shardcals_models(model_type, tied):
    model = _model(model_type, tie_word_embeddings=tied)
    data = _data()
    want = _logits(model, data)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rotate_residual(model, residual_rotation(model, "random-hadamard", 1))
    assert torch.allclose(_logits(model, data), want, atol=1e-5)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings
    assert not torch.allclose(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight") or n == "model.norm.weight"]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_rotation_keeps_the_function_of_a_model_whose_writers_have_biases():
    """Llama with ``attention_bias`` and ``mlp_bias``: o_proj and down_proj add biases to the stream, which the
    rotation must turn with it (``b Q``); the logits are the unrotated model's."""
    model = _model(attention_bias=True, mlp_bias=True)
    writers = [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert all(m.bias is not None and m.bias.abs().max() > 0.01 for m in writers)
    data = _data()
    want = _logits(model, data)
    rotate_residual(model, residual_rotation(model, "random-hadamard", 2))
    assert torch.allclose(_logits(model, data), want, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_rotation_keeps_the_function_of_transformers_models(family):
    """transformers' own classes (Phi-3's fused qkv_proj / gate_up_proj too), found by duck typing."""
    model = hf_model(family)
    data = _data()
    want = hf_logits(model, data)
    rotate_residual(model, residual_rotation(model, "hadamard"), probe=data[:1])
    assert torch.allclose(hf_logits(model, data), want, atol=1e-5)
    assert model.config.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("gemma3", "post_attention_layernorm normalises a 64-wide tensor besides the layer's input norms"),
        ("qwen3_moe", "holds fused 3-D expert weights"),
    ],
)
def test_layouts_it_cannot_keep_are_refused_before_anything_changes(family, message):
    model = hf_model(family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ModelLayoutError, match=message):
        rotate_residual(model, FullHadamard(64))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_sharded_tied_model_is_refused_with_the_way_out():
    (message,) = run_on_ranks(1, _sharded_tied_error)
    assert "load_pretrained(..., untie_word_embeddings=True)" in message


def _sharded_tied_error() -> str:
    from shardcal.sharding.fsdp2 import fsdp2_wrap

    model = _model(tie_word_embeddings=True)
    fsdp2_wrap(model)
    try:
        rotate_residual(model, residual_rotation(model, "hadamard"))
    except ModelLayoutError as exc:
        return str(exc)
    return "not refused"


def test_the_probe_catches_a_rotation_that_changes_the_function(monkeypatch):
    """A layout the checks let through but whose function the fold does not keep stops the run (here a writer that
    is not rotated: o_proj left as it was)."""
    from shardcal.algorithms import residual
    from shardcal.errors import NumericsError

    model = _model()
    real = residual._layer_plan

    def without_o_proj(layer, name, width):
        pairs, writers = real(layer, name, width)
        return pairs, [w for w in writers if w is not layer.self_attn.o_proj]

    monkeypatch.setattr(residual, "_layer_plan", without_o_proj)
    with pytest.raises(NumericsError, match="logits moved"):
        rotate_residual(model, residual_rotation(model, "hadamard"), probe=_data(1))


# ------------------------------------------------------------------------------------ calibration


def _outlier_stream(model: CausalLM, factor: float = 30.0) -> CausalLM:
    """A few channels of every norm's weight scaled up: the normalised stream has outlier channels, as LLMs do."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= factor
            layer.post_attention_layernorm.weight[5:7] *= factor
    return model


def test_residual_rotation_removes_most_of_the_static_int8_error_of_outlier_channels():
    data = _data(n=6)
    want = _logits(_outlier_stream(_model()), data)
    errors = {}
    for name, text in (("plain", W8A8), ("rotated", W8A8 + RESIDUAL)):
        model = _outlier_stream(_model())
        calibrate(model, data, _recipe(text), batch_size=2, progress=False)
        errors[name] = float((_logits(model, data) - want).pow(2).mean())
    assert errors["rotated"] < 0.5 * errors["plain"], errors


def _sharded_run(folder: str, recipe_text: str, out: str = "", checkpoint: str | None = None,
                 interrupt: int | None = None) -> dict:  # fmt: skip
    """Load ``folder`` sharded and untied, calibrate (optionally checkpointed, interrupted), export to ``out``."""
    from shardcal.export import export_checkpoint

    model = load_pretrained(folder, untie_word_embeddings=True)
    data = _data(n=6)
    try:
        with interrupt_after(interrupt):
            calibrate(model, data, _recipe(recipe_text), batch_size=2, progress=False, checkpoint_dir=checkpoint)
    except CalibrationInterrupted:
        return {"interrupted": True}
    if out:
        export_checkpoint(model, out)
    return {"interrupted": False, "logits": _logits(model, data[:2])}


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tied"), "llama", num_hidden_layers=3,
                                    tie_word_embeddings=True))  # fmt: skip


@pytest.mark.parametrize("algorithm", ["", '[algorithm]\nname = "gptq"\nstream_correction = 0.25\n'])
def test_two_ranks_equal_one_and_the_export_reloads(tied_checkpoint, tmp_path, algorithm):
    """A tied checkpoint loaded sharded and untied, rotated, calibrated (round to nearest, or GPTQ with the
    full-precision stream) and exported: the same logits at 1 and 2 ranks, and the export — untied, its head stored
    — reloads to them in shardcal and in transformers."""
    text = W8A8 + RESIDUAL + algorithm
    (one,) = run_on_ranks(1, _sharded_run, tied_checkpoint, text, str(tmp_path / "one"))
    two = run_on_ranks(2, _sharded_run, tied_checkpoint, text, str(tmp_path / "two"))
    assert all(torch.equal(r["logits"], one["logits"]) for r in two)
    out = tmp_path / "one"
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert torch.equal(_logits(from_pretrained(out), _data(n=6)[:2]), one["logits"])
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = hf_logits(hf, _data(n=6)[:2])
    assert (theirs - one["logits"]).abs().max() <= 2e-2 * one["logits"].abs().max()  # int8 inputs: rounding ties


def test_a_rotated_run_resumes_on_another_world_size_to_the_same_logits(tied_checkpoint, tmp_path):
    text = W8A8 + RESIDUAL
    (full,) = run_on_ranks(1, _sharded_run, tied_checkpoint, text)
    folder = str(tmp_path / "ckpt")
    assert all(r["interrupted"] for r in run_on_ranks(2, _sharded_run, tied_checkpoint, text, "", folder, 2))
    (resumed,) = run_on_ranks(1, _sharded_run, tied_checkpoint, text, "", folder)
    assert torch.equal(resumed["logits"], full["logits"])


def test_the_skeleton_check_refuses_gemma_before_loading(tmp_path):
    from shardcal.plan.preflight import check_recipe_fits

    model = copy.deepcopy(hf_model("gemma3")).to("meta")
    with pytest.raises(ModelLayoutError, match="post_attention_layernorm"):
        check_recipe_fits(model, _recipe(W8A8 + RESIDUAL))


def test_recipe_keys():
    recipe = _recipe(W8A8 + RESIDUAL)
    assert recipe.rotation.residual == "random-hadamard" and recipe.rotation.block is None
    assert recipe.rotation_block("model.layers.0.mlp.down_proj", 128) is None
    both = _recipe(W8A8 + RESIDUAL + 'block = 32\ninclude = ["*.down_proj"]\n')
    assert both.rotation_block("model.layers.0.mlp.down_proj", 128) == 32
    assert both.to_dict()["rotation"] == {"residual": "random-hadamard", "seed": 3, "type": "hadamard", "block": 32,
                                          "include": ["*.down_proj"], "exclude": []}  # fmt: skip
    for table, key in (
        ('residual = "random"', "rotation.residual"),
        ('residual = "hadamard"\nseed = -1', "rotation.seed"),
        ('residual = "hadamard"\ninclude = ["*"]', "rotation.include"),
        ("seed = 1", "rotation.block"),
    ):
        with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
            _recipe(f"{W8A8}[rotation]\n{table}\n")
