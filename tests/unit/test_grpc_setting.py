"""The client chooses how gRPC reads a trainer's sockets when it is imported first
(tokenfeed/client/_grpcsetting.py), and leaves gRPC alone otherwise. Each case is a fresh
interpreter: the choice is made once, at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenfeed.client import _grpcsetting

REPORT = (
    "import json, os, sys\n"
    "{before}\n"
    "import tokenfeed.client as c\n"
    "print(json.dumps([c.grpc_setting(), os.environ.get('GRPC_EXPERIMENTS')]))\n"
)


def _run(before: str = "", **env: str) -> tuple[str, str | None]:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run(
        [sys.executable, "-c", REPORT.format(before=before)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    said, value = json.loads(out.stdout.strip().splitlines()[-1])
    return said, value


def _measured() -> bool:
    version = _grpcsetting._grpcio_version()
    return version is not None and version[:2] in _grpcsetting.MEASURED


@pytest.mark.skipif(not _measured(), reason="the installed grpcio is not a measured version")
def test_imported_first_it_turns_the_event_engine_client_off():
    said, value = _run()
    assert value == "-event_engine_client"
    assert said.startswith("GRPC_EXPERIMENTS=-event_engine_client")


def test_an_operators_setting_wins_even_an_empty_one():
    for preset in ("", "-some_other_experiment"):
        said, value = _run(GRPC_EXPERIMENTS=preset)
        assert value == preset
        assert said == f"left alone: GRPC_EXPERIMENTS is set ({preset!r})"


def test_grpc_imported_before_the_client_is_left_as_it_is():
    said, value = _run("import grpc")
    assert value is None
    assert said == "left alone: grpc was imported before tokenfeed.client"


def test_a_grpcio_it_was_not_measured_on_is_left_alone():
    # The version as importlib.metadata reports it, replaced before the client is imported.
    said, value = _run("import importlib.metadata as m; m.version = lambda name: '1.99.0'")
    assert value is None
    assert said == "left alone: grpcio 1.99 is not a version the setting was measured on"


@pytest.mark.skipif(not _measured(), reason="the installed grpcio is not a measured version")
def test_a_benchmarks_children_get_the_environments_value_not_its_clients():
    """bench.child_env: the bare transport's readers keep gRPC's defaults, and each consumer's
    client chooses for itself, though the benchmark's own process imported the client first."""
    code = (
        "import json, os, tokenfeed.client\n"
        "from bench import child_env\n"
        "print(json.dumps([os.environ.get('GRPC_EXPERIMENTS'), child_env().get('GRPC_EXPERIMENTS'),"
        " child_env({'GRPC_EXPERIMENTS': 'x'})['GRPC_EXPERIMENTS']]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    for preset, expected in ((None, [_grpcsetting.POLLING_CLIENT, None, "x"]), ("", ["", "", "x"])):
        env = clean if preset is None else {**clean, "GRPC_EXPERIMENTS": preset}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
