"""The import graph of the kvhub package: modules are nodes, every import (top-level or inside a function)
is an edge, and each module belongs to one stage of the flow (docs/architecture.md).  A module may import
from its own stage or an earlier one, never from a later one; no import cycle; no module over 500 lines.

Bugs it catches (each in the code when issue 23 was filed): ``core/mapper.py`` importing ``kvhub.api`` inside
``from_pretrained`` (an upward arrow and a cycle; the Hub-style face is now ``kvhub.api.Mapper``); ``models/resolve.py`` (now ``models/loading.py``) reaching up to ``calib.corpus``
for the cache root; ``models/fetch.py`` importing ``kvhub.eval.tasks`` inside ``fetch_evals``; the vLLM
connector importing ``kvhub.eval.control``; ``serving/kvstore.py`` at 608 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvhub"
MAX_LINES = 500

# The stages, earliest first.  A module belongs to the stage of its longest listed prefix.  Writing a new
# top-level module or folder means placing it here: a module of no stage fails the test.
STAGES = [
    ("ground", ["kvhub", "kvhub.errors", "kvhub.progress", "kvhub.dtypes", "kvhub.env"]),
    ("artifact", ["kvhub.artifact", "kvhub.wheels"]),  # the on-disk format; wheels hashes and stages with it
    ("store", ["kvhub.store"]),  # the SQL registry of versions (torch-free)
    ("core", ["kvhub.core"]),  # the math: rope, fingerprints, capture, stats, solve, Mapper, the control map
    ("models", ["kvhub.models"]),  # model specs -> loaded models, `kvhub fetch models`
    ("calib", ["kvhub.calib"]),
    ("hub", ["kvhub.hub"]),
    ("fitting", ["kvhub.fitting"]),
    ("api", ["kvhub.api"]),  # load / from_pretrained / push_to_hub: store + hub + core
    ("serving", ["kvhub.serving"]),
    ("eval", ["kvhub.eval"]),
    ("cli", ["kvhub.cli", "kvhub.__main__"]),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.AST, name: str, is_package: bool) -> list[str]:
    """The dotted names an import statement (or ``importlib.import_module("literal")``) asks for."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        return [f"{base}.{alias.name}" for alias in node.names] + [base]  # a submodule, or a name in base
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def edges(source: str, *, name: str, is_package: bool, known) -> set[str]:
    """The kvhub modules that ``source`` (module ``name``) imports anywhere in its body, itself excluded."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets = _targets(node, name, is_package)
        if isinstance(node, ast.ImportFrom):  # `from a.b import c`: the module a.b.c if it is one, else a.b
            *names, base = targets
            targets = [t for t in names if t in known] or [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("kvhub") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the kvhub modules it imports."""
    known = modules()
    return {
        name: edges(path.read_text(), name=name, is_package=path.name == "__init__.py", known=known)
        for name, path in known.items()
    }


def stage_of(module: str) -> int | None:
    best, stage = -1, None
    for index, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, stage = len(prefix), index
    return stage


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions():
    planted = (
        "from kvhub.errors import ConfigError\n"
        "from kvhub.serving import launch\n"
        "def f():\n"
        "    import importlib\n"
        "    from kvhub.api import load\n"
        "    from . import rope\n"
        "    return importlib.import_module('kvhub.eval.tasks')\n"
    )
    found = edges(planted, name="kvhub.core.mapper", is_package=False, known=modules())
    assert found == {"kvhub.errors", "kvhub.serving.launch", "kvhub.api", "kvhub.core.rope", "kvhub.eval.tasks"}


def test_every_module_has_a_stage():
    assert [name for name in modules() if stage_of(name) is None] == []


def test_no_module_imports_from_a_later_stage():
    upward = [
        f"{name} ({STAGES[stage_of(name)][0]}) -> {target} ({STAGES[stage_of(target)][0]})"
        for name, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if stage_of(target) > stage_of(name)
    ]
    assert not upward, "imports from a later stage:\n" + "\n".join(upward)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {
        "kvhub.core.mapper": {"kvhub.api"},
        "kvhub.api": {"kvhub.hub"},
        "kvhub.hub": {"kvhub.core.mapper"},
        "kvhub.errors": set(),
    }
    assert cycles(planted) == [["kvhub.api", "kvhub.core.mapper", "kvhub.hub"]]


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along concept lines): {long}"


# Modules that import no torch, and must not load it through a package __init__ either: the CLI and the
# serving launcher read them before any model loads.  A package __init__ is a face (light names, the heavy
# ones lazily), so importing one of these costs what the module itself imports.
TORCH_FREE = [
    "kvhub.serving.spec",
    "kvhub.serving.launch",
    "kvhub.serving.connector_config",
    "kvhub.calib.recipe",
    "kvhub.fitting.options",
    "kvhub.core.deshrink",
    "kvhub.eval.catalog",
    "kvhub.env",
    "kvhub.errors",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_a_torch_free_module_imports_without_torch(module):
    """Planted bugs caught: ``kvhub/serving/__init__.py`` importing ``kvstore`` eagerly (then
    ``import kvhub.serving.spec`` loaded torch, and the eval CLI kept a copy of ``SELECTORS`` to dodge it);
    ``kvhub/calib/__init__.py`` importing ``calibration_set`` (``DEFAULT_CALIBRATION`` had moved out of the
    recipes for the same reason)."""
    code = f"import sys\nimport {module}\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing {module} loads {out}"
