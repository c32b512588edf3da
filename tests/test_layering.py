"""The package's layers import one way: in ARCHITECTURE.md's order (its table of layers), never another package's
private module, and with no cycle between its subpackages and top-level modules, counting every import (at module
level or inside a function, absolute or relative, ``from nvoffload import x`` too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "nvoffload"
ARCHITECTURE = Path(__file__).parents[1] / "ARCHITECTURE.md"


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
    if node.level:
        base = module.split(".")[: None if is_package else -1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    # Each name may be a module (``from nvoffload import trace``, ``from . import x``) or an attribute: either way it
    # names its layer through ``source`` and a private module or attribute by its leading underscore.
    return [source, *(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")]


def imports() -> list[tuple[str, str, str]]:
    """``(file, importing module, imported nvoffload name)`` for every import in the package."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node, module, path.name == "__init__.py"):
                if target.split(".")[0] == "nvoffload":
                    found.append((str(rel), module, target))
    return found


def import_edges() -> dict[tuple[str, str], set[str]]:
    """``(importing layer, imported layer)``: the files whose imports make that edge."""
    edges: dict[tuple[str, str], set[str]] = {}
    for rel, module, target in imports():
        if unit(target) not in (unit(module), "nvoffload"):
            edges.setdefault((unit(module), unit(target)), set()).add(rel)
    return edges


def documented_rows(text: str) -> dict[str, int]:
    """Each unit's row in the table of layers under ARCHITECTURE.md's "## The layers" (0: the bottom), from the
    ``nvoffload/<unit>/...`` and ``nvoffload/<unit>.py`` paths of its second column."""
    table = text.split("## The layers", 1)[1].split("\n\n## ", 1)[0]
    rows: dict[str, int] = {}
    body = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| layer ", "| ---"))]
    for row, line in enumerate(body):
        for path in re.findall(r"`nvoffload/([A-Za-z_0-9]+)(?:\.py|/)", line.split("|")[2]):
            assert path not in rows, f"{path} is in two rows of ARCHITECTURE.md's layers"
            rows[path] = row
    return rows


def package_units() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")
    }


def out_of_order(found, rows: dict[str, int]) -> list[str]:
    """The imports that reach a row above their own or another package's private module."""
    wrong = []
    for rel, module, target in found:
        source, dest = unit(module), unit(target)
        if source == "nvoffload" or dest in ("nvoffload", source):  # the package's root exports the API
            continue
        if rows[dest] > rows[source]:
            wrong.append(f"{rel}: {source} (row {rows[source]}) imports {target} (row {rows[dest]})")
        elif any(part.startswith("_") for part in target.split(".")[2:]):
            wrong.append(f"{rel}: {source} imports {target}, private to {dest}")
    return wrong


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


def test_the_table_of_layers_places_every_unit_of_the_package():
    rows = documented_rows(ARCHITECTURE.read_text())
    assert set(rows) == package_units(), (sorted(package_units() - set(rows)), sorted(set(rows) - package_units()))


def test_imports_follow_the_documented_order_and_stay_out_of_private_modules():
    assert not out_of_order(imports(), documented_rows(ARCHITECTURE.read_text()))


def test_the_order_check_refuses_an_import_upwards_and_of_a_private_module():
    rows = documented_rows(ARCHITECTURE.read_text())
    upward = ("nvoffload/core/atomic.py", "nvoffload.core.atomic", "nvoffload.finetune")  # from nvoffload import finetune
    private = ("nvoffload/training.py", "nvoffload.training", "nvoffload.optim._layout.Layout")
    assert len(out_of_order([upward, private], rows)) == 2
    node = ast.parse("from nvoffload import finetune").body[0]
    assert "nvoffload.finetune" in imported(node, "nvoffload.core.atomic", False)


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


MAX_FUNCTION_LINES = 100  # one screen (issue 52)


def long_functions(tree: ast.AST, rel: str, most: int = MAX_FUNCTION_LINES) -> list[str]:
    """The functions and methods of ``tree`` longer than ``most`` lines, from ``def`` to their last line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > most:
                found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_the_length_check_counts_from_def_to_the_last_line_nested_functions_too():
    body = "\n".join(f"        x{i} = {i}" for i in range(98))
    source = f"class C:\n    def outer(self):\n        def inner():\n            pass\n{body}\n"
    assert long_functions(ast.parse(source), "c.py") == ["c.py:2 outer: 101 lines"]
    assert long_functions(ast.parse(source), "c.py", most=101) == []


def test_no_function_in_the_package_is_longer_than_a_screen():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += long_functions(ast.parse(path.read_text()), str(path.relative_to(PACKAGE.parent)))
    assert found == []
