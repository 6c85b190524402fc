"""`tokenfeed build --ray`: a real Ray cluster on loopback (2 CPUs, started here) tokenizes into
the shared store on the S3-compatible test server. The store is byte-identical to `tokenfeed
build --workers 2`'s, a server on it tokenizes nothing, a killed driver resumes with only the
rest, a Ray worker killed mid-task is retried, and bad records are counted and located."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from s3env import free_port, s3_client
from support import ServerProcess, batch_bytes, job_spec, metric, scrape, write_config

pytest.importorskip("ray")

STEPS = [0, 3, 50, 200, 700]
TASK = b"ray::build_chunks"  # the title of a Ray worker process while it runs a build task
# Ray on loopback only: with this, a node's address is 127.0.0.1 and its servers bind there
# (by default Ray takes the host's routable address, even given --node-ip-address=127.0.0.1).
# The cluster and its drivers share a token of this run's (not ~/.ray/auth_token's).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": uuid.uuid4().hex,
}
# The S3-compatible test server takes any credentials; the Ray workers inherit these.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
ENV = {**os.environ, **RAY_ENV, **S3_ENV, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head --block` with 2 CPUs on loopback, in its own session: SIGTERM makes it
    stop every process it started, and the session is killed whole after that."""
    temp = Path(tempfile.mkdtemp(prefix="tfray-", dir="/tmp"))  # Ray's socket paths are short
    log = open(temp / "ray-start.log", "wb")  # noqa: SIM115 - closed below
    ray = Path(sys.executable).parent / "ray"
    cmd = [
        str(ray),
        "start",
        "--head",
        "--block",
        "--port=0",
        "--num-cpus=2",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
    )
    try:
        address_file = temp / "ray_current_cluster"
        deadline = time.monotonic() + 120
        # Ray may log that it started a moment before it writes the cluster's address.
        while (
            b"Ray runtime started" not in (temp / "ray-start.log").read_bytes()
            or not address_file.exists()
        ):
            assert proc.poll() is None and time.monotonic() < deadline, (
                temp / "ray-start.log"
            ).read_text(errors="replace")
            time.sleep(0.1)
        yield address_file.read_text().strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the session
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory, texts) -> Path:
    """About 3.8 MB of JSON Lines: 154 chunks of 24 KiB, long enough to interrupt midway."""
    root = tmp_path_factory.mktemp("raycorpus")
    for part in range(2):
        lines = [json.dumps({"text": f"{t}\n[copy {k}]"}) + "\n" for k in range(4) for t in texts]
        (root / f"part-{part}.jsonl").write_text("".join(lines))
    return root


@pytest.fixture(scope="module")
def bucket(moto_server):
    """One bucket for the module; each test builds under its own prefix."""
    client = s3_client(moto_server.endpoint)
    name = f"ray-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    yield name
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        victims = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if victims:
            client.delete_objects(Bucket=name, Delete={"Objects": victims, "Quiet": True})
    client.delete_bucket(Bucket=name)


def config(tmp: Path, sources: list, name: str, endpoint: str, store: str | None, **server) -> Path:
    spec = job_spec(sources, chunk_bytes="24KiB")
    path = write_config(
        tmp / f"{name}.yaml",
        {"main": spec},
        tmp / f"cache-{name}",
        object_store={"endpoint_url": endpoint, "addressing_style": "path"},
        **server,
    )
    if store is not None:
        path.write_text(path.read_text() + f"store:\n  uri: {store}\n  node: {name}\n")
    return path


def build(cfg: Path, *extra: str, **kw) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "tokenfeed.server.commands.cli",
        "build",
        "--config",
        str(cfg),
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, **kw
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    return out


def objects(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    """The store's chunks and dataset records, by key under the prefix (heartbeats differ)."""
    client = s3_client(endpoint)
    found = {}
    for part in ("chunks/", "datasets/"):
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix + part
        )
        for o in (o for p in pages for o in p.get("Contents", [])):
            body = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            found[o["Key"].removeprefix(prefix)] = body
    return found


def manifests(endpoint: str, bucket: str, prefix: str) -> int:
    pages = s3_client(endpoint).get_paginator("list_objects_v2")
    return sum(
        o["Key"].endswith(".json")
        for p in pages.paginate(Bucket=bucket, Prefix=prefix + "chunks/")
        for o in p.get("Contents", [])
    )


