"""Online Hadamard input rotations (a recipe's ``[rotation]``): calibration, export as compressed-tensors'
``transform_config``, reload by shardcal and by transformers + compressed-tensors' own transforms, two ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardcal.calib.attach import quantize_modules
from shardcal.calib.recipes import load_recipe, parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.errors import CheckpointError, ConfigError, ExportError, RecipeError
from shardcal.export import export_checkpoint
from shardcal.models import CausalLM, ModelConfig, from_pretrained
from shardcal.quant import quantized_modules
from shardcal.quant.session import quantizer_mode

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = pytest.mark.numerics

CFG = dict(TINY_CONFIGS["llama"], hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=2)
W8A8 = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
ROTATE_DOWN = '[rotation]\nblock = 64\ninclude = ["*.down_proj", "*.o_proj"]\n'
#: Blocks of 256 where the inputs are 256 wide (down_proj), of 128 (the largest that divides) for the other Linears.
TWO_BLOCKS = "[rotation]\nblock = 256\n"
W4A16_GPTQ = (
    '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 64\n[algorithm]\nname = "gptq"\n'
    "[rotation]\nblock = 64\n"
)


def _recipe(text: str, name: str = "rotated"):
    return parse_recipe(text, source=f"{name}.toml", default_name=name)


def _model(cfg: dict = CFG, seed: int = 0) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model, seed=seed)
    return model.eval()


def _data(n: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _with_outliers(model: CausalLM, factor: float = 40.0) -> CausalLM:
    """The same function, with four huge channels in every down_proj input (up_proj rows times ``factor``, the
    matching down_proj columns divided by it): what a per-tensor input scale suffers from."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[:4] *= factor
            layer.mlp.down_proj.weight[:, :4] /= factor
    return model


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """name -> (calibrated model, export dir)."""
    cache: dict[str, tuple[CausalLM, Path]] = {}
    recipes = {"w8a8": W8A8 + ROTATE_DOWN, "w4a16-gptq": W4A16_GPTQ, "two-blocks": W8A8 + TWO_BLOCKS}

    def get(name: str) -> tuple[CausalLM, Path]:
        if name not in cache:
            model = _with_outliers(_model())
            recipe = _recipe(recipes[name], name) if name in recipes else load_recipe(name)  # else a shipped one
            report = calibrate(model, _data(), recipe, batch_size=2, progress=False)
            out = tmp_path_factory.mktemp(name) / "export"
            export_checkpoint(model, out, report=report, max_shard_bytes=150_000)
            cache[name] = (model, out)
        return cache[name]

    return get


# ----------------------------------------------------------------------------------------------- calibration


def test_rotated_model_in_full_precision_computes_the_model():
    reference = _model()
    model = _model()
    data = _data(2, seed=3)
    quantize_modules(model.model.layers[0], _recipe(W8A8 + ROTATE_DOWN), prefix="model.layers.0")
    rotated = dict(quantized_modules(model))
    assert rotated["model.layers.0.mlp.down_proj"].input_rotation == 64
    assert rotated["model.layers.0.self_attn.q_proj"].input_rotation is None
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, reference.model.layers[0].mlp.down_proj.weight)
    with torch.no_grad(), quantizer_mode(model, "disabled"):
        assert torch.allclose(model(data), reference(data), atol=1e-5)


def test_rotation_removes_most_of_the_static_int8_error_of_outlier_channels():
    """Per-tensor int8 inputs of down_proj with four channels 40x the rest: the rotation spreads them over their
    block, and the quantized model's logits come much closer to the full-precision ones."""
    data, held = _data(), _data(2, seed=9)
    with torch.no_grad():
        reference = _with_outliers(_model())(held)
    errors = {}
    for name, text in (("plain", W8A8), ("rotated", W8A8 + ROTATE_DOWN)):
        model = _with_outliers(_model())
        calibrate(model, data, _recipe(text, name), batch_size=2, progress=False)
        with torch.no_grad():
            errors[name] = (model(held) - reference).pow(2).mean().item()
    assert errors["rotated"] < 0.25 * errors["plain"], errors


