"""Test support: real server processes on loopback ports, configs and corpora on disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from tokenfeed.client import Client

DATA = Path(__file__).parent / "data"
TOKENIZER = DATA / "tokenizer.json"


def write_config(
    path: Path, jobs: dict[str, dict], cache_dir: Path, object_store: dict | None = None, **server
) -> Path:
    raw = {
        "server": {"listen": "127.0.0.1:0", "cache_dir": str(cache_dir), **server},
        "jobs": jobs,
    }
    if object_store is not None:
        raw["object_store"] = object_store
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def job_spec(sources, **overrides) -> dict:
    spec = {
        "sources": [str(s) for s in sources],
        "tokenizer": str(TOKENIZER),
        "seq_len": 64,
        "global_batch_size": 8,
        "seed": 11,
        "chunk_bytes": "16KiB",
        "window_chunks": 3,
    }
    spec.update(overrides)
    return spec


def built_job(cache: Path, spec: dict, name: str = "j"):
    """A job of `spec` in this process (no server), its index built into `cache`: READY."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from tokenfeed.server.jobs.stack import build_jobs
    from tokenfeed.server.settings import config as configmod

    raw = {"server": {"cache_dir": str(cache)}, "jobs": {name: spec}}
    job = build_jobs(configmod.from_dict(raw))[name]
    with ThreadPoolExecutor(2) as pool:
        asyncio.run(job.build_index(pool, 2, retry=False))
    assert job.state == "ready", job.error
    return job


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def mixture_job(tmp: Path, texts: list[str], name: str = "mix"):
    """Two datasets (3:1, then 1:3 from step 20, 16 rows a step from step 40), built."""
    web = write_jsonl(tmp / "web.jsonl", texts[:250])
    books = write_jsonl(tmp / "books.jsonl", texts[250:330])
    spec = job_spec([])
    del spec["sources"]
    spec["datasets"] = {
        "web": {"sources": [str(web)], "weight": 3},
        "books": {"sources": [str(books)], "weight": 1},
    }
    spec["schedule"] = [
        {"start_step": 20, "weights": {"books": 3}},
        {"start_step": 40, "global_batch_size": 16},
    ]
    return built_job(tmp / "cache", spec, name)


class ServerProcess:
    """`tokenfeed serve` in a child process; `address` once it listens."""

    def __init__(self, config: Path, log_path: Path, *extra: str):
        self.ready = config.with_suffix(f".ready.{time.monotonic_ns()}.json")
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "tokenfeed.server.commands.cli",
            "serve",
            "--config",
            str(config),
            "--ready-file",
            str(self.ready),
            *extra,
        ]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # The S3-compatible test server takes any credentials; boto3 finds these in its chain.
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start:\n{self.log()}")
            time.sleep(0.02)
        ready = json.loads(self.ready.read_text())
        self.address, self.metrics = ready["address"], ready.get("metrics", "")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, job: str | None = None, **kw) -> Client:
        return Client(self.address, job=job, **kw)

    def wait_ready(self, job: str, timeout: float = 60) -> dict:
        with self.client(job) as c:
            deadline = time.monotonic() + timeout
            while True:
                info = c.describe()
                if info["state"] != "JOB_STATE_INDEXING" or time.monotonic() > deadline:
                    return info
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """A real scrape of a server's metrics port: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def batch_bytes(batch) -> dict[str, bytes]:
    return {name: arr.tobytes() for name, arr in batch.items()}


class FleetProcesses:
    """N servers of one config, each with its own cache directory, as a fleet target."""

    def __init__(self, tmp: Path, jobs: dict[str, dict], n: int, **server):
        self.servers: list[ServerProcess] = []
        for i in range(n):
            cfg = write_config(tmp / f"fleet{i}.yaml", jobs, tmp / f"cache{i}", **server)
            self.servers.append(ServerProcess(cfg, tmp / f"fleet{i}.log"))
        for s in self.servers:
            for job in jobs:
                assert s.wait_ready(job)["state"] == "JOB_STATE_READY", s.log()

    @property
    def target(self) -> str:
        return ",".join(s.address for s in self.servers)

    def by_address(self, address: str) -> ServerProcess:
        return next(s for s in self.servers if s.address == address)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def workers_server(tmp: Path, corpus: Path, **server) -> ServerProcess:
    """A server of two serving workers (`server.workers: 2`, metrics on) of one job, "main",
    over the corpus, ready; `server` adds server options."""
    cfg = write_config(
        tmp / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp / "cache",
        metrics_listen="127.0.0.1:0",
        workers=2,
        **server,
    )
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    return proc
