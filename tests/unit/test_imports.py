"""Import structure, read statically from the source files (scripts/importgraph.py): no import
cycle between modules or between stages, counting every import (at module level, inside
functions, under `if TYPE_CHECKING:`); no import against the stage order that
docs/architecture.md's module map writes down; a client that never needs the server; a pure core
that neither does I/O nor imports the service's libraries; and one place that builds the chain
under a job (jobs/stack.py).

Modules are found by walking the package directories and named after their paths, so a module
that moves into a subpackage is still checked, under its new name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from importgraph import (  # noqa: E402 - the library lives beside the script that prints it
    ARCHITECTURE,
    DEFERRED,
    MODULE,
    PACKAGES,
    TYPING,
    against_order,
    cycles,
    describe,
    discover,
    graph,
    imports,
    package_graph,
    stage_order,
)

# Sample order, packing, planning and the wire format: pure functions of their inputs (STYLE.md).
# Named by package and last name component, so they are found wherever they move.
PURE_CORE = {
    "tokenfeed.server": (
        *("order", "packing", "mixture", "planner", "bestfit", "epochlayouts", "segments"),
    ),
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

# The chain under a job: constructed in jobs/stack.py only, or by a factory in the class's own
# module (DiskCache.unbounded, storage.local_storage: what a tool or test gets by default).
CHAIN = ("DiskCache", "ObjectStorage", "TokenStore", "TokenStoreView", "SharedStore", "Job")
STACK = "tokenfeed.server.jobs.stack"
ALL_KINDS = {MODULE, DEFERRED, TYPING}


def pure_core(modules) -> list[str]:
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
def found(modules):
    return imports(modules)


@pytest.fixture(scope="module")
def order() -> list[str]:
    return stage_order(ARCHITECTURE.read_text(encoding="utf-8"))


def test_every_module_of_both_packages_is_read(modules, found):
    # A layout change that hides the files from the walk must fail here, not pass vacuously.
    assert "tokenfeed.server.serve.service" in modules
    assert "tokenfeed.client" in modules
    assert "tokenfeed.client.wire" in modules
    assert len([m for m in modules if m.startswith("tokenfeed.server.")]) >= 30
    importers = {imp.importer for imp in found if imp.imported in modules}
    assert "tokenfeed.server.serve.service" in importers


def test_no_import_cycles_between_modules(modules, found):
    found_cycles = cycles(graph(found, modules, ALL_KINDS))
    assert not found_cycles, "import cycles:\n" + "\n".join(map(describe, found_cycles))


def test_no_import_cycles_between_stages(modules, found):
    found_cycles = cycles(package_graph(graph(found, modules, ALL_KINDS)))
    assert not found_cycles, "stage cycles:\n" + "\n".join(map(describe, found_cycles))


def test_the_stage_order_names_every_stage_of_the_server(modules, order):
    assert order[:3] == ["errors", "telemetry", "settings"], order
    assert order[-1] == "commands", order
    stages = {m.split(".")[2] for m in modules if m.startswith("tokenfeed.server.")}
    assert stages == set(order), (
        f"docs/architecture.md's stage order {order} and the server's stages "
        f"{sorted(stages)} differ: add each stage to the module map, in its place"
    )


def test_every_import_points_up_the_stage_order(modules, found, order):
    bad = against_order(found, modules, order)
    assert not bad, "imports against the stage order (docs/architecture.md):\n" + "\n".join(bad)


def test_only_the_stack_builds_the_chain_under_a_job(modules):
    bad = []
    for module, path in modules.items():
        if not module.startswith("tokenfeed.server.") or module == STACK:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                if name in CHAIN and name not in own:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}(...)")
    assert not bad, "built outside jobs/stack.py:\n" + "\n".join(bad)


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


def test_a_cycle_closed_only_under_type_checking_counts(tmp_path):
    modules = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        },
    )
    found = imports(modules)
    assert cycles(graph(found, modules, {MODULE, DEFERRED})) == []
    (cycle,) = cycles(graph(found, modules, ALL_KINDS))
    assert [imp.kind for imp in cycle] == [MODULE, TYPING]


def test_the_stage_order_is_read_from_the_table_and_enforced(tmp_path):
    doc = (
        "<!-- stage order: ... -->\n| stage | modules | what |\n| --- | --- | --- |\n"
        "| `errors.py` | | e |\n| `low/` | `x.py` | l |\n| `high/` | `y.py` | h |\n"
        "<!-- end of stage order -->\n"
    )
    assert stage_order(doc) == ["errors", "low", "high"]
    root = tmp_path / "tokenfeed" / "server"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "low/__init__.py": "",
        "low/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from tokenfeed.server.high import y\n",
        "high/__init__.py": "",
        "high/y.py": "from tokenfeed.server import errors\nfrom tokenfeed.server.low import x\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    modules = discover({"tokenfeed.server": root})
    found = imports(modules)
    (bad,) = against_order(found, modules, stage_order(doc))
    assert "tokenfeed.server.low.x (low) imports tokenfeed.server.high.y (high)" in bad
    assert "(typing)" in bad
    (cycle,) = cycles(package_graph(graph(found, modules, ALL_KINDS)))
    assert {imp.importer for imp in cycle} == {"low", "high"}
