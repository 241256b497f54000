"""No import cycles at module level in engine/, kernels/ and app/.

Each module is parsed with `ast` (nothing is imported). Its module-level imports are the import statements that run
when the module is imported: those at the top, in module-level `if`/`try`/`with` blocks and in class bodies, but
not those inside functions and not those under `if TYPE_CHECKING:`. `from pkg import name` is an edge to the
submodule pkg.name when one exists, else to pkg. Relative imports are resolved against the importing module. Only
edges between the packages' own modules count; a module never depends on itself through its package.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "app")


# ---------------------------------------------------------------------------------------------------- the graph
def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    modules = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(tree: ast.Module, everywhere: bool = False):
    """The Import/ImportFrom nodes that run when the module is imported (everywhere: every import statement, also
    those in functions and under TYPE_CHECKING, as a deferred import still makes a cycle of the design)."""
    if everywhere:
        yield from (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
        return
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If):
            todo += node.orelse if _is_type_checking(node.test) else node.body + node.orelse
        elif isinstance(node, ast.ClassDef):
            todo += node.body
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            todo += node.body + getattr(node, "orelse", [])
        elif hasattr(ast, "Match") and isinstance(node, ast.Match):
            todo += [s for case in node.cases for s in case.body]


def _base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from (`from .x import y` in a.b.c is a.b.x)."""
    if not node.level:
        return node.module or ""
    parts = name.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules, everywhere: bool = False) -> set[str]:
    """The package modules that `name` (the file at `path`) imports at module level (or anywhere)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in module_level_imports(ast.parse(path.read_text(encoding="utf-8")), everywhere):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _base(name, is_package, node)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            while target and target not in modules:  # import a.b.c.func-like names: the longest module prefix
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT, packages=PACKAGES, everywhere: bool = False) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {name: imports_of(name, path, modules, everywhere) for name, path in modules.items()}


# ---------------------------------------------------------------------------------------------------- cycles
def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those with a cycle."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return sorted(out)


def _shortest_cycle_through(graph, node: str, within: set[str]) -> list[str]:
    """node -> ... -> node, fewest edges, staying inside its component."""
    parent, queue = {node: None}, deque([node])
    while queue:
        current = queue.popleft()
        for nxt in sorted(graph.get(current, ())):
            if nxt == node:
                path = [current]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [node]
            if nxt in within and nxt not in parent:
                parent[nxt] = current
                queue.append(nxt)
    return []


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that sits on a cycle, with the shortest cycle through it (as a -> b -> a), without repeats.
    Empty when the graph has no cycle."""
    cycles = []
    for component in strongly_connected(graph):
        members = set(component)
        for node in component:
            cycle = _shortest_cycle_through(graph, node, members)
            ring = cycle[:-1]
            first = ring.index(min(ring))
            canonical = ring[first:] + ring[:first] + [ring[first]]
            if canonical not in cycles:
                cycles.append(canonical)
    return cycles


# ---------------------------------------------------------------------------------------------------- tests
def test_the_cycle_finder_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}, "g": {"h"}, "h": {"g"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["f", "f"], ["g", "h", "g"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    # two cycles sharing a module: both are reported
    assert find_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["a", "c", "a"]]


def test_only_module_level_imports_make_edges(tmp_path):
    """Imports inside functions and under `if TYPE_CHECKING:` are not edges; `from pkg import sub` is an edge to
    the submodule, `from pkg.mod import name` to the module, relative imports resolve, and the finder fails on the
    cycle that is left."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
        "b.py": "import os\nfrom pkg.sub.d import thing\n\ndef later():\n    from pkg import a\n",
        "c.py": "from . import a\ntry:\n    import pkg.sub\nexcept ImportError:\n    pass\n",
        "sub/__init__.py": "from .d import thing\n",
        "sub/d.py": "from ..c import name\nclass K:\n    import pkg.a\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.d"}, "pkg.c": {"pkg.a", "pkg.sub"},
                     "pkg.sub": {"pkg.sub.d"}, "pkg.sub.d": {"pkg.c", "pkg.a"}}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.d", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.sub.d", "pkg.c"]]
    everywhere = import_graph(tmp_path, ("pkg",), everywhere=True)
    assert everywhere["pkg.a"] == {"pkg.b", "pkg.c"} and everywhere["pkg.b"] == {"pkg.sub.d", "pkg.a"}


def test_no_import_cycles_at_module_level():
    found = find_cycles(import_graph())
    assert not found, "import cycles at module level:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_import_cycles_hidden_inside_functions():
    """A deferred import still makes a cycle of the design: none, counting imports inside functions too."""
    found = find_cycles(import_graph(everywhere=True))
    assert not found, "import cycles through imports inside functions:\n" + "\n".join(" -> ".join(c) for c in found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto packages: each module counts as its package under engine/, kernels/ or app/
    (engine.memory.kv.cache is engine.memory); a module at the top of one counts as itself."""
    packages = {name for name, path in find_modules(ROOT).items() if path.name == "__init__.py"}

    def unit(name: str) -> str:
        top = ".".join(name.split(".")[:2])
        return top if top in packages else name

    folded: dict[str, set[str]] = {}
    for name, targets in graph.items():
        folded.setdefault(unit(name), set()).update(unit(t) for t in targets if unit(t) != unit(name))
    return folded


# the package loops left, each with what cuts it; a loop not listed fails, and so does a listed one that is gone
KNOWN_PACKAGE_LOOPS = {
    ("engine.library", "engine.model", "engine.library"):
        "model/loader resolves hf: names and split files through the library, and library/fit asks model/config "
        "which architectures run: cut when the loader takes resolved paths and the library asks engine.model.inspect",
    ("engine.ledger", "engine.model", "engine.library", "engine.ledger"):
        "ledger/shapes reads model files through model/loader (and so the library), and library/fit builds ledger "
        "shapes from GGUF headers: cut with the same engine.model.inspect",
}


def test_no_import_cycles_between_packages():
    """Folded onto packages, counting imports inside functions: no loops but the known ones (each with its cut)."""
    found = {tuple(c) for c in find_cycles(package_graph(import_graph(everywhere=True)))}
    new = sorted(found - set(KNOWN_PACKAGE_LOOPS))
    gone = sorted(set(KNOWN_PACKAGE_LOOPS) - found)
    assert not new, "package loops:\n" + "\n".join(" -> ".join(c) for c in new)
    assert not gone, f"no longer loops, drop them from KNOWN_PACKAGE_LOOPS: {gone}"


def test_the_engine_never_imports_its_tools():
    """engine/tools/ drives the engine from outside: no module of engine/ (outside tools), kernels/ or app/ imports
    it, not even inside a function."""
    graph = import_graph(everywhere=True)
    offenders = [f"{name} imports {target}" for name, targets in sorted(graph.items()) for target in sorted(targets)
                 if target.startswith("engine.tools") and not name.startswith("engine.tools")]
    assert not offenders, offenders


if __name__ == "__main__":  # python -m tests.test_import_cycles: the cycles now, and those hidden in functions
    for label, everywhere in (("module level", False), ("counting imports inside functions", True)):
        found = find_cycles(import_graph(everywhere=everywhere))
        print(f"{label}: {len(found)} cycle(s)")
        print("\n".join("  " + " -> ".join(cycle) for cycle in found))
