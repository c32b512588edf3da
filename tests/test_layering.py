"""The package's layers import one way: no two subpackages (or top-level modules) import each other at module level."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "nvoffload"


def unit(module: str) -> str:
    """The layer a module belongs to: its subpackage or top-level module under nvoffload (``nvoffload`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_edges() -> dict[tuple[str, str], set[str]]:
    """``(importing layer, imported layer)``: the files whose module-level imports make that edge."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        source = unit(".".join(rel.parts).removesuffix(".__init__"))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "nvoffload" and unit(target) not in (source, "nvoffload"):
                    edges.setdefault((source, unit(target)), set()).add(str(path.relative_to(PACKAGE.parent)))
    return edges


def test_distributed_does_not_import_the_optimizer_that_imports_it():
    edges = import_edges()
    assert ("optim", "distributed") in edges  # the optimizer shards its state over the ranks
    assert ("distributed", "optim") not in edges, edges[("distributed", "optim")]


def test_no_two_layers_import_each_other_at_module_level():
    edges = import_edges()
    both_ways = {(a, b): (files, edges[(b, a)]) for (a, b), files in edges.items() if a < b and (b, a) in edges}
    assert not both_ways
