"""The layer rules of docs/architecture.md hold for every import in the package, and no two modules import
each other (directly or round a longer loop). Imports inside functions and under TYPE_CHECKING count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gym_bridge"
OUTSIDE = {"gym_bridge", "gym_bridge._public"}  # the public API sits outside the layers


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gym_bridge"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gym_bridge"))
    return {name for name in found if name in modules}


LAYERS: list[tuple[str, list[str]]] = [
    ("bottom", ["types", "json_types", "batched", "interfaces", "failures", "boundary", "metrics", "stats", "data", "ray_utils", "gym_versions"]),
    ("components: models", ["models"]),
    ("components: generation", ["generation"]),
    ("components: serving", ["serving"]),
    ("components: policy, environments, preflight", ["policy", "environments", "preflight", "preflight_answers"]),
    ("components: gym_model", ["gym_model"]),
    ("components: gym protocol", ["gym.protocol"]),
    ("components: gym servers", ["gym.servers"]),
    ("components: gym transport", ["gym.transport", "gym"]),
    ("components: rollout", ["rollout"]),
    ("components: training", ["training"]),
    ("config", ["config"]),
    ("recipes", ["recipes"]),
    ("tools", ["eval", "cli", "testing"]),
]
"""The layers in import order: each imports only from itself and the layers before it (docs/architecture.md draws
the same table for readers). ``gym/``'s sub-packages are ordered sub-layers like the components."""


def layers() -> list[tuple[str, list[str]]]:
    """(layer, module prefixes) in import order."""
    return [(name, [f"gym_bridge.{module}" for module in modules]) for name, modules in LAYERS]


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int:
    matches = [
        (len(prefix), rank)
        for rank, (_, prefixes) in enumerate(table)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer of LAYERS"
    return max(matches)[1]


def package_graph() -> dict[str, set[str]]:
    """Every package module (outside the public API) and the package modules it imports."""
    files = module_files()
    return {module: imports(path, set(files)) - OUTSIDE for module, path in files.items() if module not in OUTSIDE}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import in ``graph`` that reaches a later layer (or leaves ``failures/``), as one readable line."""
    table = layers()
    upward = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module, table)
        for target in sorted(targets):
            if layer_of(target, table) > mine:
                upward.append(f"{module} ({table[mine][0]}) imports {target} ({table[layer_of(target, table)][0]})")
            if module.startswith("gym_bridge.failures") and not target.startswith("gym_bridge.failures"):
                upward.append(f"{module} imports {target}: failures/ imports nothing")
    return upward


def test_no_module_imports_from_a_later_layer():
    assert upward_imports(package_graph()) == []


def test_a_planted_upward_import_is_caught_in_every_layer():
    """For each layer, one of its modules made to import a module of the next layer is reported: the table's order
    is enforced between every pair of neighbouring layers, the components' sub-layers included."""
    graph = package_graph()
    table = layers()
    by_layer: dict[int, list[str]] = {}
    for module in sorted(graph):
        by_layer.setdefault(layer_of(module, table), []).append(module)
    for rank in range(len(table) - 1):
        lower, upper = by_layer[rank][0], by_layer[rank + 1][0]
        planted = {**graph, lower: graph[lower] | {upper}}
        assert any(line.startswith(f"{lower} ") and line.endswith(f"{upper} ({table[rank + 1][0]})")
                   for line in upward_imports(planted)), f"{lower} -> {upper} not caught"


def test_no_import_loops():
    files = module_files()
    graph = {m: imports(p, set(files)) - OUTSIDE - {m} for m, p in files.items() if m not in OUTSIDE}
    # Tarjan's strongly connected components: a component of more than one module is a loop.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert loops == []
