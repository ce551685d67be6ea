"""fsdp2_wrap / fsdp2_root_unsharded / load_pretrained on real gloo process groups (world sizes 1 and 2).

Each worker function runs several checks in one call (spawning is the expensive part) and returns numbers;
the assertions happen in the test process against an unsharded reference computed on every rank.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from shardcal.errors import ModelLayoutError
from shardcal.models.config import ModelConfig
from shardcal.models.decoder import CausalLM
from shardcal.sharding.fsdp2 import auxiliary_modules, fsdp2_root_unsharded, fsdp2_units, fsdp2_wrap, layer_unsharded

from _dist import run_on_ranks
from _paths import test_dirs

pytestmark = pytest.mark.numerics

LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
MOE = dict(
    LLAMA, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2
)


def _model(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.to(dtype).eval()


def _ids(batch: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- forward equality
def _forward_matches(cfg: dict) -> dict:
    ids = _ids()
    out = {}
    for name, kwargs in {
        "root": dict(shard_root=True),
        "no_root": dict(shard_root=False),
        "cpu_offload": dict(cpu_offload=True),
        "mp_bf16": dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    }.items():
        ref, model = _model(cfg), _model(cfg)
        with torch.no_grad():
            want = ref(ids)
            layers = fsdp2_wrap(model, **kwargs)
            got = model(ids)
            got_again = model(ids)  # resharded after the first forward, gathers again
        out[name] = dict(
            diff=_max_diff(want, got),
            diff_again=_max_diff(want, got_again),
            scale=want.abs().max().item(),
            layers_are_units=all(isinstance(layer, FSDPModule) for layer in layers),
            root_is_unit=isinstance(model, FSDPModule),
            embed_sharded=isinstance(model.model.embed_tokens.weight, DTensor),
        )
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_wrapped_forward_equals_unwrapped(world_size):
    for rank_result in run_on_ranks(world_size, _forward_matches, LLAMA):
        for name in ("root", "no_root", "cpu_offload"):
            r = rank_result[name]
            assert r["diff"] <= 1e-5 and r["diff_again"] <= 1e-5, (name, r)
            assert r["layers_are_units"]
        assert rank_result["root"]["root_is_unit"] and rank_result["root"]["embed_sharded"]
        assert not rank_result["no_root"]["root_is_unit"] and not rank_result["no_root"]["embed_sharded"]
        bf16 = rank_result["mp_bf16"]
        assert bf16["diff"] <= 0.02 * bf16["scale"] + 1e-2, bf16


# ---------------------------------------------------------------- fsdp2_root_unsharded
def _root_unshard_checks() -> dict:
    ids = _ids()
    ref, model = _model(LLAMA), _model(LLAMA)
    fsdp2_wrap(model)
    out: dict = {}
    with torch.no_grad():
        want = ref.model.embed_tokens(ids)
        try:
            model.model.embed_tokens(ids)
            out["outside_error"] = None
        except Exception as exc:
            out["outside_error"] = str(exc)
        with fsdp2_root_unsharded(model):
            out["inside_diff"] = _max_diff(want, model.model.embed_tokens(ids))
            with fsdp2_root_unsharded(model):  # nested: no second gather, no early reshard
                pass
            out["nested_still_unsharded"] = not isinstance(model.model.embed_tokens.weight, DTensor)
            # The untied output head is a unit of its own: embedding does not gather it.
            out["head_still_sharded"] = isinstance(model.lm_head.weight, DTensor)
            out["lm_head_diff"] = _max_diff(ref.lm_head(want), model.lm_head(model.model.embed_tokens(ids)))
        out["after_sharded"] = all(
            isinstance(p, DTensor) for p in (model.model.embed_tokens.weight, model.model.norm.weight)
        )
        try:
            with fsdp2_root_unsharded(model):
                raise KeyError("inside")
        except KeyError:
            pass
        out["after_exception_sharded"] = isinstance(model.model.embed_tokens.weight, DTensor)
        # A full forward still works after direct calls (the root stayed the root).
        out["forward_diff"] = _max_diff(ref(ids), model(ids))
        # Layer-by-layer by hand equals the full forward.
        with fsdp2_root_unsharded(model):
            inputs = model.model.embed(ids)
        h = inputs.hidden_states
        for layer in model.model.layers:
            with layer_unsharded(layer):
                h = layer(h, position_embeddings=inputs.position_embeddings, attention_mask=inputs.attention_mask)
        with fsdp2_root_unsharded(model):
            out["stepwise_diff"] = _max_diff(ref(ids), model.lm_head(model.model.norm(h)))
    plain = _model(LLAMA)
    with fsdp2_root_unsharded(plain):  # no-op on a plain model
        out["plain_ok"] = plain.model.embed_tokens(ids).shape == want.shape
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_root_unsharded_context(world_size):
    for r in run_on_ranks(world_size, _root_unshard_checks):
        assert r["outside_error"] is not None and "DTensor" in r["outside_error"]
        assert r["inside_diff"] == 0.0 and r["lm_head_diff"] <= 1e-5
        assert r["nested_still_unsharded"] and r["head_still_sharded"]
        assert r["after_sharded"] and r["after_exception_sharded"]
        assert r["forward_diff"] <= 1e-5 and r["stepwise_diff"] <= 1e-5
        assert r["plain_ok"]


# ---------------------------------------------------------------- one gather per step
def _count_gathers() -> dict:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    model = _model(LLAMA)
    layers = fsdp2_wrap(model)
    ids = _ids()
    gathers = []
    original = fpg.foreach_all_gather

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    fpg.foreach_all_gather = counting
    try:
        with torch.no_grad():
            with fsdp2_root_unsharded(model):
                inputs = model.model.embed(ids)
            root_gathers = len(gathers)
            with layer_unsharded(layers[0]):
                for _ in range(5):
                    layers[0](inputs.hidden_states, position_embeddings=inputs.position_embeddings)
            step_gathers = len(gathers) - root_gathers
            sharded_after = isinstance(layers[0].self_attn.q_proj.weight, DTensor)
    finally:
        fpg.foreach_all_gather = original
    return dict(root=root_gathers, step=step_gathers, sharded_after=sharded_after)


def test_layer_gathered_once_per_step():
    for r in run_on_ranks(2, _count_gathers):
        assert r == dict(root=1, step=1, sharded_after=True)


# ---------------------------------------------------------------- off-dtype router
def _fp32_router_in_bf16() -> dict:
    ref, model = _model(MOE, dtype=torch.bfloat16), _model(MOE, dtype=torch.bfloat16)
    for m in (ref, model):
        for layer in m.model.layers:
            layer.mlp.gate.float()
    ids = _ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp2_wrap(model)
    router = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():
        diff = _max_diff(ref(ids), model(ids))
    return dict(
        warning=" ".join(str(w.message) for w in caught if "replicated" in str(w.message)),
        router_plain=not isinstance(router, DTensor),
        router_dtype=str(router.dtype),
        router_device=router.device.type,
        expert_sharded=isinstance(model.model.layers[0].mlp.experts[0].up_proj.weight, DTensor),
        diff=diff,
    )


def test_float32_router_stays_replicated():
    for r in run_on_ranks(2, _fp32_router_in_bf16):
        assert "model.layers.0.mlp.gate.weight" in r["warning"] and "float32" in r["warning"]
        assert r["router_plain"] and r["router_dtype"] == "torch.float32" and r["router_device"] == "cpu"
        assert r["expert_sharded"]
        assert r["diff"] == 0.0


# ---------------------------------------------------------------- auxiliary modules
class ToyVLM(nn.Module):
    """A vision tower + projector in front of a decoder stack, plus an MTP head."""

    def __init__(self):
        super().__init__()
        self.lm = _model(LLAMA)
        self.model = nn.Module()
        self.model.vision_tower = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32))
        self.model.multi_modal_projector = nn.Linear(32, 64)
        self.model.language_model = self.lm.model
        self.lm_head = self.lm.lm_head
        self.mtp = nn.Linear(64, 64)
        del self.lm

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        image = self.model.multi_modal_projector(self.model.vision_tower(pixels))
        text = self.model.language_model.embed(ids)
        h = torch.cat([image, text.hidden_states], dim=1)
        inputs = self.model.language_model.embed(torch.cat([ids[:, : image.shape[1]], ids], dim=1))
        for layer in self.model.language_model.layers:
            h = layer(h, position_embeddings=inputs.position_embeddings)
        h = self.model.language_model.norm(h)
        return self.lm_head(h) + self.lm_head(self.mtp(h))


def _toy_vlm_checks() -> dict:
    torch.manual_seed(3)
    ref = ToyVLM()
    model = ToyVLM()
    model.load_state_dict(ref.state_dict())
    pixels, ids = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(2)), _ids(seq=8)
    aux = [name for name, _ in auxiliary_modules(model)]
    replicated = fsdp2_units(model, replicate=[model.model.vision_tower])
    layers = fsdp2_wrap(model)
    with torch.no_grad():
        diff = _max_diff(ref(pixels, ids), model(pixels, ids))
    return dict(
        aux=aux,
        diff=diff,
        n_layers=len(layers),
        units={n for n, m in model.named_modules() if isinstance(m, FSDPModule)},
        keep_tower=all(m is not model.model.vision_tower for m in replicated) and len(replicated) == 6,
    )


def testauxiliary_modules_get_own_units():
    for r in run_on_ranks(2, _toy_vlm_checks):
        assert r["aux"] == ["mtp", "model.vision_tower", "model.multi_modal_projector"]
        assert {
            "",
            "mtp",
            "model.vision_tower",
            "model.multi_modal_projector",
            "model.language_model.layers.0",
            "lm_head",
        } <= r["units"]
        assert r["n_layers"] == 3 and r["keep_tower"]
        assert r["diff"] <= 1e-5


# ---------------------------------------------------------------- refusals
def _refusals() -> dict:
    out = {}

    def message(fn):
        try:
            fn()
        except ModelLayoutError as exc:
            return str(exc)
        return None

    out["no_layers"] = message(lambda: fsdp2_wrap(nn.Sequential(nn.Linear(4, 4))))
    wrapped = _model(LLAMA)
    fsdp2_wrap(wrapped)
    out["wrapped"] = message(lambda: fsdp2_wrap(wrapped))
    planned = _model(LLAMA)  # a plan says how a model could be split; it records nothing
    planned._tp_plan = {"lm_head": "colwise_gather_output"}
    planned.model._ep_plan = {"model.layers.*.mlp.experts": "ep_dispatch_experts"}
    out["tp_plan"] = message(lambda: fsdp2_wrap(planned))
    meshed = _model(LLAMA)
    meshed.model.layers[1].self_attn.device_mesh = object()
    out["mesh"] = message(lambda: fsdp2_wrap(meshed))
    tp_sized = _model(LLAMA)
    tp_sized._tp_size = 2
    out["tp_size"] = message(lambda: fsdp2_wrap(tp_sized))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dtensor = _model(LLAMA)
    mesh = init_device_mesh("cpu", (1,))
    weight = dtensor.model.layers[0].mlp.up_proj.weight
    dtensor.model.layers[0].mlp.up_proj.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Replicate()]))
    out["dtensor"] = message(lambda: fsdp2_wrap(dtensor))
    return out


def test_refusals():
    (r,) = run_on_ranks(1, _refusals)
    assert "Sequential" in r["no_layers"] and "register_decoder_layer_support" in r["no_layers"]
    assert "already FSDP2-wrapped" in r["wrapped"]
    assert r["tp_plan"] is None  # wrapped
    assert "'model.layers.1.self_attn' carries a device mesh (device_mesh)" in r["mesh"]
    assert "module '<root>' has _tp_size=2" in r["tp_size"]
    assert "'model.layers.0.mlp.up_proj.weight' is a DTensor" in r["dtensor"]


def test_wrap_without_process_group_is_a_clear_error():
    """In a fresh process (earlier tests in this one may have left a group): no group, a clear error."""
    import subprocess
    import sys

    code = (
        f"import sys; sys.path[:0] = {test_dirs()!r}\n"
        "from test_fsdp2 import LLAMA, _model\n"
        "from shardcal.errors import DistributedError\n"
        "from shardcal.sharding.fsdp2 import fsdp2_wrap\n"
        "try:\n    fsdp2_wrap(_model(LLAMA))\nexcept DistributedError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "init_process_group" in done.stdout, done.stderr[-2000:]


# ---------------------------------------------------------------- load_pretrained
def _write_checkpoint(directory, cfg: dict, model: CausalLM) -> None:
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight")
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg))


def _load_checks(path: str) -> dict:
    from shardcal.models import from_pretrained, load_pretrained

    ref = from_pretrained(path)
    model = load_pretrained(path)
    ids = _ids()
    with torch.no_grad():
        diff = _max_diff(ref(ids), model(ids))
    plan = model._shardcal_distribution_plan
    try:
        fsdp2_wrap(model)
        refusal = None
    except ModelLayoutError as exc:
        refusal = str(exc)
    return dict(
        diff=diff,
        read=plan["bytes_read"],
        total=plan["model_bytes"],
        refusal=refusal,
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        router_plain=[
            not isinstance(layer_report.mlp.gate.weight, DTensor)
            for layer_report in model.model.layers
            if hasattr(layer_report.mlp, "gate")
        ],
    )


@pytest.mark.parametrize("cfg", [dict(LLAMA, tie_word_embeddings=True), MOE], ids=["llama-tied", "qwen3_moe"])
def test_load_pretrained_reads_only_own_rows(tmp_path, cfg):
    _write_checkpoint(tmp_path, cfg, _model(cfg))
    results = run_on_ranks(2, _load_checks, str(tmp_path))
    for r in results:
        assert r["diff"] <= 1e-5
        assert "from_pretrained" in r["refusal"]
        assert 0.45 <= r["read"] / r["total"] <= 0.55, r
        assert r["tied"] == bool(cfg.get("tie_word_embeddings"))
    (single,) = run_on_ranks(1, _load_checks, str(tmp_path))
    assert single["read"] == single["total"] and single["diff"] <= 1e-5