def test_algorithms_see_the_rotated_inputs():
    """GPTQ's Gram matrix of a rotated Linear is that of ``x H`` (H from compressed-tensors), not of ``x``."""
    ct_hadamard = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    from shardcal.algorithms.stats import InputStats
    from shardcal.layerwise.batches import model_batches
    from shardcal.layerwise.steps import layer_steps

    model = _model()
    layer = model.model.layers[0]
    quantize_modules(layer, _recipe(W4A16_GPTQ), prefix="model.layers.0")
    captured = []
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0].detach().clone()))
    step = next(iter(layer_steps(model, model_batches(model, _data(2, 8), 2))))
    stats = InputStats({"down": (layer.mlp.down_proj, "input")}, {"gram"}).collect(step)
    h = ct_hadamard.deterministic_hadamard_matrix(64, torch.float64, torch.device("cpu")) / 8
    x = captured[-1].reshape(-1, 256).double() @ torch.block_diag(*[h] * 4)
    assert stats["down"].tokens == x.shape[0]
    assert torch.allclose(stats["down"].hessian(), x.T @ x, rtol=1e-4, atol=1e-4)


def test_smoothing_leaves_out_pairs_into_rotated_inputs():
    from shardcal.algorithms.mappings import layer_smoothings

    layer = _model().model.layers[0]
    assert "up_down" in {s.kind for s in layer_smoothings(layer)}
    quantize_modules(layer, _recipe(W8A8 + ROTATE_DOWN), prefix="model.layers.0")
    assert {s.kind for s in layer_smoothings(layer)} == {"attn_in", "mlp_in"}  # v_o feeds the rotated o_proj
    assert {s.kind for s in layer_smoothings(layer, rotated_consumers=True)} == {"attn_in", "v_o", "mlp_in", "up_down"}


