"""The layout's rules, checked on the source (an independent reading of the import graph,
not the packages' own bookkeeping): no import cycle between modules at import time, and no
module importing another's private name. (Files are split where their concept splits, not at
a line count; tests/test_invariants.py checks that each technique is one complete
declaration.)"""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "executor", "api")


def _sources() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    return [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_import_cycles():
    modules = _sources()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                targets = []
            for target in targets:
                owner = _owner(target, modules)
                if owner and owner != name:
                    graph.add_edge(name, owner)
    assert list(nx.simple_cycles(graph)) == []


def test_no_module_imports_a_private_name_of_another():
    found = []
    for name, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                private = [
                    a.name
                    for a in node.names
                    if a.name.startswith("_") and not a.name.endswith("__")
                ]
                if private and node.module.split(".")[0] in PACKAGES:
                    found.append(f"{name}: from {node.module} import {', '.join(private)}")
    assert found == []
