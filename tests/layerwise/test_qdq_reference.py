"""``propagate="qdq"`` against a plain loop that fake-quantizes each layer by hand and feeds the next.

The other qdq tests compare qdq with qdq (another world size, a resumed run). Here the reference is written out in
the test, without shardcal's quantizers: for each decoder layer, record ``abs().amax`` of every Linear's input over
all batches in full precision, then run the layer once more with its weights replaced by their int8 per-channel
fake quantization and each Linear's input fake-quantized with the recorded range (``clamp(round(x / s), -128, 127)
* s``, ``s = amax / 127``); those outputs are the next layer's inputs. With ``propagate="fp"`` the next inputs are the
full-precision outputs instead; the two references differ on many quantizers, and each mode must match its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardcal.calib.runner import calibrate
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers
from shardcal.sharding.fsdp2 import fsdp2_wrap

from _dist import run_on_ranks
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)
DATA = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(3))
BATCH = 2


def _model() -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(CFG))
    randomize_(model)
    return model.eval().requires_grad_(False)


def _fake_int8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / 127.0
    return (torch.clamp(torch.round(x.float() / scale), -128.0, 127.0) * scale).to(x.dtype)


def _plain_loop(propagate: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every Linear input's amax (by Linear name) and the logits of DATA[:2] of the hand-quantized model."""
    model = _model()
    batches = [model.model.embed(DATA[s : s + BATCH]) for s in range(0, DATA.shape[0], BATCH)]
    hidden = [b.hidden_states for b in batches]
    ranges: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        linears = {n: m for n, m in layer.named_modules(prefix=f"model.layers.{i}") if isinstance(m, nn.Linear)}

        def run(h_list: list[torch.Tensor], layer: nn.Module = layer) -> list[torch.Tensor]:
            return [
                layer(h, position_embeddings=b.position_embeddings, attention_mask=b.attention_mask)
                for h, b in zip(h_list, batches)
            ]

        def record(m, args, name):
            seen = args[0].abs().max()
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

        hooks = [m.register_forward_pre_hook(lambda m, a, n=n: record(m, a, n)) for n, m in linears.items()]
        fp_outputs = run(hidden)
        for h in hooks:
            h.remove()
        for m in linears.values():  # from here on the layer is the quantized one (also for the logits below)
            m.weight.copy_(_fake_int8(m.weight, m.weight.abs().amax(dim=1, keepdim=True)))
        hooks = [
            m.register_forward_pre_hook(lambda m, a, n=n: (_fake_int8(a[0], ranges[n]),)) for n, m in linears.items()
        ]
        hidden = fp_outputs if propagate == "fp" else run(hidden)
    logits = model(DATA[:2])
    return ranges, logits


def _calibrated(propagate: str, wrap: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _model()
    if wrap:
        fsdp2_wrap(model)
    calibrate(model, DATA, "w8a8-int8", batch_size=BATCH, progress=False, propagate=propagate)
    amax = {
        n.removesuffix(".input_quantizer"): q.amax.clone()
        for n, q in iter_quantizers(model)
        if n.endswith("input_quantizer")
    }
    with torch.no_grad():
        logits = model(DATA[:2])
    return amax, logits


def test_reference_modes_differ():
    """The check below can tell the two modes apart: qdq's inputs are not fp's beyond the first layer."""
    fp, _ = _plain_loop("fp")
    qdq, _ = _plain_loop("qdq")
    differ = [n for n in fp if not torch.allclose(fp[n], qdq[n], rtol=1e-4, atol=0)]
    assert len(fp) == 4 * 7 and len(differ) >= 14, differ  # 20 of 28 here
    assert all(not n.startswith("model.layers.0.") for n in differ)


@pytest.mark.parametrize("propagate", ["qdq", "fp"])
def test_calibration_equals_the_plain_loop(propagate):
    want, want_logits = _plain_loop(propagate)
    got, logits = _calibrated(propagate, False)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name].reshape(1), rtol=1e-5, atol=0, msg=name)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_two_sharded_ranks_equal_the_plain_loop():
    want, want_logits = _plain_loop("qdq")
    for got, logits in run_on_ranks(2, _calibrated, "qdq", True):
        for name in want:
            torch.testing.assert_close(got[name], want[name].reshape(1), rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
