"""No import cycles between the parts of ``core/`` (the ``palestra`` package): the architecture's layering, checked.

Each subpackage of ``core/`` (``config``, ``engine``, ``models``, ...) is one node, and so is each top-level module
(``types``, ``registry``, ...: the contract) and the package itself (``palestra/__init__.py``). An edge is a
``palestra.*`` import in a module of one node naming a module of another, read statically with :mod:`ast`.

What counts:
- imports at module level *and* inside functions. A deferred import is the same dependency, only hidden from
  Python's import order, and deferring one is exactly how a cycle is usually papered over; the layering ("`config`
  builds; `engine` runs; everything else is used by `engine`") is about who depends on whom, not when.
- not imports under ``if TYPE_CHECKING:``: they exist for annotations only and never run.
- not ``palestra.plugins`` or ``palestra.kernels`` (separate top-level folders, not ``core/``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"

# Module edges allowed to close a cycle, each named by its two modules so that any other import between the same parts
# still counts; none today. An entry needs a comment saying why the cycle cannot be broken.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["palestra", *parts])


def node_of(module: str) -> str:
    """``palestra.engine.rollout`` -> ``engine``; ``palestra.types`` -> ``types``; ``palestra`` -> ``palestra``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module name an import statement in ``tree`` names (outside ``if TYPE_CHECKING:`` blocks)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for statement in child.orelse:
                yield from imported(ast.Module(body=[statement], type_ignores=[]), module, is_package)
            continue
        if isinstance(child, ast.Import):
            yield from (alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            if child.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (child.level - 1)]
                source = ".".join([*base, *([child.module] if child.module else [])])
            else:
                source = child.module or ""
            for alias in child.names:  # `from palestra import config` names the submodule itself
                yield f"{source}.{alias.name}"
                yield source
        yield from imported(child, module, is_package)


def import_edges(root: Path = CORE) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """``{(node, node): [(module, imported module), ...]}`` for every import between two different nodes."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name in imported(tree, module, path.name == "__init__.py"):
            if name not in modules:
                continue  # not a module of core/ (a name inside one is yielded with its module as well)
            if (module, name) in KNOWN or node_of(module) == node_of(name):
                continue
            pair = (node_of(module), node_of(name))
            if (module, name) not in edges.setdefault(pair, []):
                edges[pair].append((module, name))
    return edges


def cycles(edges: dict[tuple[str, str], list[tuple[str, str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
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


def describe(component: list[str], edges: dict[tuple[str, str], list[tuple[str, str]]]) -> str:
    lines = [f"import cycle between {', '.join(component)}:"]
    for (a, b), why in sorted(edges.items()):
        if a in component and b in component:
            lines.append(f"  {a} -> {b}: " + "; ".join(f"{m} imports {n}" for m, n in why[:3]))
    return "\n".join(lines)


def test_core_has_no_import_cycle_between_its_parts() -> None:
    edges = import_edges()
    found = cycles(edges)
    assert not found, "\n".join(describe(c, edges) for c in found)


def test_every_known_exception_is_still_an_import_in_the_code() -> None:
    # An exception that outlived its import would hide the next one between the same modules: drop it from KNOWN.
    present = set()
    for path in CORE.rglob("*.py"):
        module = module_name(path, CORE)
        present |= {
            (module, n)
            for n in imported(ast.parse(path.read_text(encoding="utf-8")), module, path.name == "__init__.py")
        }
    assert present >= KNOWN, f"no longer imported, remove from KNOWN: {sorted(KNOWN - present)}"


def test_the_checker_finds_a_cycle_through_a_deferred_import_and_ignores_type_checking_ones(tmp_path: Path) -> None:
    for name, text in {
        "a/__init__.py": "",
        "a/x.py": "from palestra.b.y import thing\n",
        "b/__init__.py": "",
        "b/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from palestra.c import z\n"
        "def later():\n    from palestra.a import x\n",
        "c/__init__.py": "",
        "c/z.py": "import palestra.b.y\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = import_edges(tmp_path)
    assert cycles(edges) == [["a", "b"]]  # b -> c is TYPE_CHECKING-only, so c -> b closes no cycle
    assert ("palestra.b.y", "palestra.a.x") in edges[("b", "a")]
