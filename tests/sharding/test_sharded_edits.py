"""Weight edits made while a layer is gathered reach the shards: sharded calibration equals the plain model's.

The other algorithm tests compare a sharded run with a sharded run (2 ranks with 1 rank, resumed with whole): if the
edits of SmoothQuant folding or GPTQ were dropped when a layer is resharded, both sides would drop them alike. Here
the reference is the same calibration on the plain, unwrapped model in this process, where an edit is an edit; the
2-rank FSDP2 run must end with the same weights (gathered with ``full_tensor``), ranges and logits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)
IDS = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(13))
RECIPES = {
    "smoothquant+gptq": '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n'
    '[algorithm]\nname = "gptq"\nsmooth = { name = "smoothquant", alpha = 0.8 }\n',
    "awq": '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\n[algorithm]\nname = "awq"\n',
}


def _calibrated(recipe: str, wrap: bool) -> dict:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    with torch.no_grad():  # outlier channels, so that smoothing really moves weights
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 30.0
    model.eval()
    if wrap:
        fsdp2_wrap(model)
    calibrate(model, IDS, parse_recipe(RECIPES[recipe], f"{recipe}.toml"), batch_size=2, progress=False)
    state = {
        n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
        for n, p in model.named_parameters()
    }
    state.update({f"{n}.amax": q.amax.clone() for n, q in iter_quantizers(model) if q.amax is not None})
    with torch.no_grad():
        logits = model(IDS[:2])
    return {"state": state, "logits": logits}


def _original_weights() -> dict[str, torch.Tensor]:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if isinstance(model.get_submodule(n.rsplit(".", 1)[0]), nn.Linear)
    }


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_two_sharded_ranks_keep_the_algorithms_weight_edits(recipe):
    plain = _calibrated(recipe, wrap=False)
    original = _original_weights()
    edited = [n for n in original if n in plain["state"] and not torch.equal(plain["state"][n], original[n])]
    assert len(edited) >= 7  # the algorithm did change weights: the comparison below can see them dropped
    for result in run_on_ranks(2, _calibrated, recipe, True):
        assert result["state"].keys() == plain["state"].keys()
        for name, want in plain["state"].items():
            torch.testing.assert_close(result["state"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(result["logits"], plain["logits"], rtol=1e-4, atol=1e-4)
