"""The client installs and imports without the server's dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (grpc itself aliases grpc_health and grpc_reflection when they are installed, so those two
# are checked by the fresh-environment test instead.)
SERVER_ONLY = (
    "pyarrow",
    "tokenizers",
    "boto3",
    "botocore",
    "uvloop",
    "yaml",
    "zstandard",
    "orjson",
    "prometheus_client",
    "tokenfeed.server",
    "torch",
    "jax",
)


FRAMEWORKS = (
    "torch",
    "jax",
    "torchtitan",
    "megatron",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "olmo_core",
    "grain",
)


def test_importing_the_trainer_adapters_imports_no_framework():
    """Every module of tokenfeed.client.integrations imports its framework only when used."""
    code = (
        "import sys, pkgutil, importlib, tokenfeed.client.integrations as pkg\n"
        "names = [m.name for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names)); print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, *loaded = out.stdout.split()
    assert int(count) >= 8, "the adapters and their shared modules were imported"
    leaked = sorted(m for m in loaded if m.split(".")[0] in FRAMEWORKS)
    assert not leaked, f"the trainer adapters pulled in frameworks: {leaked}"


def test_importing_the_client_imports_no_server_module():
    code = "import sys, tokenfeed.client; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "grpc" in loaded and "numpy" in loaded
    leaked = sorted(
        m
        for m in loaded
        if m.split(".")[0] in SERVER_ONLY
        or any(m == s or m.startswith(s + ".") for s in SERVER_ONLY)
    )
    assert not leaked, f"tokenfeed.client pulled in server dependencies: {leaked}"


@pytest.mark.slow
def test_client_installs_alone_in_a_fresh_environment(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    subprocess.run(
        [*pip, str(ROOT / "client")],
        check=True,
        timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    listed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.lower()
    for dep in ("pyarrow", "tokenizers", "boto3", "uvloop", "grpcio-health", "tokenfeed=="):
        assert dep not in listed, f"{dep} was installed with the client"
    code = "from tokenfeed.client import Client, Batch; print(Client.__name__)"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "Client", out.stderr