def build_tasks() -> list[int]:
    """Pids of the Ray worker processes running a build task now."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(TASK):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def reference(tmp_path_factory, big_corpus, moto_server, bucket):
    """`tokenfeed build --workers 2` on one machine into the prefix ref/: (chunks, objects)."""
    tmp = tmp_path_factory.mktemp("rayref")
    store = f"s3://{bucket}/ref/"
    out = finish(
        build(
            config(tmp, [big_corpus / "*.jsonl"], "ref", moto_server.endpoint, store),
            "--workers",
            "2",
        )
    )
    first = next(line for line in out.splitlines() if line.startswith("job main: "))
    total = int(first.split(": ")[1].split(" chunks")[0])
    found = objects(moto_server.endpoint, bucket, "ref/")
    assert sum(k.endswith(".json") for k in found) == total + 1  # and the dataset's record
    return total, found


def test_ray_build_publishes_the_same_store_and_servers_tokenize_nothing(
    tmp_path, big_corpus, moto_server, bucket, ray_cluster, reference
):
    endpoint, (total, expected) = moto_server.endpoint, reference
    store = f"s3://{bucket}/whole/"
    out = finish(
        build(
            config(tmp_path, [big_corpus / "*.jsonl"], "whole", endpoint, store),
            "--ray",
            ray_cluster,
        )
    )
    first = next(line for line in out.splitlines() if line.startswith("job main: "))
    assert f"{total} chunks" in first and "0 already published" in first, out
    assert "on 2 CPU(s)" in first, first
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress[-1].startswith(f"[100.0%] {total}/{total} chunks"), out
    assert f"{total} chunks: tokenized {total}, 0 were already published" in out, out
    assert objects(endpoint, bucket, "whole/") == expected

    # A server that builds on its own, and one on the Ray-built store: the same batches.
    local = config(tmp_path, [big_corpus / "*.jsonl"], "local", endpoint, None)
    cold = ServerProcess(local, tmp_path / "local.log")
    try:
        info = cold.wait_ready("main", timeout=180)
        assert info["state"] == "JOB_STATE_READY", cold.log()
        with cold.client("main", timeout=60) as c:
            batches = {s: batch_bytes(c.get_batch(s)) for s in STEPS}
    finally:
        assert cold.stop() == 0, cold.log()
    reader = config(
        tmp_path, [big_corpus / "*.jsonl"], "reader", endpoint, store, metrics_listen="127.0.0.1:0"
    )
    proc = ServerProcess(reader, tmp_path / "reader.log")
    try:
        served = proc.wait_ready("main", timeout=120)
        assert served["state"] == "JOB_STATE_READY", proc.log()
        assert served["fingerprint"] == info["fingerprint"]
        assert f"fingerprint {info['fingerprint']}" in out
        with proc.client("main", timeout=60) as c:
            assert {s: batch_bytes(c.get_batch(s)) for s in STEPS} == batches
        samples = scrape(proc.metrics)
        assert metric(samples, "tokenfeed_tokenized_documents_total", tokenfeed_job="main") == 0
        assert metric(samples, "tokenfeed_shared_store_chunks_total", outcome="fetched") > 0
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_killed_driver_resumes_with_only_the_rest(
    tmp_path, big_corpus, moto_server, bucket, ray_cluster, reference
):
    endpoint, (total, expected) = moto_server.endpoint, reference
    cfg = config(tmp_path, [big_corpus / "*.jsonl"], "killed", endpoint, f"s3://{bucket}/killed/")
    proc = build(cfg, "--ray", ray_cluster, start_new_session=True)
    deadline = time.monotonic() + 120
    while manifests(endpoint, bucket, "killed/") < total // 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver (its tasks run in the cluster's workers)
    proc.wait()
    deadline = time.monotonic() + 60
    while build_tasks():  # Ray ends the dead driver's tasks; one may still publish meanwhile
        assert time.monotonic() < deadline, build_tasks()
        time.sleep(0.05)
    finished = manifests(endpoint, bucket, "killed/")
    assert 0 < finished < total

    out = finish(build(cfg, "--ray", ray_cluster))
    assert f"{finished} already published" in out, out
    assert f"tokenized {total - finished}, {finished} were already published, 0 were found" in out
    assert objects(endpoint, bucket, "killed/") == expected

    rerun = finish(build(cfg, "--ray", ray_cluster))
    assert f"tokenized 0, {total} were already published" in rerun, rerun


def test_a_worker_killed_mid_task_is_retried_and_the_store_is_whole(
    tmp_path, big_corpus, moto_server, bucket, ray_cluster, reference
):
    endpoint, (total, expected) = moto_server.endpoint, reference
    cfg = config(tmp_path, [big_corpus / "*.jsonl"], "crash", endpoint, f"s3://{bucket}/crash/")
    proc = build(cfg, "--ray", ray_cluster)
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        if manifests(endpoint, bucket, "crash/") > 0:  # a task is midway through its chunks
            for pid in build_tasks():
                os.kill(pid, signal.SIGKILL)
                victim = pid
                break
        time.sleep(0.01)
    out = finish(proc)
    assert "will be retried" in out, out  # Ray's word, through the driver's output
    assert f"{total} chunks: tokenized " in out, out
    summary = next(line for line in out.splitlines() if "built on Ray" in line)
    tokenized = int(summary.split("tokenized ")[1].split(",")[0])
    found = int(summary.split("already published, ")[1].split(" were found")[0])
    assert tokenized + found == total and "0 were already published" in summary, summary
    assert objects(endpoint, bucket, "crash/") == expected


def test_bad_records_are_counted_and_located_in_the_summary(
    tmp_path, moto_server, bucket, ray_cluster, texts
):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": t}) for t in texts[:60]]
    lines = good[:20] + ['{"text": "unterminated'] + good[20:40] + ['["a", "list"]'] + good[40:]
    path.write_text("\n".join(lines) + "\n")
    cfg = config(tmp_path, [path], "bad", moto_server.endpoint, f"s3://{bucket}/bad/")
    out = finish(build(cfg, "--ray", ray_cluster))
    assert "2 bad record(s) (malformed_json 1, not_an_object 1)" in out, out
    assert f"bad record: {path}:21: malformed_json" in out, out
    assert f"bad record: {path}:42: not_an_object" in out, out


def test_ray_build_without_a_shared_store_is_refused(tmp_path, big_corpus, moto_server):
    cfg = config(tmp_path, [big_corpus / "*.jsonl"], "nostore", moto_server.endpoint, None)
    proc = build(cfg, "--ray")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "tokenfeed build --ray` publishes to the shared store" in out and "store:" in out


def test_the_server_never_imports_ray():
    code = (
        "import sys, tokenfeed.server.serve.app, tokenfeed.server.offline.build, "
        "tokenfeed.server.commands.cli; "
        "sys.exit('ray' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], env=ENV).returncode == 0
