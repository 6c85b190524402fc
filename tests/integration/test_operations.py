"""What operators touch, against real parts: the metrics port scraped by promtool and by a real
Prometheus server, the status page rendered by headless Chromium, gRPC health through a build
and a drain. The tools come from scripts/install_tools.sh (`make test` runs it)."""

from __future__ import annotations

import html
import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from s3env import free_port, s3_client
from support import TOKENIZER, ServerProcess, job_spec, metric, scrape, write_config, write_jsonl
from tokenfeed.client import errors as client_errors
from tokenfeed.server.telemetry import metrics

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
REQUESTS = 12


def tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} is missing: run `make tools` (scripts/install_tools.sh)"
    return str(path)


@pytest.fixture(scope="module")
def ops(tmp_path_factory, corpus):
    """A server with the metrics port, a corpus with two malformed records, some traffic."""
    tmp = tmp_path_factory.mktemp("ops")
    bad = tmp / "bad.jsonl"
    write_jsonl(bad, [f"a short document number {i} for the status page" for i in range(30)])
    with bad.open("a") as f:
        f.write('{"text": broken\n[1, 2]\n')
    jobs = {"main": job_spec([corpus / "*", bad])}
    cfg = write_config(tmp / "tf.yaml", jobs, tmp / "cache", metrics_listen="127.0.0.1:0")
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    wire_bytes = 0  # the compact batches' bytes, as received
    with proc.client("main") as c:
        for step in range(REQUESTS // 2):
            for rank in range(2):
                b = c.get_batch(step, rank=rank, world_size=2).compact
                wire_bytes += sum(a.nbytes for a in (b.tokens, b.starts, b.row_splits))
                wire_bytes += 0 if b.padding is None else b.padding.nbytes
        with pytest.raises(client_errors.InvalidRequest):
            c.get_batch(0, rank=0, world_size=3)
    proc.wire_bytes = wire_bytes
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_real_scrape_passes_promtool_and_counts_what_happened(ops):
    with urllib.request.urlopen(f"http://{ops.metrics}/metrics", timeout=10) as r:
        text = r.read()
    check = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    s = scrape(ops.metrics)
    assert metric(s, "tokenfeed_requests_total", method="GetBatch", code="OK") == REQUESTS
    assert metric(s, "tokenfeed_requests_total", method="GetBatch", code="INVALID_ARGUMENT") == 1
    assert metric(s, "tokenfeed_request_duration_seconds_count", method="GetBatch") == REQUESTS
    assert metric(s, "tokenfeed_served_tokens_total", tokenfeed_job="main") == REQUESTS * 4 * 64
    assert metric(s, "tokenfeed_served_bytes_total", tokenfeed_job="main") == ops.wire_bytes
    assert ops.wire_bytes < REQUESTS * 4 * 64 * 4  # less than one int32 tensor of the batch
    for reason in ("malformed_json", "not_an_object"):
        assert metric(s, "tokenfeed_bad_records_total", tokenfeed_job="main", reason=reason) == 1
    assert metric(s, "tokenfeed_job_ready", tokenfeed_job="main") == 1
    assert metric(s, "tokenfeed_job_furthest_step", tokenfeed_job="main") == REQUESTS // 2 - 1
    built = metric(s, "tokenfeed_job_chunks_built", tokenfeed_job="main")
    assert built == metric(s, "tokenfeed_job_chunks", tokenfeed_job="main") > 0
    assert metric(s, "tokenfeed_tokenized_documents_total", tokenfeed_job="main") > 400
    assert metric(s, "tokenfeed_serving") == 1


def test_metrics_are_declared_with_units_and_low_cardinality_labels():
    allowed = {"tokenfeed_job", "method", "code", "kind", "reason", "op", "outcome"}
    unitless = {
        "tokenfeed_serving",
        "tokenfeed_job_ready",
        "tokenfeed_job_failed",
        "tokenfeed_job_chunks",
        "tokenfeed_job_chunks_built",
        "tokenfeed_cache_entries",
        "tokenfeed_job_furthest_step",
        "tokenfeed_job_prefetch_lead_steps",
    }
    families = [f for f in metrics.REGISTRY.collect() if f.name.startswith("tokenfeed_")]
    assert len(families) >= 30
    for family in families:
        sample_labels = {k for s in family.samples for k in s.labels} - {"le"}
        assert sample_labels <= allowed, family.name
        if family.type == "counter":
            continue  # exported with _total
        assert family.name in unitless or family.name.endswith(("_seconds", "_bytes")), family.name


def prometheus_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_a_real_prometheus_scrapes_the_server_and_answers_promql(ops, tmp_path):
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: tokenfeed\n    static_configs: [{{targets: ['{ops.metrics}']}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'db'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60

        def wait_for(expr: str) -> list[dict]:
            while True:
                try:
                    result = prometheus_query(base, expr)
                    if result:
                        return result
                except OSError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
                time.sleep(0.25)

        assert wait_for('up{job="tokenfeed"} == 1')
        with ops.client("main") as c:  # traffic between two scrapes, for rate()
            for step in range(20):
                c.get_batch(step)
                time.sleep(0.1)
        p99 = wait_for(
            "histogram_quantile(0.99, sum by (le, method) "
            '(rate(tokenfeed_request_duration_seconds_bucket{method="GetBatch"}[10s])))'
            " > 0"
        )
        (series,) = p99
        assert series["metric"] == {"method": "GetBatch"}
        assert 0 < float(series["value"][1]) < 60 and math.isfinite(float(series["value"][1]))
        total = wait_for('sum(tokenfeed_requests_total{method="GetBatch",code="OK"}) >= 32')
        assert float(total[0]["value"][1]) == REQUESTS + 20
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def render_with_chromium(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp / 'profile'}",
    ]
    return subprocess.run([tool("chromium"), *flags, *extra, url], capture_output=True, timeout=120)


def uptime_on(page: str) -> int:
    (seconds,) = re.findall(r'<td id="uptime" data-seconds="(\d+)">', page)
    return int(seconds)


def test_status_page_in_headless_chromium(ops, tmp_path):
    url = f"http://{ops.metrics}/"
    dom = render_with_chromium(url, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr.decode()[-2000:]
    page = dom.stdout.decode()
    # Which server this is, and for how long it has run.
    host = html.escape(socket.gethostname())
    assert f'<td id="host">{host}</td>' in page
    assert f'<td id="node">{host}</td>' in page  # no shared store: the node is the host
    version = importlib.metadata.version("tokenfeed")
    assert f'<td id="version">{html.escape(version)}</td>' in page
    first = uptime_on(page)
    assert first >= 1  # the fixture built and served before this page
    time.sleep(1.1)
    again = render_with_chromium(url, tmp_path, "--dump-dom")
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert uptime_on(again.stdout.decode()) > first
    # It reloads itself without a script, and links to the metrics it summarizes.
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "<script" not in page
    (metrics_href,) = re.findall(r'<a href="([^"]*)">/metrics</a>', page)
    with urllib.request.urlopen(urllib.parse.urljoin(url, metrics_href), timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        assert b"\ntokenfeed_serving 1.0\n" in r.read()
    assert '<h3 id="job-main">main <span class="ready">ready</span></h3>' in page
    assert "Disk cache" in page and "evictions" in page
    assert "<th>throughput</th><td>0 tokens/s" not in page  # traffic within the last minute
    assert "<th>furthest step</th><td>" in page
    # Each rank of the traffic, with its latest step.
    last = REQUESTS // 2 - 1
    for rank in (0, 1):
        assert f"<tr><td>{rank}</td><td>2</td><td>{last}</td>" in page
    # The malformed records were logged with their locations and show among recent events.
    assert "bad.jsonl:31" in page and "malformed_json" in page
    shot = tmp_path / "status.png"
    png = render_with_chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1000,1300")
    assert png.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    if os.environ.get("TOKENFEED_REGEN_SCREENSHOT"):  # the one kept in docs/
        shutil.copyfile(shot, ROOT / "docs" / "status-page.png")


def test_status_names_the_shared_store_node_of_a_supervisor(tmp_path, corpus):
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp_path / "cache",
        metrics_listen="127.0.0.1:0",
        workers=2,
    )
    cfg.write_text(cfg.read_text() + f"store:\n  uri: {tmp_path / 'shared'}\n  node: data-7\n")
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
        with urllib.request.urlopen(f"http://{proc.metrics}/status.json", timeout=10) as r:
            server = json.loads(r.read())["server"]
        assert server["node"] == "data-7"  # store.node, as the fleet's heartbeats name it
        assert server["host"] == socket.gethostname()
        assert server["version"] == importlib.metadata.version("tokenfeed")
        assert 0 < server["uptime_seconds"] < 300
        assert abs(server["started"] + server["uptime_seconds"] - time.time()) < 5
    finally:
        assert proc.stop() == 0, proc.log()


def test_health_serves_only_once_built_and_not_while_draining(tmp_path, corpus, faults, s3_bucket):
    client = s3_client(faults.endpoint)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"c/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=s3_bucket, Key="tokenizer.json", Body=TOKENIZER.read_bytes())
    faults.set_faults(1.0, ("delay",), key_filter="/c/", delay_seconds=0.1)  # a slow build
    spec = job_spec([f"s3://{s3_bucket}/c/*"], tokenizer=f"s3://{s3_bucket}/tokenizer.json")
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": spec},
        tmp_path / "cache",
        object_store={"endpoint_url": faults.endpoint, "addressing_style": "path"},
        grace_seconds=5,
    )
    proc = ServerProcess(cfg, tmp_path / "server.log")
    channel = grpc.insecure_channel(proc.address)
    health = health_pb2_grpc.HealthStub(channel)

    def status() -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    try:
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        faults.clear_faults()
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY"
        deadline = time.monotonic() + 10
        while status() != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # An open stream keeps the server draining for its grace period.
        got, seen = [], threading.Event()

        def consume() -> None:
            with proc.client("main") as c:
                try:
                    for batch in c.iter_batches(0, 10**6):
                        got.append(batch)
                        seen.set()
                        time.sleep(0.05)
                except client_errors.TokenfeedClientError:
                    pass

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        assert seen.wait(30)
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # NOT_SERVING, or (once the port stops taking new calls) no answer at all
            try:
                if status() == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), e
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        streamed = len(got)
        time.sleep(0.5)
        assert len(got) > streamed, "the open stream goes on while the server drains"
        assert proc.proc.wait(timeout=30) == 0, proc.log()
    finally:
        channel.close()
        proc.stop()
