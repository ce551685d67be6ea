"""Padding never counts, against references that never saw padding.

tests/calib/test_calibrate.py::test_padding_never_counts pads the same rows with two different tokens; that catches padding
that counts, but not a mask that is wrong in the same way for both (a real token dropped, a mask lost for rows the
batcher padded itself). Here padded batches are compared with references computed from the rows alone:

* observers: every activation quantizer's amax equals ``abs().amax`` of its Linear's input over the real tokens,
  recorded by hooks on a plain model that runs each row alone, and its element count is that of the real tokens;
* algorithms (SmoothQuant + GPTQ, AWQ) and the two-pass percentile observer: calibrating the padded batches gives
  the weights and amax of calibrating the rows one by one, unpadded; their input statistics (token count, max,
  Gram matrix, sum |x|) equal the same statistics computed by hand from the rows;
* the layer SQNR is the same padded or not.

The pad token's embedding is made 300x larger, so any padded position that counts moves an amax far off. Both ways
padding arises are covered: rows of different lengths that the batcher pads itself (pad id 0), and dicts with an
``attention_mask`` (pad id 0 too).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardcal.calib.recipes import parse_recipe
from shardcal.calib.runner import calibrate
from shardcal.layerwise.batches import make_batches
from shardcal.models import CausalLM, ModelConfig
from shardcal.quant import iter_quantizers

from _numerics import FLOAT_RTOL, ROUNDING_RTOL, assert_close_but_for_rounding_flips
from _tiny_models import TINY_CONFIGS, randomize_

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

CFG = dict(TINY_CONFIGS["llama"], num_hidden_layers=2)
LENGTHS = (12, 7, 10, 12, 5, 9)
ROWS = [torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
PAD = 0  # what make_batches pads with; its embedding is the huge one


def _model(cfg: dict = CFG) -> CausalLM:
    model = CausalLM(ModelConfig.from_dict(cfg))
    randomize_(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD] *= 300.0
    return model.eval()


def _ragged() -> list[torch.Tensor]:
    """Rows of different lengths as they are: the batcher pads them."""
    return list(ROWS)


def _masked(batch: int = 3) -> list[dict]:
    """The same rows, padded by hand into batches with an attention mask."""
    out = []
    for s in range(0, len(ROWS), batch):
        chunk = ROWS[s : s + batch]
        length = max(r.numel() for r in chunk)
        ids = torch.full((len(chunk), length), PAD, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, : r.numel()], mask[i, : r.numel()] = r, 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _unpadded() -> list[torch.Tensor]:
    """Each row its own batch (batch_size=1): nothing to pad."""
    return [r[None] for r in ROWS]


def _linear_inputs_row_by_row(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """``{linear name: (max |input| over every real token, element count)}``, each row run alone on a plain model."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(module, nn.Linear) and not name.endswith("mlp.gate"):
            hooks.append(
                module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(args[0]))
            )
    with torch.no_grad():
        for row in ROWS:
            model(row[None])
    for h in hooks:
        h.remove()
    return {
        name: (torch.stack([x.abs().max() for x in xs]).max(), sum(x.numel() for x in xs)) for name, xs in seen.items()
    }


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {n: q.amax.detach().clone() for n, q in iter_quantizers(model) if q.amax is not None}
    state.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return state


@pytest.mark.parametrize("data", [_ragged, _masked], ids=["batcher-pads", "mask-given"])
def test_observers_see_exactly_the_real_tokens(data):
    reference = _linear_inputs_row_by_row(_model())
    model = _model()
    calibrate(model, data(), "w8a8-int8", batch_size=3, progress=False)
    quantizers = {n.removesuffix(".input_quantizer"): q for n, q in iter_quantizers(model) if "input" in n}
    assert set(quantizers) == set(reference) and len(reference) == 2 * 7
    for name, (amax, count) in reference.items():
        q = quantizers[name]
        assert q.num_observed == count, (name, q.num_observed, count)
        torch.testing.assert_close(q.amax, amax.reshape(1), rtol=1e-5, atol=0, msg=name)
    assert sum(r.numel() for r in ROWS) * 64 == reference["model.layers.0.self_attn.q_proj"][1]


SMOOTH_GPTQ = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\n[algorithm]\nname = "gptq"\nsmooth = { name = "smoothquant" }\n'
AWQ = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 32\n[algorithm]\nname = "awq"\n'
PERCENTILE = '[weight]\nformat = "int8"\ngranularity = "channel"\n[input]\nformat = "int8"\nobserver = "percentile"\n'


