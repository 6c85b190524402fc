"""Every import of the benchmarks resolves, those inside functions too: bench/ runs outside CI,
so a module moved in the server would otherwise break a benchmark silently until it is run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = sorted((ROOT / "bench").glob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("tokenfeed", "bench"):
                found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("tokenfeed", "bench"):
                    found.append((a.name, [], node.lineno))
    return found


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.name)
def test_every_import_of_a_benchmark_resolves(path):
    assert BENCH, "no benchmark modules found"
    for module, names, line in _imports(path):
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), (
                f"{path.name}:{line}: {module} has no {name}"
            )
