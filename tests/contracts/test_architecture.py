"""The package's layer order (docs/design/architecture.md), enforced on the import graph of ``src/shardcal``.

Every import statement counts, function-local and ``TYPE_CHECKING`` ones included. The test fails on an import
cycle, on an import that goes up the order, on a private name used across modules, on a module missing from the
table, and on any import of transformers or huggingface_hub.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT_PACKAGE = "shardcal"

#: The layers, bottom up: a module may import from its own layer (without a cycle) and from the layers below.
#: Names are relative to ``shardcal``; a package's ``__init__`` is the package name itself. Each layer is a set of
#: packages: a package lies in one layer only.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["errors", "runtime", "runtime.*"]),
    ("models and quantizers", ["models.*", "quant", "quant.*"]),
    ("sharding", ["sharding", "sharding.*"]),
    ("layer stepping and algorithms", ["layerwise", "layerwise.*", "algorithms", "algorithms.*"]),
    ("calibration, collection and export", ["calib", "calib.*", "collect", "collect.*", "export", "export.*"]),
    (
        "entry points",
        ["loading", "loading.*", "io", "io.*", "data", "data.*", "plan", "plan.*", "pipeline", "pipeline.*"],
    ),
    ("command line", ["cli", "cli.*", "__main__"]),
    ("public facades", ["", "models"]),
]
#: Package ``__init__`` modules that re-export public names of higher layers lazily (PEP 562 ``__getattr__``):
#: nothing inside the package may import a name from them, and importing a submodule does not run their lazy part.
FACADES = {"shardcal", "shardcal.models"}
FORBIDDEN_PACKAGES = ("transformers", "huggingface_hub", "accelerate")


def all_modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``src/shardcal``."""
    out = {}
    for path in sorted((src / ROOT_PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the layer holding ``module`` (``"models.*"`` matches submodules only)."""
    relative = module.removeprefix(ROOT_PACKAGE).removeprefix(".")
    for index, (_, patterns) in enumerate(LAYERS):
        if any(relative == p or (p.endswith(".*") and fnmatch.fnmatchcase(relative, p)) for p in patterns):
            return index
    return None


@dataclass
class Import:
    source: str
    target: str  # a module of the package
    names: list[str] = field(default_factory=list)  # names imported from ``target`` that are not submodules
    line: int = 0


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Import], list[str]]:
    """The package-internal imports of a module, and the external top-level packages it imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    external: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT_PACKAGE or alias.name.startswith(ROOT_PACKAGE + "."):
                    found.append(Import(module, alias.name, line=node.lineno))
                else:
                    external.append(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            if not (target == ROOT_PACKAGE or target.startswith(ROOT_PACKAGE + ".")):
                if node.level == 0 and node.module != "__future__":
                    external.append(target.split(".")[0])
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.append(Import(module, sub, line=node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(module, target, names, node.lineno))
    return found, external


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> modules whose code runs when it is imported: its imports, and their (non-facade) parent packages
    unless those already ran as the module's own parents."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        own = set(_ancestors(module))
        for imp in imports_of(module, path, modules)[0]:
            for target in [*_ancestors(imp.target), imp.target]:
                if target in own and target != imp.target:
                    continue
                if target in modules and target != module and target not in FACADES:
                    edges[module].add(target)
            if imp.target in FACADES and imp.names:
                edges[module].add(imp.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(modules: dict[str, Path]) -> list[str]:
    problems: list[str] = []
    private_members = _private_members(modules)
    for module, path in modules.items():
        layer = layer_of(module)
        if layer is None:
            problems.append(
                f"{module}: not in the layer table of tests/contracts/test_architecture.py (and docs/design/architecture.md)"
            )
            continue
        found, external = imports_of(module, path, modules)
        for package in sorted(set(external) & set(FORBIDDEN_PACKAGES)):
            problems.append(f"{module}: imports {package} (a test-only dependency; use duck typing)")
        for imp in found:
            where = f"{module}:{imp.line}"
            target_layer = layer_of(imp.target)
            if imp.target in FACADES and imp.names and module != imp.target:
                problems.append(
                    f"{where}: imports {imp.names} from the facade {imp.target}; import from the defining module"
                )
            elif target_layer is not None and target_layer > layer and module not in FACADES:
                problems.append(
                    f"{where}: imports {imp.target} ({LAYERS[target_layer][0]}) from a lower layer ({LAYERS[layer][0]})"
                )
            for name in imp.names:
                if name.startswith("_"):
                    problems.append(f"{where}: imports the private name {name} from {imp.target}")
            private_module = [p for p in imp.target.split(".") if p.startswith("_") and not p.startswith("__")]
            if private_module and not module.startswith(imp.target.rsplit(".", 1)[0] + "."):
                problems.append(f"{where}: imports the private module {imp.target} from outside its package")
        problems += _private_member_uses(module, path, private_members)
    for component in cycles(graph(modules)):
        problems.append(f"import cycle: {' -> '.join(component)}")
    return problems


def _private_members(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``_name`` -> the modules whose classes define a method or attribute of that name."""
    defined: dict[str, set[str]] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names = [item.name]
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names = [t.id for t in targets if isinstance(t, ast.Name)]
                    else:
                        continue
                    for name in names:
                        if name.startswith("_") and not name.startswith("__"):
                            defined.setdefault(name, set()).add(module)
    return defined


def _private_member_uses(module: str, path: Path, defined: dict[str, set[str]]) -> list[str]:
    """``obj._name`` on another object than self/cls where only other modules' classes define ``_name``."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute) or node.attr not in defined:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        owners = defined[node.attr]
        if module not in owners:
            problems.append(f"{module}:{node.lineno}: uses {node.attr}, private to {sorted(owners)}")
    return problems


# ----------------------------------------------------------------------------------------------- the tests


def test_import_graph_follows_the_layer_order():
    problems = violations(all_modules())
    assert not problems, "\n".join(problems)


def test_layer_table_matches_the_architecture_doc():
    doc = (SRC.parent / "docs" / "design" / "architecture.md").read_text(encoding="utf-8")
    for name, patterns in LAYERS:
        assert name in doc, f"layer {name!r} is not described in docs/design/architecture.md"
        for pattern in patterns:
            shown = f"{ROOT_PACKAGE}/__init__" if pattern == "" else pattern.replace(".*", "/").replace(".", "/")
            assert shown.rstrip("/") in doc, f"{pattern!r} of layer {name!r} is not in docs/design/architecture.md"


def test_facades_resolve_every_public_name():
    for facade, table in (("shardcal", "_EXPORTS"), ("shardcal.models", "_LAZY")):
        module = importlib.import_module(facade)
        for name, defining in getattr(module, table).items():
            value = getattr(module, name)
            assert getattr(importlib.import_module(defining), name) is value, (facade, name)
        assert set(getattr(module, table)) <= set(module.__all__)


def _problems_of(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """The check run on a fake package, to show that it sees each kind of break."""
    for rel, text in files.items():
        path = tmp_path / ROOT_PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return violations(all_modules(tmp_path))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "__init__.py": "",
                "errors.py": "from .calib.runner import calibrate\n",
                "calib/runner.py": "def calibrate(): pass\n",
            },
            "from a lower layer",
        ),
        (
            {
                "__init__.py": "",
                "layerwise/steps.py": "def f():\n    from .options import X\n",
                "layerwise/options.py": "from .steps import f\nX = 1\n",
            },
            "import cycle: shardcal.layerwise.options -> shardcal.layerwise.steps",
        ),
        (
            {
                "__init__.py": "",
                "calib/runner.py": "from ..layerwise.steps import _helper\n",
                "layerwise/steps.py": "def _helper(): pass\n",
            },
            "private name _helper",
        ),
        ({"__init__.py": "", "calib/runner.py": "import transformers\n"}, "imports transformers"),
        ({"__init__.py": "", "mystery.py": ""}, "not in the layer table"),
        ({"__init__.py": "", "calib/runner.py": "from .. import calibrate\n"}, "from the facade shardcal"),
        (
            {
                "__init__.py": "",
                "quant/__init__.py": "",
                "quant/a.py": "class Q:\n    def _stats(self): pass\n",
                "calib/runner.py": "def f(q):\n    q._stats()\n",
            },
            "uses _stats, private to ['shardcal.quant.a']",
        ),
    ],
)
def test_the_check_sees_each_kind_of_break(tmp_path, files, expected):
    problems = _problems_of(tmp_path, files)
    assert any(expected in p for p in problems), problems


def test_transformers_is_loaded_by_name_in_one_place_only():
    """Beside the static check: the package loads transformers dynamically only in loading/foreign.py."""
    pattern = re.compile(r"import_module\(\s*[\"'](transformers|huggingface_hub)")
    found = [str(p.relative_to(SRC)) for p in all_modules().values() if pattern.search(p.read_text(encoding="utf-8"))]
    assert found == ["shardcal/loading/foreign.py"], found


def documented_path(module: str) -> str:
    """How docs/design/architecture.md names a module: its file under ``src/shardcal`` (``calib/runner.py``)."""
    return str(all_modules()[module].relative_to(SRC / ROOT_PACKAGE))


def test_the_architecture_doc_lists_every_module():
    doc = (SRC.parent / "docs" / "design" / "architecture.md").read_text(encoding="utf-8")
    missing = [documented_path(m) for m in all_modules() if f"`{documented_path(m)}`" not in doc]
    assert not missing, f"modules missing from docs/design/architecture.md's module list: {missing}"
