"""Quantizer behaviour the mutation check found unguarded, each against a reference written out here.

* the mse observer tries every candidate ``amax * (1 - i / grid)`` down to ``1 - max_shrink`` (brute force with a
  hand-written int8 fake quantization, on data whose best candidate is the smallest one);
* a state dict whose amax is NaN (never calibrated) loads as *uncalibrated*, so quantizing raises;
* quantizers needing different numbers of passes calibrate together: every one gets all of its passes, in a
  session and in a layer run (percentile inputs with max outputs, the outputs' amax against hooks).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import CalibrationSession, QuantizerSpec, TensorQuantizer, iter_quantizers
from shardcal.quant.quantizer import NotCalibratedError

from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


def _int8_qdq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = amax / 127.0
    return torch.clamp(torch.round(x / scale), -128.0, 127.0) * scale


def test_mse_observer_tries_every_candidate_down_to_max_shrink():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(100_000, generator=g) * 2 - 1
    x[17] = 40.0  # one outlier: clipping as far as allowed is best
    grid, shrink = 100, 0.2
    spec = QuantizerSpec("int8", observer="mse", observer_params={"grid": grid, "max_shrink": shrink})
    q = TensorQuantizer(spec, (1,))
    amax = q.calibrate_from(x[:, None])
    full = x.abs().max()
    fractions = torch.tensor([1.0 - i / grid for i in range(int(round(shrink * grid)) + 1)], dtype=torch.float32)
    errors = torch.stack([(x - _int8_qdq(x, full * f)).double().pow(2).sum() for f in fractions])
    best = int(errors.argmin())
    assert best == len(fractions) - 1  # the data make the last candidate the best: the check can see it missing
    assert torch.equal(amax, (full * fractions[best]).reshape(1))


def test_state_dict_with_nan_amax_loads_uncalibrated():
    spec = QuantizerSpec("int8")
    fresh = TensorQuantizer(spec, (8,))
    target = TensorQuantizer(spec, (8,))
    target.load_state_dict(fresh.state_dict())  # amax NaN: never calibrated
    assert not target.calibrated
    with pytest.raises(NotCalibratedError):
        target(torch.ones(2, 8))
    fresh.set_amax(torch.tensor([2.0]))
    target.load_state_dict(fresh.state_dict())
    assert target.calibrated and torch.equal(target.amax, torch.tensor([2.0]))


def test_a_session_gives_every_quantizer_all_its_passes():
    x = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(1))
    quick = TensorQuantizer(QuantizerSpec("int8"), (16,))
    slow = TensorQuantizer(QuantizerSpec("int8", observer="percentile", observer_params={"percentile": 90.0}), (16,))
    session = CalibrationSession([quick, slow])
    assert session.num_passes == 2
    assert list(_run(session, [quick, slow], x)) == [0, 1]
    assert quick.calibrated and slow.calibrated
    assert torch.equal(quick.amax, x.abs().max().reshape(1)) and slow.amax.item() < quick.amax.item()


def _run(session, quantizers, x):
    for p in session.passes():
        for q in quantizers:
            q(x)
        yield p


MIXED = """
[weight]
format = "int8"
granularity = "channel"
[input]
format = "int8"
observer = { name = "percentile", percentile = 99.0 }
[output]
format = "int8"
observer = "max"
"""


def test_a_layer_with_one_and_two_pass_quantizers():
    """Percentile inputs (two passes) and max outputs (one) in one layer run: both complete, and the outputs' amax
    is ``abs().amax`` of each Linear's output, recorded by hooks on a plain copy of the model."""
    cfg = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    reference = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(reference)
    outputs: dict[str, torch.Tensor] = {}
    for name, m in reference.model.layers.named_modules(prefix="model.layers"):
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                lambda m, a, out, name=name: outputs.__setitem__(
                    name, torch.maximum(outputs.get(name, torch.tensor(0.0)), out.detach().abs().max())
                )
            )
    with torch.no_grad():
        reference(ids)
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    calibrate(model, ids, parse_recipe(MIXED, "mixed.toml"), batch_size=2, progress=False)
    got = {n.removesuffix(".output_quantizer"): q for n, q in iter_quantizers(model) if n.endswith("output_quantizer")}
    assert got.keys() == outputs.keys()
    for name, amax in outputs.items():
        torch.testing.assert_close(got[name].amax, amax.reshape(1), rtol=1e-5, atol=0, msg=name)
    inputs = [q for n, q in iter_quantizers(model) if n.endswith("input_quantizer")]
    assert inputs and all(q.calibrated and q.num_observed for q in inputs)
