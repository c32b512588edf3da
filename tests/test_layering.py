"""The package's layers import one way: no cycle between its subpackages and top-level modules, counting every
import (at module level or inside a function, absolute or relative)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "nvoffload"


def unit(module: str) -> str:
    """The layer a module belongs to: its subpackage or top-level module under nvoffload (``nvoffload`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The nvoffload modules an import statement names (relative ones resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if not node.level:
        return [node.module or ""]
    base = module.split(".")[: None if is_package else -1]
    base = base[: len(base) - (node.level - 1)]
    if node.module:
        return [".".join([*base, node.module])]
    return [".".join([*base, alias.name]) for alias in node.names]  # from . import x


def import_edges() -> dict[tuple[str, str], set[str]]:
    """``(importing layer, imported layer)``: the files whose imports make that edge."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        source = unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node, module, path.name == "__init__.py"):
                if target.split(".")[0] == "nvoffload" and unit(target) not in (source, "nvoffload"):
                    edges.setdefault((source, unit(target)), set()).add(str(rel))
    return edges


def cycles(edges: dict[tuple[str, str], set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one layer (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_relative_and_function_level_imports_and_cycles():
    edges = import_edges()
    assert ("activations", "transfer") in edges  # activations/offload.py: from ..transfer import TransferEngine
    assert cycles({("a", "b"): set(), ("b", "c"): set(), ("c", "a"): set(), ("c", "d"): set()}) == [["a", "b", "c"]]


def test_the_floor_imports_nothing_above_it():
    edges = import_edges()
    assert not {b for a, b in edges if a == "core"}, {e: f for e, f in edges.items() if e[0] == "core"}


def test_distributed_does_not_import_the_optimizer_that_imports_it():
    edges = import_edges()
    assert ("optim", "distributed") in edges  # the optimizer shards its state over the ranks
    assert ("distributed", "optim") not in edges, edges.get(("distributed", "optim"))


def test_no_import_cycle_between_layers():
    edges = import_edges()
    found = cycles(edges)
    assert not found, [(c, {e: f for e, f in edges.items() if e[0] in c and e[1] in c}) for c in found]


def test_cuda_streams_and_events_are_made_by_the_device_layer_only():
    """``nvoffload/device.py`` is the only CUDA-specific code: no other module makes a CUDA stream or event (the
    gradient buckets' side stream is ``device.side_stream``)."""
    makers = {"Stream", "Event"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "device.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in makers:
                if ast.unparse(node.func.value) in ("torch.cuda", "cuda"):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []
