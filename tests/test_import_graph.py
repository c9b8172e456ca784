"""The layers of the house, read from the source: every `import` in adaptive/ (at the top of a module,
inside functions, and under TYPE_CHECKING alike)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "adaptive"


def _unit(module: str) -> str:
    """adaptive.train.run.loop -> adaptive.train; adaptive.engine -> adaptive.engine (a module of its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _modules() -> set[str]:
    return {".".join(("adaptive", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
            for p in ROOT.rglob("*.py")}


def _imports() -> dict[str, set[str]]:
    """module -> the names it imports (adaptive, cli, recipes, torch), as written."""
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


def _module_graph() -> dict[str, set[str]]:
    """module -> the adaptive modules it imports: `from adaptive.plan.search import planner` is an edge to
    adaptive.plan.search.planner, `from adaptive.plan import fit` one to the package adaptive.plan."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in _imports().items():
        for target in targets:
            if target in modules and target != module:
                edges[module].add(target)
    for module, targets in edges.items():  # `from pkg import submodule` also names pkg: keep the submodule only
        targets -= {t for t in set(targets) if any(o.startswith(t + ".") for o in targets)}
    return edges


def _subpackage(module: str, package: str) -> str | None:
    """adaptive.plan.search.planner -> "search" under adaptive.plan; a module directly in the package -> "";
    None outside it."""
    if not module.startswith(package + ".") and module != package:
        return None
    rest = module[len(package) + 1:].split(".")
    return rest[0] if len(rest) > 1 else ""


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


def test_no_cycle_between_modules():
    found = _cycle(_module_graph())
    assert found is None, " -> ".join(found)


def test_the_module_graph_sees_a_submodule_named_in_from_import():
    graph = _module_graph()
    assert "adaptive.plan.estimate.memory" in graph["adaptive.plan.ds_config.emit"]  # from adaptive.plan.estimate import memory
    assert "adaptive.plan.search.planner" in graph["adaptive.plan"]


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
    ("adaptive.plan", "adaptive.scaling"),  # the planner reads a sweep's law.json, never the sweep
    ("adaptive.train", "adaptive.scaling"),  # a sweep runs recipes; the loop knows no sweep
    ("adaptive.models", "adaptive.scaling"),
    ("adaptive.orchestrator", "adaptive.scaling"),
    ("adaptive.scaling", "adaptive.orchestrator"),  # its runs are recipe runs with the orchestrator off
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


# Inside adaptive.plan and adaptive.train: which subpackage may import which ("" is the package's own modules:
# adaptive.plan's request, compare and __init__). A subpackage may always import its own modules.
LAYERS = {
    "adaptive.plan": {
        "architecture": set(),  # the model: pure data and arithmetic
        "hardware": set(),
        "finetune": {"architecture"},  # a fine-tuning method and the split of the parameters it makes
        "estimate": {"architecture", "hardware", "finetune"},  # the estimates never import the search
        "quality": {"architecture", "estimate"},  # the loss a run buys: laws over the model and its FLOPs
        "search": {"architecture", "hardware", "finetune", "estimate", "quality"},  # nor does the search import the configs
        "ds_config": {"architecture", "hardware", "finetune", "estimate", "quality", "search"},
        "evidence": {"architecture", "hardware", "finetune", "estimate", "search", "ds_config"},
        "": {"architecture", "hardware", "finetune", "estimate", "quality", "search", "ds_config", "evidence"},
    },
    "adaptive.train": {
        "data": set(),
        "run_folder": set(),
        "reporting": set(),
        "run": {"data", "run_folder", "reporting"},
        "": {"run"},  # hf_trainer: the policies on a transformers Trainer, a public entry point
    },
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_subpackages_import_only_the_layers_below(package):
    offenders = []
    for module, targets in _module_graph().items():
        own = _subpackage(module, package)
        if own is None:
            continue
        assert own in LAYERS[package], f"{module}: subpackage {own!r} of {package} has no rule in LAYERS"
        for target in targets:
            theirs = _subpackage(target, package)
            if theirs is not None and theirs != own and theirs not in LAYERS[package][own]:
                offenders.append(f"{module} imports {target}")
    assert not offenders, offenders


def test_the_deepspeed_reader_imports_nothing_else_of_the_planner():
    """One reader of a user's DeepSpeed JSON: `fit` and the recipes both use it, so it must stay cheap."""
    graph = _module_graph()
    reader = {t for t in graph["adaptive.plan.ds_config.reader"] if t.startswith("adaptive.plan")}
    assert reader == {"adaptive.plan.ds_config.schema"}, reader


def test_only_the_reader_checks_a_deepspeed_file_s_shape():
    """`fit` (plan/request.py) and the recipes (train/run/runplan.py) read a user's file through the reader."""
    users = sorted(m for m, ts in _module_graph().items() if "adaptive.plan.ds_config.schema" in ts)
    assert users == ["adaptive.plan.ds_config.reader"], users
    readers = sorted(m for m, ts in _module_graph().items() if "adaptive.plan.ds_config.reader" in ts)
    assert {"adaptive.plan.request", "adaptive.train.run.runplan"} <= set(readers), readers


def test_no_folder_holds_more_than_14_modules():
    folders = [ROOT, *(d for d in ROOT.rglob("*") if d.is_dir() and d.name != "__pycache__")]
    crowded = {str(d.relative_to(ROOT)): n for d in folders if (n := len(list(d.glob("*.py")))) > 14}
    assert not crowded, crowded
