"""Import structure, read statically from the source files: no import cycles, a client that never
needs the server, and a pure core that neither does I/O nor imports the service's libraries.

Modules are found by walking the package directories and named after their paths, so a module
that moves into a subpackage is still checked, under its new name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {
    "tokenfeed.server": REPO / "server" / "tokenfeed" / "server",
    "tokenfeed.client": REPO / "client" / "tokenfeed" / "client",
}

# Sample order, packing, planning and the wire format: pure functions of their inputs (STYLE.md).
# Named by package and last name component, so they are found wherever they move.
PURE_CORE = {
    "tokenfeed.server": ("order", "packing", "mixture", "planner", "bestfit"),
    "tokenfeed.client": ("wire",),
}
# The service's libraries and the I/O modules. A name matches itself and its submodules.
NOT_IN_PURE_CORE = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "boto3",
    "botocore",
    "prometheus_client",
    "socket",
    "asyncio",
    "uvloop",
    "selectors",
    "ssl",
    "subprocess",
    "http",
    "urllib",
)

# Imports inside functions that are there to break a real cycle: (importer, imported) with the
# reason. Every entry must still exist and must still close a cycle if it were made at the top.
DEFERRED_TO_BREAK_A_CYCLE: dict[tuple[str, str], str] = {
    ("tokenfeed.server.objstore.storage", "tokenfeed.server.objstore.s3backend"): (
        "S3Backend implements storage's ObjectBackend; deferred, boto3 loads only for s3:// URIs"
    ),
    ("tokenfeed.server.serve.app", "tokenfeed.server.serve.workers"): (
        "the supervisor and its workers start jobs with app's helpers; a single process never"
        " loads them"
    ),
}

# An import runs when its module is imported (MODULE), when the function around it is called
# (DEFERRED), or never (TYPING: under `if TYPE_CHECKING:`). TYPING imports are left out of the
# cycle check: they never run, and a callee may well name its caller's type.
MODULE, DEFERRED, TYPING = "module", "deferred", "typing"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module of the packages when it is one, else the name as written
    kind: str
    path: Path
    line: int

    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


def discover(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of the packages, named after its path: `a/b/c.py` under package `p` is
    `p.a.b.c`, and `a/b/__init__.py` is `p.a.b`."""
    modules = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, kind
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _statements(child, TYPING)
        for child in node.orelse:
            yield from _statements(child, kind)
        return
    if kind == MODULE and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        kind = DEFERRED
    for child in ast.iter_child_nodes(node):
        yield from _statements(child, kind)


def _resolve(name: str, modules: Mapping[str, Path]) -> str:
    """`import a.b.c` imports the deepest of a.b.c, a.b that is one of ours."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name


def imports(modules: Mapping[str, Path]) -> list[Import]:
    found = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, kind in _statements(tree, MODULE):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, modules) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = module.split(".")
                    if not is_package:
                        package = package[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, *([base] if base else [])])
                for alias in node.names:
                    # `from p import m` imports the module p.m when there is one, else names of p.
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else _resolve(base, modules))
            for target in dict.fromkeys(targets):
                found.append(Import(module, target, kind, path, node.lineno))
    return found


def graph(found: list[Import], modules: Mapping[str, Path], kinds: set[str]) -> dict[str, dict]:
    """module -> {imported module: the first such Import}, over our own modules only."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in found:
        if imp.kind in kinds and imp.imported in modules:
            edges[imp.importer].setdefault(imp.imported, imp)
    return edges


def cycles(edges: Mapping[str, Mapping[str, Import]]) -> list[list[Import]]:
    """One cycle, as the imports that close it, for each strongly connected group of modules
    (Tarjan's algorithm, iterative); a module that imports itself is a cycle too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1 or node in edges[node]:
                        groups.append(sorted(group))
    return [_cycle_through(group, edges) for group in sorted(groups)]


def _cycle_through(group: list[str], edges: Mapping[str, Mapping[str, Import]]) -> list[Import]:
    """The shortest cycle from the group's first module back to itself (breadth first)."""
    members = set(group)
    start = group[0]
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child, imp in sorted(edges[node].items()):
                if child not in members or child in came:
                    continue
                came[child] = imp
                if child == start:
                    path = [imp]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {group}")


def describe(cycle: list[Import]) -> str:
    steps = [cycle[0].importer] + [f"{imp.imported} ({imp.kind}, {imp.where()})" for imp in cycle]
    return " -> ".join(steps)


