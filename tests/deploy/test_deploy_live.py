"""The compose stack's parts, run for real on loopback (no Docker engine here).

An S3-compatible server (moto) stands in for MinIO. The compose seed script fills it; a
`tokenfeed serve` process runs the compose server config (only its addresses and cache path
changed to loopback and a temporary directory); Prometheus runs the deploy scrape config and
rules against the server's metrics port. Then: the health checks of the Dockerfile and of
compose, the trainer commands of compose and of the sidecar Job, every dashboard query and
every rule, all against those real processes.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import boto3
import pytest
import yaml
from deploy_support import (
    DASHBOARD,
    DEPLOY,
    RULES,
    SERVER_DOCKERFILE,
    compose_config,
    dashboard_queries,
    manifest,
    parse_dockerfile,
    promql_names,
    tool,
)
from tokenfeed.client import Client
from tokenfeed.server.settings import config as configmod

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tokenfeed",
    "AWS_SECRET_ACCESS_KEY": "tokenfeed-demo-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
COMPOSE_CONFIG = DEPLOY / "compose" / "tokenfeed.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, what: str, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def seeded(s3):
    """The compose seed job, run as compose runs it (its own argument list)."""
    spec = importlib.util.spec_from_file_location("seed", DEPLOY / "compose" / "seed.py")
    seed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed)
    args = list(compose_config()["services"]["seed"]["command"])
    args[args.index("--endpoint-url") + 1] = s3
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        assert seed.main(args) == 0
    client = boto3.client("s3", endpoint_url=s3, **_boto_credentials())
    bucket = args[args.index("--bucket") + 1]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    return bucket, keys


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


class Process:
    def __init__(self, cmd: list, log: Path, env: dict | None = None):
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(c) for c in cmd], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3, seeded):
    """`tokenfeed serve` on the compose config, reading the seeded bucket."""
    tmp = tmp_path_factory.mktemp("tokenfeed")
    raw = yaml.safe_load(COMPOSE_CONFIG.read_text())
    raw["server"].update(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", cache_dir=str(tmp / "cache")
    )
    raw["object_store"]["endpoint_url"] = s3
    config = tmp / "tokenfeed.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    ready = tmp / "ready.json"
    env = {**os.environ, **CREDENTIALS, "PYTHONUNBUFFERED": "1"}
    proc = Process(
        [
            sys.executable,
            "-m",
            "tokenfeed.server.commands.cli",
            "serve",
            "--config",
            config,
            "--ready-file",
            ready,
        ],
        tmp / "server.log",
        env,
    )
    _wait(lambda: ready.exists() or proc.proc.poll() is not None, "the server to start", 60)
    assert proc.proc.poll() is None, proc.log()
    info = json.loads(ready.read_text())
    info["process"] = proc
    _wait(lambda: _health(info["address"]) == "SERVING", "health SERVING (index built)", 120)
    yield info
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module", autouse=True)
def prometheus_process(tmp_path_factory):
    """Prometheus with the deploy scrape config and rules, scraping every second. Started
    first: it applies new targets only every 5 s, so it waits while the rest starts. The
    target (the server's metrics port, known later) comes through a file_sd file."""
    tmp = tmp_path_factory.mktemp("prometheus")
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(RULES)]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "tokenfeed"]
    job["scrape_interval"] = "1s"
    del job["static_configs"]
    targets = tmp / "targets.json"
    targets.write_text("[]")
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    cfg["scrape_configs"] = [job]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = _free_port()
    proc = Process(
        [
            tool("bin/prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        tmp / "prometheus.log",
    )
    yield f"http://127.0.0.1:{port}", targets, proc
    proc.stop()


@pytest.fixture(scope="module")
def prometheus(prometheus_process, server):
    url, targets, proc = prometheus_process
    tmp = targets.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": [server["metrics"]]}]))
    tmp.replace(targets)

    def ready():
        assert proc.proc.poll() is None, proc.log()
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    _wait(ready, "Prometheus to start")
    # two scrapes: rate() needs two samples
    _wait(lambda: _query(url, 'count_over_time(up{job="tokenfeed"}[1m]) >= 2'), "two scrapes")
    return url


def _health(address: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service="tokenfeed.v1.TokenFeed")
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _query(url: str, expr: str) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _pull(address: str, steps: int) -> int:
    with Client(address, job="demo", timeout=120) as feed:
        return sum(b["input_ids"].size for b in feed.iter_batches(0, steps, rank=0, world_size=1))


# ---------------------------------------------------------------- seed and server


def test_seed_uploads_what_the_compose_config_reads(seeded):
    bucket, keys = seeded
    cfg = configmod.load(COMPOSE_CONFIG)
    (job,) = cfg.jobs
    assert job.tokenizer.path == f"s3://{bucket}/tokenizer.json" and "tokenizer.json" in keys
    for source in job.datasets[0].sources:
        pattern = source.pattern.removeprefix(f"s3://{bucket}/")
        assert fnmatch.filter(keys, pattern), f"{source.pattern} matches no seeded object"


def test_compose_config_serves_batches_from_object_storage(server):
    cfg = configmod.load(COMPOSE_CONFIG)
    (job,) = cfg.jobs
    with Client(server["address"], job=job.name, timeout=120) as feed:
        batch = feed.get_batch(0, rank=0, world_size=1)
        assert batch["input_ids"].shape == (job.global_batch_size, job.seq_len)
        assert feed.describe()["num_chunks"] > job.window_chunks


# ---------------------------------------------------------------- health checks and clients


def _python(args: list[str]) -> list[str]:
    assert args[0] == "python"
    return [sys.executable, *args[1:]]


def test_dockerfile_healthcheck(server):
    (health,) = parse_dockerfile(SERVER_DOCKERFILE).final("HEALTHCHECK")
    cmd = _python(health.json_args())
    env = {**os.environ, "TOKENFEED_HEALTH_TARGET": server["address"]}
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    env["TOKENFEED_HEALTH_TARGET"] = f"127.0.0.1:{_free_port()}"  # nobody there
    down = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert down.returncode != 0


def test_compose_healthcheck(server):
    test = compose_config()["services"]["tokenfeed"]["healthcheck"]["test"]
    assert test[0] == "CMD" and "127.0.0.1:50051" in test[-1]
    cmd = _python(test[1:])
    cmd[-1] = cmd[-1].replace("127.0.0.1:50051", server["address"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_compose_trainer_command(server):
    trainer = compose_config("trainer")["services"]["trainer"]
    (entrypoint,) = parse_dockerfile(SERVER_DOCKERFILE.with_name("client.Dockerfile")).final(
        "ENTRYPOINT"
    )
    cmd = _python(entrypoint.json_args() + trainer["command"])
    assert "tokenfeed:50051" in cmd[-1]
    cmd[-1] = cmd[-1].replace("tokenfeed:50051", server["address"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pulled 1638400 tokens in 200 steps" in proc.stdout  # 200 x 16 rows x 512


def test_sidecar_trainer_script(server):
    (trainer,) = manifest("Job", "sidecar")["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, **{e["name"]: e["value"] for e in trainer["env"]}}
    # this pod is rank 1 of 2, talking to "its" server; the test server's job is "demo"
    env.update(
        TOKENFEED_TARGET=server["address"],
        TOKENFEED_JOB="demo",
        STEPS="20",
        JOB_COMPLETION_INDEX="1",
    )
    cmd = _python(trainer["command"] + trainer["args"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1/2: 20 steps" in proc.stdout


# ---------------------------------------------------------------- Prometheus on real data


def test_scrape_keeps_the_per_job_label_apart_from_the_scrape_job(prometheus):
    (up,) = _query(prometheus, 'up{job="tokenfeed"}')
    assert up["value"][1] == "1"
    ready = _query(prometheus, "tokenfeed_job_ready")
    assert [r["metric"]["tokenfeed_job"] for r in ready] == ["demo"]
    assert ready[0]["metric"]["job"] == "tokenfeed"
    assert _query(prometheus, '{exported_job!=""}') == []


def test_every_dashboard_query_runs_and_shows_data(prometheus, server):
    _pull(server["address"], 50)
    names = set(_wait(lambda: _label_values(prometheus), "metric names"))
    empty = []
    for where, expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        expr = expr.replace("$instance", ".*").replace("$tokenfeed_job", ".*")
        result = _query(prometheus, expr)  # fails on any error Prometheus reports
        if not result and promql_names(expr).metrics <= names:
            empty.append(f"{where}: {expr}")
    assert empty == [], "queries over exported metrics that return nothing"


def _label_values(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/api/v1/label/__name__/values", timeout=10) as r:
        return json.loads(r.read())["data"]


def test_rules_evaluate_without_errors(prometheus, server):
    def evaluated():
        with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10) as r:
            groups = json.loads(r.read())["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        return rules if all(rule["health"] != "unknown" for rule in rules) else None

    rules = _wait(evaluated, "every rule to be evaluated")
    names = {r["name"] for r in rules}
    expected = yaml.safe_load(RULES.read_text())["groups"]
    assert names == {r.get("record") or r["alert"] for g in expected for r in g["rules"]}
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert bad == {}
    # a healthy server fires nothing but, at most, the informational alert
    firing = {r["name"] for r in rules if r.get("state") == "firing"}
    assert firing <= {"TokenfeedBadRecords"}


def test_recording_rules_see_the_served_tokens(prometheus, server):
    _pull(server["address"], 50)
    expr = 'tokenfeed_job:tokenfeed_served_tokens:rate5m{tokenfeed_job="demo"} > 0'
    (sample,) = _wait(
        lambda: (_pull(server["address"], 5), _query(prometheus, expr))[1],
        "tokenfeed_job:tokenfeed_served_tokens:rate5m > 0",
        interval=0.5,
    )
    assert float(sample["value"][1]) > 0
