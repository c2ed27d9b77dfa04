"""The package's modules import one another without a cycle, lazy imports inside functions
included (a cycle there still ties two modules together: neither can change alone), and
the slot lock's module imports nothing of the package, so every executor may use it."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "lib" / "vllm_study"


def _name(path: Path) -> str:
    parts = ("vllm_study", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the package modules it imports, anywhere in its source."""
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                # `from . import x` names a module; `from .m import f` names m
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            g.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return g


def test_the_import_graph_has_no_cycle():
    g = import_graph()
    assert g.number_of_edges() > 50  # the walk found the package's imports
    assert ("vllm_study.report.report", "vllm_study.vocab.metrics") in g.edges
    assert list(nx.simple_cycles(g)) == []


def test_the_slot_lock_imports_nothing_of_the_package():
    assert list(import_graph().successors("vllm_study.launch.slots")) == []
