"""The import graph of tokenfeed's packages, read statically from the source files: every import
(at module level, inside functions, under `if TYPE_CHECKING:`), the cycles between modules and
between stage packages, the imports that run against the stage order of docs/architecture.md,
and the modules over MAX_LINES lines. `tests/unit/test_imports.py` fails on any cycle or import
against the order; run this file to print the figures:

    python scripts/importgraph.py
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tokenfeed.server": REPO / "server" / "tokenfeed" / "server",
    "tokenfeed.client": REPO / "client" / "tokenfeed" / "client",
}
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_LINES = 300  # STYLE.md: one responsibility per module, typically 50-300 lines


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


def stage_order(text: str) -> list[str]:
    """The stages of the module map in docs/architecture.md, in order (`errors.py` -> `errors`,
    `jobs/` -> `jobs`): the first column of the table between its stage-order markers."""
    if "<!-- stage order" not in text:  # an earlier version: its module map, errors.py first
        start = text.index("## Module map")
        end = text.index("\n## ", start + 1)
        return ["errors", *_first_column(text[start:end])]
    start = text.index("<!-- stage order")
    end = text.index("<!-- end of stage order -->", start)
    return _first_column(text[start:end])


def _first_column(text: str) -> list[str]:
    stages = []
    for line in text.splitlines():
        m = re.match(r"\|\s*`([\w.]+?)(?:\.py|/)`\s*\|", line)
        if m:
            stages.append(m.group(1))
    return stages


def stage_of(module: str, package: str = "tokenfeed.server") -> str:
    """The stage a module of the server belongs to: its first name component below the
    package (`tokenfeed.server.jobs.job` -> `jobs`, `tokenfeed.server.errors` -> `errors`)."""
    rest = module[len(package) + 1 :] if module.startswith(package + ".") else ""
    return rest.split(".")[0]


def package_graph(edges: Mapping[str, Mapping[str, Import]]) -> dict[str, dict[str, Import]]:
    """Stage -> {stage it imports: the first such Import}, between stages of the server."""
    out: dict[str, dict[str, Import]] = {}
    for importer, targets in edges.items():
        a = stage_of(importer)
        if not a:
            continue
        out.setdefault(a, {})
        for imported, imp in targets.items():
            b = stage_of(imported)
            if b and b != a:  # named by stage, located at the first such import
                out[a].setdefault(b, Import(a, b, imp.kind, imp.path, imp.line))
                out.setdefault(b, {})
    return out


def against_order(found: list[Import], modules: Mapping[str, Path], order: list[str]) -> list[str]:
    """Imports of one server stage from a stage below it in the order (or from a stage the
    order does not name)."""
    rank = {stage: i for i, stage in enumerate(order)}
    bad = []
    for imp in found:
        if imp.imported not in modules:
            continue
        a, b = stage_of(imp.importer), stage_of(imp.imported)
        if not a or not b or a == b:
            continue
        if a not in rank or b not in rank:
            missing = a if a not in rank else b
            bad.append(f"{imp.where()}: stage {missing!r} is not in the stage order")
        elif rank[b] > rank[a]:
            bad.append(
                f"{imp.where()}: {imp.importer} ({a}) imports {imp.imported} ({b}), "
                f"a stage below it ({imp.kind})"
            )
    return bad


def long_modules(modules: Mapping[str, Path], limit: int = MAX_LINES) -> list[tuple[int, str]]:
    sized = [(len(p.read_text(encoding="utf-8").splitlines()), m) for m, p in modules.items()]
    return sorted(((n, m) for n, m in sized if n > limit), reverse=True)


def main(argv: list[str]) -> int:
    """`importgraph.py [REPO]`: the figures of this checkout, or of another one (an earlier
    commit checked out elsewhere, to compare)."""
    repo = Path(argv[0]).resolve() if argv else REPO
    packages = {name: repo / path.relative_to(REPO) for name, path in PACKAGES.items()}
    modules = discover(packages)
    found = imports(modules)
    edges = graph(found, modules, {MODULE, DEFERRED, TYPING})
    module_cycles = cycles(edges)
    stage_cycles = cycles(package_graph(edges))
    order = stage_order((repo / ARCHITECTURE.relative_to(REPO)).read_text(encoding="utf-8"))
    up = against_order(found, modules, order)
    server = {m: p for m, p in modules.items() if m.startswith("tokenfeed.server")}
    print(f"modules: {len(server)} of the server, {len(modules) - len(server)} of the client")
    print(f"imports between our modules: {sum(len(t) for t in edges.values())}")
    print(f"module cycles: {len(module_cycles)}")
    for cycle in module_cycles:
        print("  " + describe(cycle))
    print(f"stage (package) cycles: {len(stage_cycles)}")
    for cycle in stage_cycles:
        print("  " + describe(cycle))
    print(f"imports against the stage order ({' < '.join(order)}): {len(up)}")
    for line in up:
        print("  " + line)
    long = long_modules(modules)
    print(f"modules over {MAX_LINES} lines: {len(long)}")
    for n, m in long:
        print(f"  {n:5d}  {m}")
    return 1 if module_cycles or stage_cycles or up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
