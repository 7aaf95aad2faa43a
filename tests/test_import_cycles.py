"""No import cycle between the project's modules (engine, strategies, heads).

Every import counts, also those under ``if TYPE_CHECKING:`` and inside functions: a cycle
hidden by a lazy import is still two modules that cannot be understood one without the other.
A package's ``__init__`` is a module like any other; importing ``a.b.c`` is an edge to
``a.b.c`` only, not to the packages above it.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import ROOT, imported_modules

PACKAGES = ("engine", "strategies", "heads")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a.b import c``: ``a.b.c`` when that is
    a module, else ``a.b``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for _, imported in imported_modules(path.read_text(), package):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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
    return sorted(found)


def test_no_import_cycles_between_project_modules() -> None:
    assert cycles(import_graph(project_modules())) == []


def test_the_cycle_finder_sees_cycles_through_lazy_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_graph_resolves_from_imports_to_modules() -> None:
    graph = import_graph(project_modules())
    assert "engine.checkpointing.load" in graph["engine.engine"]  # a function-level import
    assert "strategies.backends.base" in graph["engine.engine"]  # `from ... import Name`
