"""Recipes: the shipped ones, module selection, and errors that name the file and the key."""

import pytest

import shardcal
from shardcal.algorithms import ALGORITHMS, LayerAlgorithm, make_algorithm, register_algorithm
from shardcal.calib.recipe import Recipe
from shardcal.calib.recipes import load_recipe, parse_recipe, shipped_recipes
from shardcal.errors import RecipeError
from shardcal.quant import QuantizerSpec
from shardcal.runtime.params import integer, number


def test_shipped_recipes():
    assert {"fp8", "nvfp4", "w4a16", "w8a8-int8"} <= set(shipped_recipes())
    r = load_recipe("w8a8-int8")
    assert r.name == "w8a8-int8" and r.source.endswith("w8a8-int8.toml")
    assert r.weight == QuantizerSpec("int8", "channel", axis=0)
    assert r.input == QuantizerSpec("int8", "tensor") and r.output is None
    r = load_recipe("fp8")
    assert r.weight == QuantizerSpec("fp8_e4m3") and r.input == QuantizerSpec("fp8_e4m3")
    r = load_recipe("w4a16")
    assert r.weight.format == "int4" and r.weight.group_size == 128 and r.weight.observer == "mse" and r.input is None
    r = load_recipe("nvfp4")
    assert r.weight == QuantizerSpec("nvfp4") and r.input == QuantizerSpec("nvfp4")
    assert r.weight.granularity == "group" and r.weight.group_size == 16
    assert r.algorithm == {"name": "rtn"}