# SQNR on all rows; on the first 2 (12 + 7 >= 15 real tokens: part of the first padded batch); on the first 4
# (12 + 7 + 10 + 12 >= 40: the first batch and the first row of the second)
@pytest.mark.parametrize(
    "recipe, sqnr_tokens",
    [(SMOOTH_GPTQ, 10**9), (AWQ, 15), (PERCENTILE, 40)],
    ids=["smoothquant+gptq", "awq", "percentile"],
)
def test_padded_calibration_equals_unpadded(recipe, sqnr_tokens):
    """Weights, amax and SQNR of padded batches equal those of the rows calibrated alone, up to float rounding:
    the batches differ, so float32 sums are taken in another order (_numerics). GPTQ may then move a weight on a
    rounding tie by one code, and everything after it by up to ROUNDING_RTOL; a padded position that counted would
    move the amax by the pad token's 300x."""
    spec = parse_recipe(recipe, "recipe.toml")
    runs = []
    for data, batch_size in ((_ragged(), 3), (_unpadded(), 1)):
        model = _model()
        report = calibrate(model, data, spec, batch_size=batch_size, progress=False, sqnr_tokens=sqnr_tokens)
        runs.append((_state(model), [entry.sqnr_db for entry in report.layers]))
    (padded, sqnr_padded), (alone, sqnr_alone) = runs
    assert padded.keys() == alone.keys()
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    rounds = "gptq" in recipe
    for key in padded:
        if rounds and key in linears:
            assert_close_but_for_rounding_flips(padded[key], alone[key], qmax=127, msg=key)
        else:
            rtol = ROUNDING_RTOL if rounds else FLOAT_RTOL
            torch.testing.assert_close(padded[key], alone[key], rtol=rtol, atol=1e-6, msg=key)
    assert sqnr_padded == pytest.approx(sqnr_alone, rel=ROUNDING_RTOL if rounds else 1e-4)


def test_algorithm_input_statistics_are_the_real_tokens_statistics():
    """InputStats (what GPTQ, AWQ and SmoothQuant read) on padded batches: count, max, Gram matrix and sum |x| of a
    layer's inputs equal the same sums computed in float64 from the rows alone."""
    from shardcal import layer_steps
    from shardcal.algorithms.stats import InputStats

    reference_model = _model()
    seen: dict[str, list[torch.Tensor]] = {"q": [], "down": []}
    layer = reference_model.model.layers[1]
    layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen["q"].append(args[0][0].double()))
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen["down"].append(args[0][0].double()))
    with torch.no_grad():
        for row in ROWS:
            reference_model(row[None])

    model = _model()
    for step in layer_steps(model, make_batches(_ragged(), 3)):
        if step.index == 1:
            points = {"q": (step.layer.self_attn.q_proj, "input"), "down": (step.layer.mlp.down_proj, "input")}
            stats = InputStats(points, {"max", "gram", "abssum"}).collect(step).merge(None)
    for key, rows in seen.items():
        x = torch.cat(rows)  # [real tokens, channels]
        s = stats[key]
        assert s.tokens == x.shape[0] == sum(LENGTHS)
        torch.testing.assert_close(s.max.double(), x.abs().amax(0), rtol=1e-5, atol=0)
        torch.testing.assert_close(s.hessian(), x.T @ x, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s.mean_abs(), x.abs().mean(0), rtol=1e-5, atol=1e-7)


def test_batcher_pads_ragged_rows_and_keeps_given_masks():
    """make_batches: rows of different lengths get a mask of their lengths; a given mask is kept as given."""
    (batch,) = make_batches(_ragged()[:3], 3)
    assert batch.attention_mask is not None
    assert batch.attention_mask.sum(1).tolist() == list(LENGTHS[:3])
    assert batch.num_tokens == sum(LENGTHS[:3])
    for i, row in enumerate(ROWS[:3]):
        assert torch.equal(batch.input_ids[i, : row.numel()], row)
    ids = torch.ones(2, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    (given,) = make_batches({"input_ids": ids, "attention_mask": mask}, 4)
    assert torch.equal(given.attention_mask, mask) and given.num_tokens == 8
    (full,) = make_batches(torch.ones(2, 6, dtype=torch.long), 4)  # nothing padded: no mask at all
    assert full.attention_mask is None and full.num_tokens == 12
