"""The checked-in stubs are exactly what protos/ generates: nobody edits generated code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_protos(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    checked_in = sorted(
        p.relative_to(ROOT / "client") for p in (ROOT / "client" / "tokenfeed").rglob("*_pb2*.py*")
    )
    assert generated == checked_in
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (ROOT / "client" / rel).read_bytes(), (
            f"{rel} drifted from protos/: run `make protos` and commit the result"
        )
