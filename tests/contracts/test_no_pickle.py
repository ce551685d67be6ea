"""Loading a checkpoint, recipe, tokenizer or calibration checkpoint never executes code: no pickle anywhere.

The package source (``src/``) is parsed with :mod:`ast`, so docstrings and comments that
mention the words, method calls such as ``model.eval()``, and functions named ``_eval`` are not flagged; what is:

* ``import pickle`` (or ``cPickle``, ``_pickle``, ``dill``, ``cloudpickle``, ``joblib``, ``marshal``, ``shelve``),
  and any use of those names;
* ``torch.load(...)`` without ``weights_only=True``; ``torch.jit.load`` (runs TorchScript);
* ``np.load(...)`` / ``numpy.load(...)`` without ``allow_pickle=False``; ``allow_pickle=True`` anywhere;
* the builtins ``eval``, ``exec``, ``compile``, ``__import__``;
* torch.distributed's object collectives (``broadcast_object_list`` & co. unpickle what peers send; ranks exchange
  tensors, or JSON in byte tensors) outside the files listed in :data:`OBJECT_COLLECTIVES_ALLOWED` (none).

The checker itself is tested on snippets, so a rule that silently stopped matching would fail here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = (ROOT / "src",)

PICKLE_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"})
CODE_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
OBJECT_COLLECTIVES = frozenset(
    {
        "broadcast_object_list",
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)
#: Files that may use an object collective (``"src/shardcal/x.py"``); each needs a reason. None so far.
OBJECT_COLLECTIVES_ALLOWED: frozenset[str] = frozenset()


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def find_violations(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line: what"`` for every code-execution risk in ``source`` (see the module docstring)."""
    tree = ast.parse(source, filename)
    # Local names bound to the torch / numpy modules or to their load functions (import torch as T, from numpy import load).
    aliases: dict[str, str] = {"torch": "torch", "np": "numpy", "numpy": "numpy"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "numpy", "torch.jit"):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                flag(node, f"from {node.module} import ...")
            for alias in node.names:
                if alias.name in OBJECT_COLLECTIVES and filename not in OBJECT_COLLECTIVES_ALLOWED:
                    flag(node, f"imports {alias.name} (pickles between ranks)")
        elif isinstance(node, ast.Name) and node.id in PICKLE_MODULES:
            flag(node, f"uses {node.id}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in OBJECT_COLLECTIVES
            and filename not in OBJECT_COLLECTIVES_ALLOWED
        ):
            flag(node, f"{node.attr} (pickles between ranks)")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not _is_const(node.value, False):
            flag(node.value, "allow_pickle is not False")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            full = aliases.get(head, head) + (f".{rest}" if rest else "")
            if isinstance(node.func, ast.Name) and node.func.id in CODE_BUILTINS and node.func.id not in aliases:
                flag(node, f"builtin {node.func.id}()")
            elif full == "torch.load" and not _is_const(_keyword(node, "weights_only"), True):
                flag(node, "torch.load without weights_only=True")
            elif full == "torch.jit.load":
                flag(node, "torch.jit.load (runs TorchScript)")
            elif full == "numpy.load" and not _is_const(_keyword(node, "allow_pickle"), False):
                flag(node, "numpy.load without allow_pickle=False")
    return found


def package_sources() -> list[Path]:
    files = sorted(p for d in SOURCE_DIRS for p in d.rglob("*.py"))
    assert len(files) > 10, files  # the walk found the package
    return files


def test_package_never_unpickles_or_runs_code() -> None:
    violations = []
    for path in package_sources():
        violations += find_violations(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    assert not violations, "\n".join(violations)


def test_npy_is_loaded_without_pickle() -> None:
    """The one numpy loader exists and says allow_pickle=False (the rule above is not vacuous)."""
    loads = [v for v in find_violations("import numpy as np\nnp.load(p)\n") if "numpy.load" in v]
    assert loads
    data = (ROOT / "src" / "shardcal" / "data" / "token_data.py").read_text()
    assert "allow_pickle=False" in data and not find_violations(data, "src/shardcal/data/token_data.py")


FLAGGED = [
    "import pickle",
    "import pickle as p",
    "from pickle import loads",
    "import marshal",
    "import shelve",
    "import dill",
    "from joblib import load",
    "x = pickle.loads(b)",
    "torch.load(f)",
    "torch.load(f, weights_only=False)",
    "torch.load(f, map_location='cpu')",
    "import torch as T\nT.load(f)",
    "from torch import load\nload(f)",
    "torch.jit.load(f)",
    "np.load(f)",
    "numpy.load(f, allow_pickle=True)",
    "import numpy as xp\nxp.load(f)",
    "np.load(f, allow_pickle=flag)",
    "eval('1 + 1')",
    "exec(code)",
    "compile(src, 'f', 'exec')",
    "__import__('os')",
    "dist.broadcast_object_list(box, src=0)",
    "torch.distributed.all_gather_object(out, obj)",
    "from torch.distributed import gather_object",
]

CLEAN = [
    "model.eval()",
    "return model.eval()",
    "def _eval(args):\n    return 0",
    "def eval_model(m):\n    m.eval()",
    '"""Files are safetensors (never pickle); no torch.load( and no eval( here."""',
    "# import pickle  -- a comment",
    "message = 'pickled .bin/.pt files are not read'",
    "torch.load(f, weights_only=True)",
    "np.load(path, allow_pickle=False)",
    "re.compile(pattern)",
    "self._re.compile(source)",
    "regex.compile(r'\\p{L}')",
    "from safetensors.torch import load_file\nload_file(p)",
    "safe_open(str(p), framework='pt')",
    "json.loads(text)",
    "tomllib.loads(text)",
    "obj.exec_module(m)",
    "evaluate(model)",
]


@pytest.mark.parametrize("snippet", FLAGGED)
def test_checker_flags(snippet: str) -> None:
    assert find_violations(snippet), snippet


@pytest.mark.parametrize("snippet", CLEAN)
def test_checker_ignores(snippet: str) -> None:
    assert find_violations(snippet) == [], snippet


def test_object_collective_allow_list_names_real_files() -> None:
    for name in OBJECT_COLLECTIVES_ALLOWED:
        assert (ROOT / name).is_file(), f"{name} listed in OBJECT_COLLECTIVES_ALLOWED but missing"
        assert find_violations("dist.broadcast_object_list(box, src=0)", name) == []
