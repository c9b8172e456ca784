"""The layers of the house, read from the source: every `import` in adaptive/ (at the top of a module,
inside functions, and under TYPE_CHECKING alike)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "adaptive"


def _unit(module: str) -> str:
    """adaptive.train.loop -> adaptive.train; adaptive.engine -> adaptive.engine (a module of its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _imports() -> dict[str, set[str]]:
    """module -> the adaptive modules it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = ".".join(("adaptive", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[module] |= {n for n in names if n.split(".")[0] in ("adaptive", "cli", "recipes", "torch")}
    return graph


def _package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in _imports().items():
        for target in targets:
            if target.startswith("adaptive.") and _unit(target) != _unit(module):
                edges[_unit(module)].add(_unit(target))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_cycle_between_packages():
    assert _cycle(_package_graph()) is None, " -> ".join(_cycle(_package_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize("importer, imported", [
    ("adaptive.orchestrator", "adaptive.train"),  # the policies are plugins of the loop
    ("adaptive.train", "adaptive.orchestrator"),  # the loop knows only its contract
    ("adaptive.plan", "adaptive.models"),  # the planner estimates, it builds nothing
    ("adaptive.plan", "adaptive.train"),
    ("adaptive.models", "adaptive.train"),  # models know no training loop
    ("adaptive.config", "adaptive.plan"),  # the run configuration is below everything
])
def test_a_layer_does_not_import_another(importer, imported):
    offenders = sorted(f"{module} imports {target}" for module, targets in _imports().items()
                       if _unit(module) == importer for target in targets if _unit(target) == imported)
    assert not offenders, offenders


def test_adaptive_never_imports_cli_or_recipes():
    offenders = sorted(f"{m} imports {t}" for m, ts in _imports().items() for t in ts
                       if t.split(".")[0] in ("cli", "recipes"))
    assert not offenders, offenders


def test_the_planner_and_the_run_configuration_import_no_torch():
    offenders = sorted(f"{m} imports {t}" for m, ts in _imports().items() for t in ts
                       if _unit(m) in ("adaptive.plan", "adaptive.config") and t.split(".")[0] == "torch")
    assert not offenders, offenders
