"""How fused MoE experts store their weights: the layout (:class:`ExpertsLayout`) found from a module's parameters,
flags, gate function and, once the weights are at hand, its own forward; and each expert's slices of them.

transformers 5 stores a block's experts as two 3-D parameters, in one of the layouts :class:`ExpertsLayout`
describes::

    gate_up_proj [E, 2I, H]   rows 0..I-1: expert e's gate_proj weight, rows I..2I-1: its up_proj weight
    down_proj    [E, H, I]    expert e's down_proj weight          (Qwen2/3-MoE, Mixtral, DeepSeek-V3)

    gate_up_proj [E, H, 2I]   transposed (the forward computes x @ W), gate and up interleaved along the last dim
    down_proj    [E, I, H]    (gate at even, up at odd columns), with gate_up_proj_bias [E, 2I] and
                              down_proj_bias [E, H]                 (GPT-OSS)

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])

The orientation follows from the shapes; the gate/up split from the module's ``is_concatenated`` flag, else from its
own gate function (``_apply_gate``, probed on a small input: which output each input position moves), else it is
the two halves; and once the weights are at hand (:func:`probe_layout`, on the gathered layer) the module's own
forward on a probe input is compared with the interpretation — another split is tried when nothing named it, and a
forward no interpretation reproduces is refused with an error naming the module. :func:`weight_slice` gives an
expert's ``[out, in]`` weight as a view of the fused parameters in any layout. The quantizers put on fused experts
are :mod:`.experts`'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelLayoutError

#: The per-expert projections, in export order, and how each takes its weight out of the fused parameters.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: The parameters a fused-experts module may hold: the two 3-D weights and, optionally, both biases.
_WEIGHTS = frozenset({"gate_up_proj", "down_proj"})
_BIASES = frozenset({"gate_up_proj_bias", "down_proj_bias"})
#: Where a module's layout is kept once found (the forward probe needs the weights, the export only the structure).
_LAYOUT_ATTR = "shardcal_experts_layout"
_EXPECTED = (
    "expected gate_up_proj and down_proj, [E, 2I, H] / [E, H, I] or transposed [E, H, 2I] / [E, I, H], "
    "and optionally both gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]"
)


@dataclass(frozen=True, kw_only=True)
class ExpertsLayout:
    """How a fused-experts module stores its experts (what :func:`fused_experts_layout` found).

    ``transposed``: ``gate_up_proj`` is ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` (the forward computes
    ``x @ W``), else ``[E, 2I, H]`` / ``[E, H, I]`` (``x @ W^T``). ``interleaved``: expert ``e``'s gate and up
    outputs alternate (gate at even, up at odd positions of its gate_up output: GPT-OSS), else gate is the first
    half and up the second. ``biased``: the module holds ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias``
    ``[E, H]``.
    """

    experts: int
    hidden: int
    inter: int
    transposed: bool = False
    interleaved: bool = False
    biased: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(experts, hidden, intermediate)``."""
        return self.experts, self.hidden, self.inter

    @property
    def standard(self) -> bool:
        """The layout of Qwen2/3-MoE, Mixtral and DeepSeek-V3: ``[E, 2I, H]`` / ``[E, H, I]``, halves, no bias."""
        return not (self.transposed or self.interleaved or self.biased)

    def columns(self, proj: str) -> slice:
        """The positions of an expert's gate_up output that ``proj`` (``gate_proj`` or ``up_proj``) occupies."""
        up = proj == "up_proj"
        if self.interleaved:
            return slice(int(up), None, 2)
        return slice(self.inter, None) if up else slice(0, self.inter)


def _is_fused_experts_candidate(module: nn.Module) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def _orientation(gate_up: tuple[int, ...], down: tuple[int, ...]) -> tuple[bool, int, int, int] | None:
    """``(transposed, E, H, I)`` the two weights' shapes imply (never both orientations), or None."""
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        return None
    experts, a, b = down
    if gate_up == (experts, 2 * b, a):
        return False, experts, a, b
    if gate_up == (experts, b, 2 * a):
        return True, experts, b, a
    return None


def _interleaved_by_gate_fn(module: nn.Module, inter: int) -> bool | None:
    """Whether the module's own gate function (``_apply_gate``) pairs positions ``2j, 2j+1`` (True) or ``j, j+I``
    (False): each probe row moves one input position, and the output that moves says which. None when the module
    has no gate function or it pairs positions neither way."""
    gate_fn = getattr(module, "_apply_gate", None)
    if not callable(gate_fn) or inter < 2:
        return None if not callable(gate_fn) else False
    width = 2 * inter
    positions = sorted({0, 1, inter - 1, inter, width - 1})
    base = 0.25 + 0.5 * torch.arange(width, dtype=torch.float32) / width  # positive: no zero product, no clamp
    rows = base.repeat(len(positions) + 1, 1)
    for r, p in enumerate(positions, start=1):
        rows[r, p] += 0.25
    try:
        with torch.no_grad():
            out = gate_fn(rows)
    except Exception:  # a gate function that wants something else: the forward probe decides
        return None
    if tuple(out.shape) != (len(positions) + 1, inter):
        return None
    moved = [set(torch.nonzero(out[r] != out[0]).flatten().tolist()) for r in range(1, len(positions) + 1)]
    for interleaved, pair in ((False, lambda p: p % inter), (True, lambda p: p // 2)):
        if all(m == {pair(p)} for m, p in zip(moved, positions, strict=True)):
            return interleaved
    return None


def _structure(module: nn.Module) -> tuple[ExpertsLayout | None, str | None]:
    """The layout the module's parameters, flags and gate function say, or the problem with it."""
    own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
    names = set(own)
    if not _WEIGHTS <= names or not names <= _WEIGHTS | _BIASES or len(names & _BIASES) not in (0, 2):
        return None, f"parameters {sorted(own)} ({_EXPECTED})"
    found = _orientation(own["gate_up_proj"], own["down_proj"])
    if found is None:
        return None, f"gate_up_proj {list(own['gate_up_proj'])} and down_proj {list(own['down_proj'])} ({_EXPECTED})"
    transposed, experts, hidden, inter = found
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool) and flag != transposed:
        return None, f"is_transposed={flag}, but the shapes of gate_up_proj and down_proj say {transposed}"
    biased = bool(names & _BIASES)
    if biased and (own["gate_up_proj_bias"] != (experts, 2 * inter) or own["down_proj_bias"] != (experts, hidden)):
        return None, (
            f"gate_up_proj_bias {list(own['gate_up_proj_bias'])} and down_proj_bias {list(own['down_proj_bias'])} "
            f"(expected [{experts}, {2 * inter}] and [{experts}, {hidden}])"
        )
    if not callable(getattr(module, "_apply_gate", None)) and not callable(getattr(module, "act_fn", None)):
        return None, "no act_fn or _apply_gate (the activation between gate_up and down)"
    concatenated = getattr(module, "is_concatenated", None)
    interleaved = (not concatenated) if isinstance(concatenated, bool) else _interleaved_by_gate_fn(module, inter)
    if interleaved is None and callable(getattr(module, "_apply_gate", None)):
        return None, "its _apply_gate pairs gate and up neither as halves nor interleaved"
    return ExpertsLayout(
        experts=experts, hidden=hidden, inter=inter, transposed=transposed, interleaved=bool(interleaved), biased=biased
    ), None


def fused_experts_layout(module: nn.Module, name: str, strict: bool = True) -> ExpertsLayout | None:
    """The :class:`ExpertsLayout` of a fused-experts module; None for a module without 3-D parameters; for a
    fused layout shardcal does not know, :class:`ModelLayoutError` naming the module (``strict``) or None (its
    parameters are then stored as they are). Found from the structure alone (names, shapes, flags, the gate
    function): it works on sharded and meta modules; what the forward probe found, once run, is kept."""
    if not _is_fused_experts_candidate(module):
        return None
    kept = module.__dict__.get(_LAYOUT_ATTR)
    if kept is not None:
        return kept
    layout, problem = _structure(module)
    if problem is not None:
        if not strict:
            return None
        raise ModelLayoutError(
            f"{name}: a fused-experts layout shardcal does not know: {problem}; exclude it from the recipe "
            "(targets.exclude) to leave it unquantized"
        )
    return layout


def fused_experts_shape(module: nn.Module, name: str, strict: bool = True) -> tuple[int, int, int] | None:
    """``(experts, hidden, intermediate)`` of a fused-experts module (see :func:`fused_experts_layout`)."""
    layout = fused_experts_layout(module, name, strict)
    return None if layout is None else layout.shape


def _layout_of(module: nn.Module) -> ExpertsLayout:
    layout = fused_experts_layout(module, type(module).__name__)
    assert layout is not None  # callers hold fused experts
    return layout


def weight_slice(module: nn.Module, expert: int, proj: str) -> torch.Tensor:
    """Expert ``expert``'s ``proj`` weight ``[out, in]``, a view of the fused parameter (gathered when sharded)."""
    layout = _layout_of(module)
    if proj == "down_proj":
        down = module.down_proj[expert]
        return down.T if layout.transposed else down
    gate_up = module.gate_up_proj[expert]
    cols = layout.columns(proj)
    return gate_up[:, cols].T if layout.transposed else gate_up[cols]


def bias_slice(module: nn.Module, expert: int, proj: str) -> torch.Tensor | None:
    """Expert ``expert``'s ``proj`` bias ``[out]`` (a view), or None when the experts have no biases."""
    layout = _layout_of(module)
    if not layout.biased:
        return None
    if proj == "down_proj":
        return module.down_proj_bias[expert]
    return module.gate_up_proj_bias[expert][layout.columns(proj)]


def down_input(module: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """What expert ``expert``'s down projection reads for tokens ``x`` ``[T, H]``: the module's own gate function
    (``_apply_gate``; else ``act_fn(gate) * up``) applied to ``x W_gate_up (+ bias)``, in ``x``'s dtype."""
    layout = _layout_of(module)
    gate_up = module.gate_up_proj[expert].to(x.dtype)
    out = x @ gate_up if layout.transposed else x @ gate_up.T
    if layout.biased:
        out = out + module.gate_up_proj_bias[expert].to(x.dtype)
    gate_fn = getattr(module, "_apply_gate", None)
    if callable(gate_fn):
        return gate_fn(out)
    return module.act_fn(out[..., layout.columns("gate_proj")]) * out[..., layout.columns("up_proj")]


def expert_forward(module: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s output for tokens ``x`` ``[T, H]`` (unweighted), computed from its slices."""
    out = down_input(module, expert, x) @ weight_slice(module, expert, "down_proj").T.to(x.dtype)
    bias = bias_slice(module, expert, "down_proj")
    return out if bias is None else out + bias.to(x.dtype)


@torch.no_grad()
def _forward_agrees(module: nn.Module, layout: ExpertsLayout) -> bool | None:
    """Whether the module's own forward, all probe tokens routed to expert 0 with weight 1, equals
    :func:`expert_forward` under ``layout``; None when the forward cannot be called that way."""
    weight = module.gate_up_proj
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, layout.hidden, generator=generator).to(device=weight.device, dtype=weight.dtype)
    index = torch.zeros(4, 1, dtype=torch.long, device=weight.device)
    weights = torch.ones(4, 1, dtype=weight.dtype, device=weight.device)
    module.__dict__[_LAYOUT_ATTR] = layout
    try:
        got = module(x, index, weights)
        want = expert_forward(module, 0, x)
    except Exception:
        return None
    finally:
        module.__dict__.pop(_LAYOUT_ATTR, None)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()) + 1e-6))


def probe_layout(module: nn.Module, name: str) -> ExpertsLayout:
    """The layout of fused experts whose weights are at hand (the gathered layer), checked against the module's
    own forward and kept on the module: another gate/up split is tried when no flag or gate function named it; a
    forward that no layout reproduces is refused (:class:`ModelLayoutError` naming the module)."""
    layout = fused_experts_layout(module, name)
    assert layout is not None
    if _LAYOUT_ATTR in module.__dict__ or _is_dtensor(module.gate_up_proj):
        return layout
    named = isinstance(getattr(module, "is_concatenated", None), bool) or callable(getattr(module, "_apply_gate", None))
    candidates = [layout] if named else [layout, _other_split(layout)]
    verdicts = [_forward_agrees(module, c) for c in candidates]
    if None in verdicts:  # a forward of another calling convention: the structure is all there is
        chosen = layout
    elif True in verdicts:
        chosen = candidates[verdicts.index(True)]
    else:
        raise ModelLayoutError(
            f"{name}: a fused-experts layout shardcal does not know: its forward does not compute "
            f"act(x W_gate) * (x W_up) W_down with the layout its parameters suggest ({layout}); exclude it from the "
            "recipe (targets.exclude) to leave it unquantized"
        )
    module.__dict__[_LAYOUT_ATTR] = chosen
    return chosen


def _other_split(layout: ExpertsLayout) -> ExpertsLayout:
    return ExpertsLayout(
        experts=layout.experts,
        hidden=layout.hidden,
        inter=layout.inter,
        transposed=layout.transposed,
        interleaved=not layout.interleaved,
        biased=layout.biased,
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