def _has_path(edges: Mapping[str, Mapping[str, Import]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for child in edges[todo.pop()]:
            if child == goal:
                return True
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return False


def runtime_graph(found: list[Import], modules: Mapping[str, Path]) -> dict[str, dict]:
    edges = graph(found, modules, {MODULE, DEFERRED})
    for importer, imported in DEFERRED_TO_BREAK_A_CYCLE:
        edges[importer].pop(imported, None)
    return edges


def pure_core(modules: Mapping[str, Path]) -> list[str]:
    core = []
    for package, names in PURE_CORE.items():
        for name in names:
            matches = [m for m in modules if m.startswith(package + ".") and m.endswith("." + name)]
            assert len(matches) == 1, f"pure core module {name!r} of {package}: found {matches}"
            core.extend(matches)
    return core


# -- the project -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return discover(PACKAGES)


@pytest.fixture(scope="module")
def found(modules) -> list[Import]:
    return imports(modules)


def test_every_module_of_both_packages_is_read(modules, found):
    # A layout change that hides the files from the walk must fail here, not pass vacuously.
    assert "tokenfeed.server.serve.service" in modules
    assert "tokenfeed.client" in modules
    assert "tokenfeed.client.wire" in modules
    assert len([m for m in modules if m.startswith("tokenfeed.server.")]) >= 30
    importers = {imp.importer for imp in found if imp.imported in modules}
    assert "tokenfeed.server.serve.service" in importers


def test_no_import_cycles(modules, found):
    found_cycles = cycles(runtime_graph(found, modules))
    assert not found_cycles, "import cycles:\n" + "\n".join(map(describe, found_cycles))


def test_imports_deferred_into_functions_only_to_break_a_cycle(modules, found):
    deferred = {(imp.importer, imp.imported) for imp in found if imp.kind == DEFERRED}
    edges = runtime_graph(found, modules)
    for (importer, imported), reason in DEFERRED_TO_BREAK_A_CYCLE.items():
        assert (importer, imported) in deferred, f"{importer} no longer defers {imported}"
        assert _has_path(edges, imported, importer), (
            f"{importer} defers importing {imported} ({reason}), but no cycle needs it any more:"
            " import it at the top and remove it from DEFERRED_TO_BREAK_A_CYCLE"
        )


def test_the_client_never_imports_the_server(found):
    bad = [
        f"{imp.importer} imports {imp.imported} ({imp.kind}, {imp.where()})"
        for imp in found
        if imp.importer.startswith("tokenfeed.client")
        and (imp.imported == "tokenfeed.server" or imp.imported.startswith("tokenfeed.server."))
    ]
    assert not bad, "\n".join(bad)


def test_the_pure_core_imports_no_io_and_no_service_library(modules, found):
    core = set(pure_core(modules))
    bad = [
        f"{imp.importer} imports {imp.imported} ({imp.kind}, {imp.where()})"
        for imp in found
        if imp.importer in core
        and any(imp.imported == n or imp.imported.startswith(n + ".") for n in NOT_IN_PURE_CORE)
    ]
    assert not bad, "\n".join(bad)


# -- the checks themselves, on a small package made for them ---------------------------------


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return discover({"pkg": root / "pkg"})


def test_a_cycle_through_a_subpackage_and_a_function_is_named(tmp_path):
    modules = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.sub import b\n",
            "sub/__init__.py": "",
            "sub/b.py": "import pkg.sub.c\n",
            "sub/c.py": "def f():\n    from .. import a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        },
    )
    assert set(modules) == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c", "pkg.d"}
    found = imports(modules)
    kinds = {(imp.importer, imp.imported): imp.kind for imp in found}
    assert kinds == {
        ("pkg.a", "pkg.sub.b"): MODULE,
        ("pkg.sub.b", "pkg.sub.c"): MODULE,
        ("pkg.sub.c", "pkg.a"): DEFERRED,
        ("pkg.d", "typing"): MODULE,
        ("pkg.d", "pkg.a"): TYPING,
    }
    (cycle,) = cycles(graph(found, modules, {MODULE, DEFERRED}))
    assert describe(cycle).startswith("pkg.a -> pkg.sub.b (module, ")
    assert [imp.imported for imp in cycle] == ["pkg.sub.b", "pkg.sub.c", "pkg.a"]
    assert cycles(graph(found, modules, {MODULE})) == []


def test_a_module_importing_itself_is_a_cycle(tmp_path):
    modules = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.a\n", "b.py": ""})
    (cycle,) = cycles(graph(imports(modules), modules, {MODULE}))
    assert [(imp.importer, imp.imported) for imp in cycle] == [("pkg.a", "pkg.a")]


def test_nothing_the_pure_core_imports_reaches_io_either(modules, found):
    # Through a module of the project (planner -> index -> storage -> boto3) is as bad as
    # directly: importing the core must not load the service's libraries.
    edges = graph(found, modules, {MODULE})
    reached, todo = set(), list(pure_core(modules))
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(edges.get(m, {}))
    bad = [
        f"{imp.importer} imports {imp.imported} ({imp.where()})"
        for imp in found
        if imp.importer in reached
        and imp.kind == MODULE
        and any(imp.imported == n or imp.imported.startswith(n + ".") for n in NOT_IN_PURE_CORE)
    ]
    assert not bad, f"reached from the pure core ({sorted(reached)}):\n" + "\n".join(bad)
