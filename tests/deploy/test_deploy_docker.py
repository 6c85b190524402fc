"""deploy/docker: the Dockerfiles' structure, and their build steps run outside Docker.

No Docker engine runs here, so the images are not built. What is checked instead: pinned base
images, a non-root user, the cache VOLUME, the EXPOSEd ports, the command; that everything the
Dockerfiles COPY is in the build context .dockerignore leaves; that this context alone builds
both distributions; and that the image's `pip install -c constraints.txt ./client .` resolves
to the pinned versions, as binary wheels only (the build stage's compiler builds the server's
one C extension, nothing else). The HEALTHCHECK
command runs against a real server in test_deploy_live.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from deploy_support import (
    CLIENT_DOCKERFILE,
    ROOT,
    SERVER_DOCKERFILE,
    dockerignore_excludes,
    dockerignore_patterns,
    parse_dockerfile,
    run,
)

DOCKERFILES = {"server": SERVER_DOCKERFILE, "client": CLIENT_DOCKERFILE}


def _copy_sources(dockerfile) -> list[str]:
    sources = []
    for copy in dockerfile.all("COPY"):
        if "--from=" in copy.args:
            continue
        *srcs, _dest = copy.args.split()
        sources.extend(s.rstrip("/") for s in srcs if not s.startswith("--"))
    return sources


def _context_files(sources: list[str]) -> list[str]:
    """The files under `sources` that .dockerignore lets into the build context."""
    patterns = dockerignore_patterns()
    files = []
    for source in sources:
        path = ROOT / source
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in candidates:
            rel = p.relative_to(ROOT).as_posix()
            if not dockerignore_excludes(patterns, rel):
                files.append(rel)
    return files


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_structure(name):
    d = parse_dockerfile(DOCKERFILES[name])
    for image in d.base_images():
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", image
        assert repo == "python" and tag.startswith("3.11-slim"), image
    (user,) = d.final("USER")
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, user.args  # numeric: runAsNonRoot can verify it
    assert d.final("ENTRYPOINT") and d.final("CMD")
    assert len(d.all("FROM")) == 2  # build stage + runtime stage
    for run_step in d.final("RUN"):  # the runtime stage installs nothing
        assert "pip install" not in run_step.args


def test_server_image_contract():
    d = parse_dockerfile(SERVER_DOCKERFILE)
    (volume,) = d.final("VOLUME")
    assert json.loads(volume.args) == ["/var/cache/tokenfeed"]
    (expose,) = d.final("EXPOSE")
    assert expose.args.split() == ["50051", "9100"]
    (entrypoint,) = d.final("ENTRYPOINT")
    (cmd,) = d.final("CMD")
    assert entrypoint.json_args() + cmd.json_args() == [
        "tokenfeed",
        "serve",
        "--config",
        "/etc/tokenfeed/config.yaml",
    ]
    (health,) = d.final("HEALTHCHECK")
    assert health.json_args()[:2] == ["python", "-c"]
    (stop,) = d.final("STOPSIGNAL")
    assert stop.args == "SIGTERM"  # SIGTERM drains


def test_client_image_has_the_client_only():
    d = parse_dockerfile(CLIENT_DOCKERFILE)
    assert set(_copy_sources(d)) == {"constraints.txt", "client"}
    assert not d.final("EXPOSE") and not d.final("VOLUME")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_everything_copied_is_in_the_build_context(name):
    patterns = dockerignore_patterns()
    for source in _copy_sources(parse_dockerfile(DOCKERFILES[name])):
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(patterns, source), f"{source} is .dockerignored"


def test_dockerignore_keeps_the_rest_out():
    patterns = dockerignore_patterns()
    for path in (
        ".venv/bin/python",
        ".tools/bin/promtool",
        ".git/HEAD",
        ".demo/tokenizer.json",
        "tests/conftest.py",
        "build/lib/x.py",
        "client/build/lib/x.py",
        "server/tokenfeed.egg-info/PKG-INFO",
        "server/tokenfeed/__pycache__/x.pyc",
        "docker-compose.yml",
        "deploy/k8s/fleet/statefulset.yaml",
    ):
        assert dockerignore_excludes(patterns, path), path
    for path in (
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "server/tokenfeed/server/serve/app.py",
        "client/tokenfeed/client/__init__.py",
        "client/tokenfeed/v1/tokenfeed_pb2.py",
        "client/pyproject.toml",
    ):
        assert not dockerignore_excludes(patterns, path), path


def _server_wheel(out):
    (wheel,) = out.glob("tokenfeed-0.1.0-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """Both distributions built from the server image's build context alone."""
    context = tmp_path_factory.mktemp("context")
    for rel in _context_files(_copy_sources(parse_dockerfile(SERVER_DOCKERFILE))):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    out = context / "wheels"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    pip = [ROOT / ".venv" / "bin" / "python", "-m", "pip"]
    run(
        [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, "./client", "."],
        cwd=context,
        env=env,
        timeout=120,
    )
    server, client = sorted(p.name for p in out.iterdir())
    assert client == "tokenfeed_client-0.1.0-py3-none-any.whl"
    # The server's wheel carries its C extensions (pack._gather, pack._rowmessages,
    # sampling._feistel): a platform wheel of this Python.
    assert re.fullmatch(r"tokenfeed-0\.1\.0-cp311-cp311-linux_\w+\.whl", server), server
    return context, out


def test_the_context_builds_a_complete_server_wheel(wheels):
    import zipfile

    _, out = wheels
    with zipfile.ZipFile(_server_wheel(out)) as z:
        names = set(z.namelist())
    modules = {
        f"tokenfeed/server/{p.name}" for p in (ROOT / "server/tokenfeed/server").glob("*.py")
    }
    assert modules <= names
    assert any(n.endswith("entry_points.txt") for n in names)
    for ext in ("pack/_gather", "pack/_rowmessages", "sampling/_feistel"):
        assert any(re.fullmatch(rf"tokenfeed/server/{ext}\.cpython-311-.+\.so", n) for n in names)


def test_image_install_resolves_to_pinned_wheels(wheels):
    """The image's install step, resolved for real against the package index: every
    dependency at its constraints.txt version, and every one a binary wheel."""
    context, out = wheels
    report = context / "report.json"
    pip = [ROOT / ".venv" / "bin" / "python", "-m", "pip"]
    run(
        [
            *pip,
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--only-binary",
            ":all:",
            "--report",
            report,
            "-c",
            "constraints.txt",
            out / "tokenfeed_client-0.1.0-py3-none-any.whl",
            _server_wheel(out),
        ],
        cwd=context,
        timeout=120,
    )
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_normal(name)] = version.strip()
    installs = json.loads(report.read_text())["install"]
    resolved = {_normal(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    assert {"tokenfeed", "tokenfeed-client", "grpcio", "boto3", "tokenizers"} <= set(resolved)
    unpinned = {
        n: v for n, v in resolved.items() if n not in pins and not n.startswith("tokenfeed")
    }
    assert unpinned == {}, "dependencies missing from constraints.txt"
    assert {n: v for n, v in resolved.items() if n in pins and pins[n] != v} == {}


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")
