"""The architecture as a test: floors, rooms and the imports allowed between them.

Every module of ``backend/pagoda`` and ``operator/pagoda_operator`` is parsed (no import
is executed) and every import it makes is collected, function-local ones and those under
``TYPE_CHECKING`` included: a dependency is a dependency wherever it is written.

1. **Floors** (``FLOORS``, bottom first): a module may import its own floor and the floors
   below it, never one above. ``contracts`` is the ground every service shares (block
   hashing, KV events, Redis key names, errors); ``bench`` sits above everything it
   measures; ``pagoda.cli`` and the package root (``from pagoda import LLM``) are the roof.
2. **Rooms**: a subpackage of a floor (``engine.core``, ``fleet.routing``, ...) is one
   room; a module directly in a floor (``engine.request``, ``fleet.service``) is a room of
   its own. Imports between rooms must not close a cycle.
3. **Modules**: no import cycle between modules, whatever their rooms.

A failure names the file, the line and the import. docs/architecture.md is the prose
version of these rules; change both together.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {"pagoda": REPO / "backend" / "pagoda", "pagoda_operator": REPO / "operator" / "pagoda_operator"}
# Bottom first. A module's floor is the first component after ``pagoda`` (``pagoda_operator``
# is the operator floor); the package root and ``pagoda.cli`` are ``roof``.
FLOORS = ["contracts", "kernels", "models", "engine", "serving", "fleet", "operator", "bench", "roof"]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module (a module of ours, dotted)
    path: str  # the importing file, relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_sources() -> dict[str, pathlib.Path]:
    """Every module of ours: dotted name -> file."""
    modules = {}
    for top, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = (top,) + path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def parse_imports(module: str, source: str, path: str, known: set[str], is_package: bool = False) -> list[Import]:
    """The imports of our own modules that ``source`` makes, each resolved to a module in ``known``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, is_package)
            # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # ``import pagoda.engine.x.y`` -> the deepest module of ours
                target = target.rpartition(".")[0]
            if target and target != module:
                found.append(Import(module, target, path, node.lineno))
    return found


def all_imports(extra: dict[str, str] | None = None) -> list[Import]:
    """Every import between our modules; ``extra`` adds (module -> source) modules for self-tests."""
    modules = module_sources()
    known = set(modules) | set(extra or {})
    imports = []
    for module, path in modules.items():
        imports += parse_imports(module, path.read_text(), str(path.relative_to(REPO)), known,
                                 path.name == "__init__.py")
    for module, source in (extra or {}).items():
        imports += parse_imports(module, source, module.replace(".", "/") + ".py", known)
    return imports


def floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pagoda_operator":
        return "operator"
    if len(parts) == 1 or parts[1] == "cli":
        return "roof"
    return parts[1]


def room_of(module: str, is_package: set[str]) -> str:
    """A floor's subpackage, or a module directly in a floor (its own room)."""
    parts = module.split(".")
    depth = 2 if parts[0] == "pagoda_operator" else 3
    return ".".join(parts[:depth])


def climbing(imports: list[Import]) -> list[Import]:
    return [i for i in imports if FLOORS.index(floor_of(i.target)) > FLOORS.index(floor_of(i.source))]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def cycle_imports(imports: list[Import], key) -> list[Import]:
    """The imports along one shortest cycle of each cycle of the ``key`` graph (``key`` maps a
    module to its node): a cycle that a new import closes always runs through it."""
    edges: dict[str, set[str]] = {}
    first: dict[tuple[str, str], Import] = {}
    for i in sorted(imports, key=str):
        a, b = key(i.source), key(i.target)
        if a != b:
            edges.setdefault(a, set()).add(b)
            first.setdefault((a, b), i)
    found = []
    for component in _cycles(edges):
        path = _shortest_cycle(component[0], edges, set(component))
        found += [first[(a, b)] for a, b in zip(path, path[1:])]
    return found


def _shortest_cycle(start: str, edges: dict[str, set[str]], members: set[str]) -> list[str]:
    """``start -> ... -> start`` through ``members``, fewest hops (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, ()) & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def _report(title: str, imports: list[Import]) -> str:
    return title + ":\n" + "\n".join(f"  {i}" for i in imports)


def test_no_import_climbs_a_floor():
    bad = climbing(all_imports())
    assert not bad, _report(f"imports that climb ({' < '.join(FLOORS)})", bad)


def test_no_cycle_between_rooms():
    bad = cycle_imports(all_imports(), lambda m: room_of(m, set()))
    assert not bad, _report("imports that close a cycle between packages or subpackages", bad)


def test_no_cycle_between_modules():
    bad = cycle_imports(all_imports(), lambda m: m)
    assert not bad, _report("imports that close a cycle between modules", bad)


def test_every_module_is_on_a_floor():
    strays = [m for m in module_sources() if floor_of(m) not in FLOORS]
    assert not strays, f"modules on no floor (add the floor to FLOORS and docs/architecture.md): {strays}"


@pytest.mark.parametrize("wrong_source, expected", [
    ("from pagoda.fleet.service import RouterService\n", "climb"),
    ("def f():\n    from pagoda.serving import engine_loop\n", "climb"),
    ("from pagoda_operator import spec\n", "climb"),
])
def test_a_wrong_import_is_named(wrong_source, expected):
    """The checks fail, naming file, line and import, on a deliberately wrong module."""
    bad = climbing(all_imports({"pagoda.engine.core.wrong": wrong_source}))
    assert [str(i) for i in bad if i.source == "pagoda.engine.core.wrong"], bad
    assert "pagoda/engine/core/wrong.py:" in _report("x", bad)


def test_a_cycle_is_named():
    extra = {"pagoda.engine.kv.wrong": "from pagoda.engine.core.sched import scheduler\n"}
    bad = cycle_imports(all_imports(extra), lambda m: room_of(m, set()))
    assert any(i.source == "pagoda.engine.kv.wrong" for i in bad), bad
