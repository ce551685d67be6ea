"""The planner (``src/shardcal/plan``) copies no rule of another package: it asks the owners.

* the export's units, their owners and the shard files: ``shardcal.export.layout`` (``unit_owner``,
  ``split_into_shards``) — no rank chosen by ``... % world_size`` and no size held to ``max_shard_bytes`` in plan/;
* a decoder layer's passes: the runner's layer step (``shardcal.calib.layer_calibration.predicted_pass_plan``, which
  makes the plan the run executes) — plan/ reads none of the flags and promises the pass plan is made from;
* when a checkpoint directory commits: the runner (``commit_points``) — no ``... % every`` in plan/.

The check reads the source (every module of plan/, function bodies included), and is shown to see each kind of copy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLAN = Path(__file__).resolve().parents[2] / "src" / "shardcal" / "plan"

#: ``(owner module, name)`` that some module of plan/ must import.
ASKED = [
    ("shardcal.export.layout", "unit_owner"),
    ("shardcal.export.layout", "split_into_shards"),
    ("shardcal.calib.layer_calibration", "predicted_pass_plan"),
    ("shardcal.calib.runner", "commit_points"),
]
#: Names that are the pass plan's inputs or its maker: the runner's to read, not the planner's.
PASS_INPUTS = {
    "LayerFacts",
    "plan_layer_passes",
    "plan_step",
    "preserves_function",
    "reference_stream",
    "smooths_before_rotation",
    "derived_amax",
    "num_passes",
}
#: Names whose use as the right operand of ``%`` makes an owner or schedule rule.
ROUND_ROBIN = ("world_size", "every", "world")


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute named inside ``node``."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
    return out


def _name_of(node: ast.Name | ast.Attribute | ast.alias) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else node.name


def _imported(tree: ast.Module) -> set[tuple[str, str]]:
    """``(absolute module, name)`` of every ``from ... import`` of a module of the plan package."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "shardcal.plan".split(".")[: 2 - (node.level - 1)] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            out |= {(target, alias.name) for alias in node.names}
    return out


def copied_rules(sources: dict[str, str]) -> list[str]:
    """What the plan package's ``sources`` (file name -> text) copy of other packages' rules, or fail to ask."""
    problems, imported = [], set()
    for name, text in sorted(sources.items()):
        tree = ast.parse(text)
        imported |= _imported(tree)
        for node in ast.walk(tree):
            at = f"plan/{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                if _names(node.right) & set(ROUND_ROBIN):
                    problems.append(f"{at}: a round robin over {sorted(_names(node.right))} (ask its owner)")
            elif isinstance(node, ast.Compare) and "max_shard_bytes" in _names(node):
                problems.append(f"{at}: splits shards by max_shard_bytes (ask shardcal.export.layout)")
            elif isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
                named = (
                    node.id
                    if isinstance(node, ast.Name)
                    else node.attr
                    if isinstance(node, ast.Attribute)
                    else node.name
                )
                if named in PASS_INPUTS:
                    problems.append(
                        f"{at}: reads {named}, an input of the pass plan (ask shardcal.calib.layer_calibration)"
                    )
    problems += [f"plan/ does not ask {module}.{name}" for module, name in ASKED if (module, name) not in imported]
    return problems


def test_the_plan_package_asks_the_owners():
    sources = {p.name: p.read_text(encoding="utf-8") for p in sorted(PLAN.glob("*.py"))}
    problems = copied_rules(sources)
    assert not problems, "\n".join(problems)


ASKING = (
    "from ..export.layout import split_into_shards, unit_owner\n"
    "from ..calib.runner import commit_points\n"
    "from ..calib.layer_calibration import predicted_pass_plan\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ASKING + "def owner(i, s):\n    return i % s.world_size\n", "a round robin"),
        (ASKING + "def commits(n, every):\n    return [k for k in range(n) if k % every == 0]\n", "a round robin"),
        (ASKING + "def split(size, n, max_shard_bytes):\n    return size + n > max_shard_bytes\n", "splits shards"),
        (ASKING + "def stream(algorithm):\n    return algorithm.reference_stream\n", "reads reference_stream"),
        (ASKING + "from ..calib.passes import LayerFacts\n", "reads LayerFacts"),
        (
            "from ..export.layout import unit_owner\nfrom ..calib.runner import commit_points\n"
            "from ..calib.layer_calibration import predicted_pass_plan\n",
            "does not ask shardcal.export.layout.split_into_shards",
        ),
        (
            "from ..export.layout import split_into_shards, unit_owner\nfrom ..calib.runner import commit_points\n",
            "does not ask shardcal.calib.layer_calibration.predicted_pass_plan",
        ),
    ],
)
def test_the_check_sees_each_copy(text, expected):
    problems = copied_rules({"copy.py": text})
    assert any(expected in p for p in problems), problems
    assert not copied_rules({"asks.py": ASKING + "def owner(i, s):\n    return unit_owner(i, 'layer', s)\n"})