def test_load_by_path_and_passthrough(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[weight]\nformat = "fp8_e4m3"\ngranularity = "channel"\n')
    r = load_recipe(f)
    assert r.name == "mine" and r.weight.axis == 0 and load_recipe(str(f)) == r and load_recipe(r) is r
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.toml")
    with pytest.raises(RecipeError, match=r"^unknown recipe 'w3a3'; `shardcal recipes` lists them, or pass a path"):
        load_recipe("w3a3")
    with pytest.raises(RecipeError, match=r"^unknown recipe 'fp8-dynamc' \(did you mean 'fp8-dynamic'\?\)"):
        load_recipe("fp8-dynamc")
    with pytest.raises(RecipeError, match=r"'w8a8-int9' \(did you mean 'w8a8-int8'\?\)"):
        load_recipe("w8a8-int9")


def test_a_toml_name_is_a_file_never_the_shipped_recipe(tmp_path, monkeypatch):
    """``--recipe w4a16-gptq.toml`` where no such file exists is an error, not the shipped ``w4a16-gptq``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"^w4a16-gptq.toml: no such recipe file; 'w4a16-gptq' is the name of a "):
        load_recipe("w4a16-gptq.toml")
    (tmp_path / "w4a16-gptq.toml").write_text('name = "mine"\n[weight]\nformat = "int8"\ngranularity = "channel"\n')
    assert load_recipe("w4a16-gptq.toml").name == "mine"  # an existing file is read, whatever its name


def test_default_excludes_and_patterns():
    r = load_recipe("fp8")
    for name in (
        "lm_head",
        "model.lm_head",
        "model.layers.3.mlp.gate",
        "model.layers.0.block_sparse_moe.gate",
        "model.layers.1.mlp.shared_expert_gate",
        "model.vision_tower.blocks.0.fc1",
        "visual.blocks.0.qkv",
    ):
        assert not r.matches(name), name
    for name in (
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.block_sparse_moe.experts.0.w1",
        "model.layers.1.mlp.shared_expert.gate_proj",
    ):
        assert r.matches(name), name
    r = parse_recipe(
        '[targets]\ninclude = ["re:.*_proj"]\nexclude = ["*.k_proj"]\ndefault_excludes = false\n'
        '[weight]\nformat = "int8"\n'
    )
    assert r.matches("a.q_proj") and not r.matches("a.k_proj") and not r.matches("a.w1")
    assert parse_recipe('[targets]\ninclude = ["*"]\ndefault_excludes = false\n[weight]\nformat = "int8"\n').matches(
        "lm_head"
    )


BAD = [
    ('name = "x"\ncolour = "red"\n[weight]\nformat = "int8"\n', "'colour': unknown key"),
    (
        '[weight]\nformat = "fp8_e4m3"\n[output]\nformat = "fp8_e4m3"\ngranularity = "block"\nblock_size = [128, 128]\n',
        "'output.granularity': 'block' is for weights",
    ),
    (
        '[weight]\nformat = "fp8_e4m3"\n[input]\nformat = "fp8_e4m3"\ngranularity = "block"\nblock_size = [128, 128]\n',
        "'input.granularity': 'block' is for weights",
    ),
    (
        '[weight]\nformat = "int8"\ngranularity = "block"\nblock_size = [128, 128]\nsymmetric = false\n',
        "'weight.granularity': granularity 'block' is for static symmetric",
    ),
    ('[weight]\nformat = "fp8_e4m3"\ngranularity = "block"\nblock_size = 128\n', "'weight.block_size': must be"),
    ('[weight]\nformat = "mxfp4"\ngranularity = "group"\ngroup_size = 16\n', "'weight.granularity': mxfp4 always"),
    ('[weight]\nformat = "int8"\nfomat = "int8"\n', "'weight.fomat': unknown key"),
    ('[weight]\nformat = "int3"\n', "'weight.format': unknown format 'int3'"),
    ('[weight]\ngranularity = "tensor"\n', "'weight.format': missing"),
    ('[weight]\nformat = "int8"\nobserver = "minmax"\n', "'weight.observer': unknown observer 'minmax'"),
    ('[input]\nformat = "int8"\nobserver = { name = "percentile", percentile = 120 }\n', "'input.observer.percentile'"),
    ('[input]\nformat = "int8"\nobserver = { name = "mse", bins = 3 }\n', "'input.observer.bins': unknown parameter"),
    ('[input]\nformat = "int8"\nobserver = { percentile = 99 }\n', "'input.observer.name': missing"),
    ('[weight]\nformat = "int4"\ngranularity = "group"\n', "'weight.group_size'"),
    (
        '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = "128"\n',
        "'weight.group_size': must be an integer",
    ),
    ('[weight]\nformat = "int4"\ngroup_size = 128\n', "'weight.group_size': group_size is only valid"),
    ('[weight]\nformat = "int8"\ngranularity = "row"\n', "'weight.granularity': unknown granularity 'row'"),
    ('[weight]\nformat = "int8"\naxis = 0\n', "'weight.axis'"),
    (
        '[weight]\nformat = "fp8_e4m3"\nsymmetric = false\n',
        "'weight.symmetric': asymmetric quantization (symmetric = false) needs an int format, not 'fp8_e4m3'",
    ),
    (
        '[weight]\nformat = "int8"\nsymmetric = false\nobserver = "percentile"\n',
        "'weight.symmetric': asymmetric quantization is calibrated by the 'max' or 'mse' observer, not 'percentile'",
    ),
    ('[input]\nformat = "int8"\nsymmetric = false\n', "'input.symmetric': asymmetric quantization is for weights only"),
    (
        '[weight]\nformat = "int8"\nsymmetric = false\n[input]\nformat = "int8"\n',
        "'weight.symmetric': asymmetric weights are for weight-only recipes",
    ),
    ('[weight]\nformat = "int8"\ndynamic = true\n', "'weight.dynamic': weights are quantized statically"),
    (
        '[weight]\nformat = "nvfp4"\ngranularity = "group"\ngroup_size = 32\n',
        "'weight.granularity': nvfp4 always uses blocks of 16",
    ),
    ('[weight]\nformat = "int8"\n[algorithm]\nname = "spinquant"\n', "'algorithm.name': unknown algorithm 'spinquant'"),
    ('[weight]\nformat = "int8"\n[algorithm]\nname = "rtn"\nblocksize = 128\n', "'algorithm.blocksize'"),
    ('[targets]\ninclude = ["re:(["]\n[weight]\nformat = "int8"\n', "'targets.include[0]': invalid regular expression"),
    ('[targets]\nexclude = [1]\n[weight]\nformat = "int8"\n', "'targets.exclude': must be a list of strings"),
    ('weight = "int8"\n', "'weight': must be a table"),
    ('name = "empty"\n', "at least one of"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_recipe_errors_name_file_and_key(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(f)
    assert str(info.value).startswith(f"{f}: "), str(info.value)
    assert message in str(info.value), str(info.value)


def test_malformed_toml(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text('[weight\nformat = "int8"\n')
    with pytest.raises(RecipeError, match=r"broken\.toml: not valid TOML"):
        load_recipe(f)


class _Scaled(LayerAlgorithm):
    """A user's algorithm: one class with its name, schema and hooks."""

    name = "scaled-test"
    schema = {"alpha": (0.5, number(0.0, 1.0)), "steps": (2, integer(1))}


def test_register_algorithm_extension_point():
    assert "scaled-test" not in ALGORITHMS  # nothing registers on import
    register_algorithm(_Scaled)
    try:
        r = parse_recipe('[weight]\nformat = "int8"\n[algorithm]\nname = "scaled-test"\nsteps = 3\n')
        assert r.algorithm == {"name": "scaled-test", "alpha": 0.5, "steps": 3}
        algorithm = make_algorithm(r.algorithm)
        assert isinstance(algorithm, _Scaled) and algorithm.params == {"alpha": 0.5, "steps": 3}
        with pytest.raises(RecipeError, match="'algorithm.beta': unknown parameter 'beta' for algorithm 'scaled-test'"):
            parse_recipe('[weight]\nformat = "int8"\n[algorithm]\nname = "scaled-test"\nbeta = 1\n')
        with pytest.raises(RecipeError, match="'algorithm.alpha': algorithm 'scaled-test': alpha must be in"):
            parse_recipe('[weight]\nformat = "int8"\n[algorithm]\nname = "scaled-test"\nalpha = 2\n')
    finally:
        ALGORITHMS.pop("scaled-test")
    with pytest.raises(TypeError):
        register_algorithm(lambda params: params)


def test_one_registry_defaults_agree():
    """The recipe's defaults are the algorithm's own: a recipe without parameters builds the same object."""
    from shardcal.algorithms.gptq import GPTQ
    from shardcal.algorithms.gptq_solve import DEFAULTS

    r = parse_recipe('[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\n[algorithm]\nname = "gptq"\n')
    assert {k: r.algorithm[k] for k in DEFAULTS} == DEFAULTS
    assert make_algorithm(r.algorithm).params == GPTQ().params


def test_spec_round_trips_through_dict():
    for name in shipped_recipes():
        r = load_recipe(name)
        for spec in r.specs.values():
            assert QuantizerSpec.from_dict(spec.to_dict()) == spec
            hash(spec)
        assert isinstance(r, Recipe) and r.to_dict()["name"] == name


def test_top_level_load_recipe_when_exported():
    if not hasattr(shardcal, "load_recipe"):
        pytest.skip("shardcal.load_recipe is re-exported by the package lead")
    assert shardcal.load_recipe("fp8") == load_recipe("fp8")
