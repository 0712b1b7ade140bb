"""No import cycles inside llmc: its modules form a layered graph (contract below passes and the
runtime, the runtime below its backends), so each can be read, tested and loaded on its own.

The graph is built from the source with `ast`, nothing imported. An edge A -> B is any import of
the llmc module B written anywhere in A, at module level, inside a function or under
TYPE_CHECKING: an import kept lazy (to keep torch or TensorRT off the CPU path) is a dependency
all the same. `from P import n`
is an edge to P.n when P.n is a module of llmc, else to P; `import P.n` is an edge to P.n. The
parent packages Python loads on the way to a submodule are not edges: a package's __init__ that
imports its own submodules is an edge from the package to them, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "llmc"


def _modules() -> dict[str, Path]:
    """Every module of llmc by dotted name (a package by its own name, from its __init__.py)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmc modules `name` (at `path`) imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` steps above this one's
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles, as paths a -> b -> ... -> a: in each strongly connected component of
    more than one module (Tarjan's algorithm, iterative), the shortest cycle through each of its
    modules, each cycle once."""
    found: list[list[str]] = []
    for component in _components(graph):
        for start in sorted(component):
            cycle = _shortest_cycle(start, component, graph)
            turns = {tuple(cycle[i:-1] + cycle[:i + 1]) for i in range(len(cycle) - 1)}
            if not any(tuple(known) in turns for known in found):
                found.append(cycle)
    return found


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def _shortest_cycle(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from `start` back to it inside its component (breadth-first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_lazy_and_from_imports():
    graph = import_graph()
    assert "llmc.contract.manifest" in graph["llmc.contract.engine_dir"]  # module level, `from ... import`
    assert "llmc.contract.graph_io" in graph["llmc.contract.profiles"]  # `from llmc.contract import graph_io`
    assert "llmc.trt.plan" in graph["llmc.trt.engine"]  # inside a method


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"f"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c", "a"], ["b", "d", "b"]]


def _below(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """What each module of `package` imports from outside it."""
    return {name: {t for t in targets if not (t == package or t.startswith(package + "."))}
            for name, targets in graph.items() if name == package or name.startswith(package + ".")}


def test_the_contract_imports_only_errors_and_version():
    outside = {name: targets - {"llmc.errors", "llmc.version"}
               for name, targets in _below(import_graph(), "llmc.contract").items()}
    assert not {name: targets for name, targets in outside.items() if targets}


def test_the_runtime_imports_no_backend():
    """Backends register with the runtime (llmc.runtime.backends); the runtime never imports one."""
    backends = {name: {t for t in targets if t == "llmc.trt" or t.startswith("llmc.trt.")}
                for name, targets in _below(import_graph(), "llmc.runtime").items()}
    assert not {name: targets for name, targets in backends.items() if targets}


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles in llmc (break each: move what both sides need below them):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in found)
