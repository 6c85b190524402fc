"""Generate the Python stubs for protos/ into client/ (the one place they live).

Run as `python scripts/gen_protos.py [OUT_DIR]`; tests/test_protos_drift.py regenerates into a
temporary directory and fails if the checked-in files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {sources}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client"
    for path in generate(out):
        print(path)