def test_a_layer_falling_back_to_full_precision_gets_its_unrotated_weights_back():
    fallback = "[fallback]\nmin_layer_sqnr_db = 1000.0\nfull_precision = true\n"
    model, reference = _model(), _model()
    report = calibrate(model, _data(), _recipe(W8A8 + ROTATE_DOWN + fallback), batch_size=2, progress=False)
    assert report.fallback_layers == ["model.layers.0", "model.layers.1"]
    assert not quantized_modules(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_block_that_does_not_divide_takes_the_largest_power_of_two_that_does():
    model = _model()
    quantize_modules(model.model.layers[0], _recipe(W8A8 + "[rotation]\nblock = 256\n"), prefix="model.layers.0")
    blocks = {n.rsplit(".", 1)[-1]: m.input_rotation for n, m in quantized_modules(model)}
    assert blocks == {"q_proj": 128, "k_proj": 128, "v_proj": 128, "o_proj": 128, "gate_proj": 128, "up_proj": 128,
                      "down_proj": 256}  # fmt: skip


def test_a_linear_without_a_block_of_16_is_refused_before_calibrating():
    model = _model(dict(CFG, intermediate_size=200))  # down_proj: 200 = 8 x 25
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(
        RecipeError, match=r"'model.layers.0.mlp.down_proj'.*in_features 200 has no power-of-two divisor of at least 16"
    ):
        calibrate(model, _data(), _recipe(W8A8 + "[rotation]\nblock = 64\n"), batch_size=2, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not one layer rotated
    with pytest.raises(RecipeError, match=r"rotation.type.*unknown rotation type 'random-hadamard'"):
        _recipe(W8A8 + '[rotation]\ntype = "random-hadamard"\nblock = 64\n')
    with pytest.raises(RecipeError, match=r"rotation.block.*missing"):
        _recipe(W8A8 + "[rotation]\n")
    with pytest.raises(RecipeError, match=r"rotation.block.*must be a power of two"):
        _recipe(W8A8 + "[rotation]\nblock = 48\n")


# ----------------------------------------------------------------------------------------------- export


def test_export_writes_a_transform_config_compressed_tensors_reads(rotated):
    transform = pytest.importorskip("compressed_tensors.transform")
    ct_hadamard = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    model, out = rotated("w8a8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    config = transform.TransformConfig.model_validate(qc["transform_config"])
    assert json.loads(json.dumps(config.model_dump(mode="json"))) == qc["transform_config"]
    (scheme,) = config.config_groups.values()
    assert (scheme.type, scheme.head_dim, scheme.randomize) == ("hadamard", 64, False)
    online, fused = scheme.apply
    expected = sorted(f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.o_proj"))
    assert (online.location, sorted(online.targets), online.inverse) == ("input", expected, False)
    assert (fused.location, sorted(fused.targets), fused.inverse) == ("weight_input", expected, True)
    tensors = _tensors(out)
    hadamard = ct_hadamard.deterministic_hadamard_matrix(64, torch.float32, torch.device("cpu"))
    stored = {k: v for k, v in tensors.items() if "hadamard" in k}
    assert sorted(stored) == [f"{n}.hadamard_64_input.weight" for n in expected]
    assert all(torch.equal(v, hadamard) for v in stored.values())


def test_two_block_sizes_give_two_transform_groups_each_of_its_own_linears(rotated):
    """One ``hadamard_<block>`` group per block size, each naming exactly the Linears rotated with that block (a
    Linear named by both would be rotated twice by vLLM); compressed-tensors parses it, shardcal reloads it."""
    transform = pytest.importorskip("compressed_tensors.transform")
    model, out = rotated("two-blocks")
    blocks = {n: m.input_rotation for n, m in quantized_modules(model)}
    by_block = {b: sorted(n for n, v in blocks.items() if v == b) for b in (128, 256)}
    assert by_block[256] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)] and len(by_block[128]) == 12
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = qc["transform_config"]["config_groups"]
    assert sorted(groups) == ["hadamard_128", "hadamard_256"]
    for block, names in by_block.items():
        scheme = groups[f"hadamard_{block}"]
        assert scheme["head_dim"] == block
        assert [(a["location"], sorted(a["targets"])) for a in scheme["apply"]] == [
            ("input", names),
            ("weight_input", names),
        ]
    config = transform.TransformConfig.model_validate(qc["transform_config"])
    assert {g.head_dim for g in config.config_groups.values()} == {128, 256}
    assert {n: m.input_rotation for n, m in quantized_modules(from_pretrained(out))} == blocks


@pytest.mark.parametrize("name", ["w8a8", "w4a16-gptq", "w4a16-gptq-rot-g64-asym", "two-blocks"])
def test_reload_computes_the_calibrated_models_logits(name, rotated):
    model, out = rotated(name)
    reloaded = from_pretrained(out)
    assert {n: m.input_rotation for n, m in quantized_modules(reloaded)} == {
        n: m.input_rotation for n, m in quantized_modules(model)
    }
    data = _data(3, seed=7)
    with torch.no_grad():
        assert torch.equal(reloaded(data), model(data))


@pytest.mark.parametrize("name", ["w8a8", "w4a16-gptq", "two-blocks"])
def test_transformers_with_compressed_tensors_transforms_computes_our_logits(name, rotated):
    """transformers loads the weights and scales; compressed-tensors' own Hadamard transforms, built from the
    online part of our transform_config, rotate the inputs: the logits are ours (to rounding: the rotation is a
    matmul there, butterflies here)."""
    transformers = pytest.importorskip("transformers")
    transform = pytest.importorskip("compressed_tensors.transform")
    model, out = rotated(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    config = transform.TransformConfig.model_validate(qc["transform_config"])
    for scheme in config.config_groups.values():
        scheme.apply = [args for args in scheme.apply if args.location == "input"]  # the fused part is on disk
    transform.apply_transform_config(hf, config)
    data = _data(2, seed=5)
    with torch.no_grad():
        ours, theirs = model(data), hf(data).logits
    tolerance = 1e-4 if name == "w4a16-gptq" else 2e-2  # static int8 inputs: a rounding tie may fall either way
    assert (ours - theirs).abs().max() <= tolerance * ours.abs().max()
    if name == "w4a16-gptq":
        with torch.no_grad():
            unrotated = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(data).logits
        assert (ours - unrotated).abs().max() > 100 * tolerance * ours.abs().max()  # the transforms matter


def test_reload_refuses_transform_configs_it_cannot_run(rotated, tmp_path):
    _, out = rotated("w8a8")
    config = json.loads((out / "config.json").read_text())

    def broken(edit) -> Path:
        folder = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for f in out.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        changed = json.loads(json.dumps(config))
        edit(changed["quantization_config"]["transform_config"]["config_groups"]["hadamard_64"], folder)
        (folder / "config.json").write_text(json.dumps(changed))
        return folder

    def randomized(scheme, folder):
        scheme["randomize"] = True

    def other_block(scheme, folder):
        scheme["head_dim"] = 48

    def output_side(scheme, folder):
        scheme["apply"][0]["location"] = "output"

    for edit, message in (
        (randomized, r"config_groups.hadamard_64.type: only deterministic 'hadamard' rotations"),
        (other_block, r"config_groups.hadamard_64.head_dim: must be a power of two"),
        (output_side, r"apply\[0\].location: only input \(online\) and weight_input"),
    ):
        with pytest.raises(ConfigError, match=message):
            from_pretrained(broken(edit))

    def tampered(scheme, folder):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        key = "model.layers.1.mlp.down_proj.hadamard_64_input.weight"
        file = folder / index["weight_map"][key]
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = -1.0
        save_file(tensors, str(file), metadata={"format": "pt"})

    with pytest.raises(CheckpointError, match=r"down_proj.hadamard_64_input.weight' is not the 64 x 64 Sylvester"):
        from_pretrained(broken(tampered))


def test_uncalibrated_export_with_a_rotation_is_refused(tmp_path):
    weight_only = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 64\n' + ROTATE_DOWN
    with pytest.raises(ExportError, match=r"rotates its inputs \(\[rotation\]\): run shardcal.calibrate"):
        export_checkpoint(_model(), tmp_path / "out", recipe=_recipe(weight_only))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------- two ranks


def _calibrate_and_export_sharded(recipe_text: str, data: torch.Tensor, folder: str) -> None:
    from shardcal.sharding.fsdp2 import fsdp2_wrap

    model = _with_outliers(_model())
    fsdp2_wrap(model)
    calibrate(model, data, _recipe(recipe_text), batch_size=2, progress=False)
    export_checkpoint(model, Path(folder) / "out", max_shard_bytes=150_000)


SQ_ROT = W8A8 + '[algorithm]\nname = "smoothquant"\nalpha = 0.8\n[rotation]\nblock = 64\n'


@pytest.mark.parametrize(
    "recipe_text", [W8A8 + ROTATE_DOWN, W4A16_GPTQ, SQ_ROT], ids=["w8a8", "w4a16-gptq", "smoothquant-rotated"]
)
def test_two_ranks_export_the_same_bits_as_one_process(recipe_text, tmp_path):
    """2 ranks against 1 (both in worker processes, one thread each: GPTQ's solves then run the same kernels);
    SmoothQuant's rotated input amax from each rank's kept rows, all-reduced, is the same bits."""
    data = _data(n=5)
    run_on_ranks(2, _calibrate_and_export_sharded, recipe_text, data, str(tmp_path / "two"))
    run_on_ranks(1, _calibrate_and_export_sharded, recipe_text, data, str(tmp_path / "one"))
    a, b = _tensors(tmp_path / "two" / "out"), _tensors(tmp_path / "one" / "out")
    assert a.keys() == b.keys() and any("hadamard" in k for k in a)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(
            a[key].view(-1).view(torch.uint8), b[key].view(-1).view(torch.uint8)
        ), key
    config = (tmp_path / "two" / "out" / "config.json").read_text()
    assert json.loads(config) == json.loads((tmp_path / "one" / "out" / "config.json").read_text())


def _rotated_resume_run(directory: str, interrupt: int | None) -> dict:
    from _injected import CalibrationInterrupted, interrupt_after

    from shardcal.sharding.fsdp2 import fsdp2_wrap

    model = _with_outliers(_model(dict(CFG, num_hidden_layers=3)))
    fsdp2_wrap(model)
    data = _data(n=6)
    try:
        with interrupt_after(interrupt):
            calibrate(model, data, _recipe(W8A8 + ROTATE_DOWN), batch_size=2, progress=False, checkpoint_dir=directory)
    except CalibrationInterrupted:
        return {"interrupted": True}
    with torch.no_grad():
        return {"interrupted": False, "logits": model(data[:2])}


def test_a_rotated_run_resumes_on_another_world_size_to_the_same_logits(tmp_path):
    """Written by 2 ranks after 2 of 3 layers, resumed by 1: the finished layers' weights are rotated again from
    the loaded (sharded) ones, to the bits of the uninterrupted run."""
    (full,) = run_on_ranks(1, _rotated_resume_run, str(tmp_path / "full"), None)
    assert all(r["interrupted"] for r in run_on_ranks(2, _rotated_resume_run, str(tmp_path / "ckpt"), 2))
    (resumed,) = run_on_ranks(1, _rotated_resume_run, str(tmp_path / "ckpt"), None)
    assert not resumed["interrupted"] and torch.equal(resumed["logits"], full["logits"])


def test_smoothquant_smooths_a_rotated_consumer_before_its_rotation():
    """With down_proj rotated, SmoothQuant's up -> down scales come from the unrotated inputs (the same as without
    the rotation: up_proj ends up with the same weights), the fold keeps the function, and no other pair moves."""
    smooth = '[algorithm]\nname = "smoothquant"\nalpha = 0.5\n'
    models = {}
    for name, text in (("plain", W8A8 + smooth), ("rotated", W8A8 + smooth + ROTATE_DOWN)):
        models[name] = _with_outliers(_model())
        calibrate(models[name], _data(), _recipe(text, name), batch_size=2, progress=False, propagate="fp")
    for i in range(2):
        plain, rotated = models["plain"].model.layers[i], models["rotated"].model.layers[i]
        assert torch.allclose(rotated.mlp.up_proj.weight, plain.mlp.up_proj.weight, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(
            rotated.mlp.up_proj.weight, _with_outliers(_model()).model.layers[i].mlp.up_proj.weight
        )
    reference, data = _with_outliers(_model()), _data(2, seed=3)
    with torch.no_grad(), quantizer_mode(models["rotated"], "disabled"):
        assert torch.allclose(models["rotated"](data), reference(data), rtol=1e-4, atol=1e-5)


def _rotated_input_maxima(model: CausalLM, data: torch.Tensor) -> dict[str, float]:
    """Per rotated Linear, ``max |x H|`` over the model's own full-precision forward on ``data`` (every token real):
    what a max observer records on each layer's inputs under ``propagate="fp"``."""
    from shardcal.quant.linear import rotated_input

    found: dict[str, float] = {}
    hooks = []
    for name, m in quantized_modules(model):
        if m.input_rotation is not None:
            record = lambda mod, args, name=name: found.__setitem__(
                name, max(found.get(name, 0.0), float(rotated_input(mod, args[0]).abs().max()))
            )
            hooks.append(m.register_forward_pre_hook(record))
    with torch.no_grad(), quantizer_mode(model, "disabled"):
        for rows in data.split(2):
            model(rows)
    for h in hooks:
        h.remove()
    return found


@pytest.mark.parametrize("source", ["kept-rows", "observe"])
def test_smoothquant_gives_rotated_consumers_their_input_amax_without_an_observing_pass(source):
    """SmoothQuant + rotations, static per-tensor max inputs: each rotated consumer's input amax comes from the rows
    the statistics pass kept, smoothed and rotated as the Linear will — equal, to float rounding, to the maximum the
    calibrated model's own forward gives its rotated inputs — and every layer runs over the data once (plus the SQNR
    rows), not twice; with ``rotated_amax = "observe"`` an observing pass over the rotated layer records it."""
    smooth = f'[algorithm]\nname = "smoothquant"\nalpha = 0.8\nrotated_amax = "{source}"\n[rotation]\nblock = 64\n'
    model, data = _with_outliers(_model()), _data(6)
    runs = []
    hooks = [layer.register_forward_pre_hook(lambda *a: runs.append(1)) for layer in model.model.layers]
    calibrate(model, data, _recipe(W8A8 + smooth), batch_size=2, progress=False)
    for h in hooks:
        h.remove()
    passes = 1 if source == "kept-rows" else 2  # per layer: 3 batches a pass, and the SQNR on those 6 rows
    assert len(runs) == 2 * (3 * passes + 3)
    want = _rotated_input_maxima(model, data)
    assert len(want) == 2 * 7
    for name, m in quantized_modules(model):
        amax = float(m.input_quantizer.amax)
        assert amax == pytest.approx(want[name], rel=1e-5), name


def test_a_transformers_model_exported_rotated_reloads_through_transformers_with_its_rotations(tmp_path):
    """A model shardcal has no class for: calibrated as transformers' Llama, exported, and loaded the way
    ``shardcal eval`` loads it (transformers, then the online rotations from transform_config): our logits."""
    pytest.importorskip("compressed_tensors.transform")
    from _hf_models import hf_logits, hf_model

    from shardcal.loading.foreign import load_transformers_plain

    hf_model("llama").save_pretrained(tmp_path / "fp32")
    model = load_transformers_plain(tmp_path / "fp32")
    recipe = _recipe(W4A16_GPTQ.replace("group_size = 64", "group_size = 32"))
    calibrate(model, _data(), recipe, batch_size=2, progress=False)
    out = export_checkpoint(model, tmp_path / "out", recipe=recipe)
    data = _data(2, seed=4)
    ours = hf_logits(model, data)
    reloaded = hf_logits(load_transformers_plain(out), data)
    assert (ours - reloaded).abs().max() <= 1e-4 * ours.abs().max()
