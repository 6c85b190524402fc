"""Serving from a real S3-compatible server on loopback, through a fault-injecting proxy, with a
disk cache under a byte budget. Every batch is compared with the batch served from the same
corpus on local files."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from s3env import s3_client
from support import (
    TOKENIZER,
    ServerProcess,
    batch_bytes,
    job_spec,
    metric,
    scrape,
    write_config,
)
from tokenfeed.client import errors as client_errors
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

# Every 8th step of the first epoch of the test corpus (330 steps of 8 rows of 64 tokens), the
# last steps before and the first after the epoch boundary, and a few of the second epoch.
STEPS = [*range(0, 330, 8), 328, 329, 330, 331, 400, 555]


@pytest.fixture(scope="module")
def local_batches(tmp_path_factory, corpus) -> dict[int, dict[str, bytes]]:
    """STEPS of job `main` over the corpus on local files: the reference."""
    tmp = tmp_path_factory.mktemp("local")
    cfg = write_config(tmp / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    try:
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("main") as c:
            assert c.describe()["steps_per_epoch"] == 330  # STEPS assumes it
            return {s: batch_bytes(c.get_batch(s)) for s in STEPS}
    finally:
        assert proc.stop() == 0, proc.log()


def upload(endpoint: str, bucket: str, corpus: Path) -> None:
    client = s3_client(endpoint)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=bucket, Key=f"corpus/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="tok/tokenizer.json", Body=TOKENIZER.read_bytes())


def s3_server(
    tmp: Path,
    endpoint: str,
    bucket: str,
    *,
    cache_dir: Path | None = None,
    read_timeout: float = 60.0,
    **server,
) -> ServerProcess:
    spec = job_spec([f"s3://{bucket}/corpus/*"], tokenizer=f"s3://{bucket}/tok/tokenizer.json")
    object_store = {
        "endpoint_url": endpoint,
        "addressing_style": "path",
        "block_bytes": "4KiB",
        "max_attempts": 12,
        "backoff_base_seconds": 0.01,
        "backoff_max_seconds": 0.2,
        "read_timeout_seconds": read_timeout,
    }
    server.setdefault("metrics_listen", "127.0.0.1:0")
    cfg = write_config(
        tmp / "tf.yaml",
        {"main": spec},
        cache_dir or tmp / "cache",
        object_store=object_store,
        **server,
    )
    return ServerProcess(cfg, tmp / f"server.{time.monotonic_ns()}.log")


def fetch_all(proc: ServerProcess, steps=STEPS) -> dict[int, dict[str, bytes]]:
    with proc.client("main", timeout=60) as c:
        return {s: batch_bytes(c.get_batch(s)) for s in steps}


def dir_bytes(root: Path) -> int:
    """Bytes of the files under root, each inode once: a directory listing that races a rename
    can show one file under its temporary and its final name. The owner's lock file (its pid,
    a few bytes) is not cache content."""
    sizes = {}
    for p in root.rglob("*"):
        if p.name == ".lock" and p.parent == root:
            continue
        try:
            st = p.stat()
        except FileNotFoundError:  # renamed or evicted between listing and stat
            continue
        if p.is_file():
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


@contextlib.contextmanager
def frozen(pid: int):
    """The process stopped (SIGSTOP, and seen stopped in /proc) for the duration."""
    os.kill(pid, signal.SIGSTOP)
    try:
        stat = Path(f"/proc/{pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z"):
            time.sleep(0.0005)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_faults_on_a_fifth_of_requests_change_no_byte(
    tmp_path, corpus, faults, s3_bucket, local_batches
):
    upload(faults.endpoint, s3_bucket, corpus)
    # A delay longer than the read timeout: the request times out and is retried.
    faults.set_faults(
        0.2,
        ("503", "500", "429", "reset", "truncate", "delay"),
        seed=7,
        methods=("GET", "HEAD"),
        delay_seconds=1.0,
    )
    proc = s3_server(tmp_path, faults.endpoint, s3_bucket, read_timeout=0.3)
    try:
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
        assert fetch_all(proc) == local_batches
        injected = faults.stats()["faults"]
        assert set(injected) == {"503", "500", "429", "reset", "truncate", "delay"}, injected
        samples = scrape(proc.metrics)
        reasons = {
            dict(ls).get("reason")
            for (n, ls), v in samples.items()
            if n == "tokenfeed_object_store_retries_total" and v > 0
        }
        assert {"short_body", "throttled", "server_error", "reset", "timeout"} <= reasons, reasons
        # Every fault the proxy injected was seen and retried by tokenfeed itself.
        retried = metric(samples, "tokenfeed_object_store_retries_total")
        assert retried == sum(injected.values()), (retried, injected)
        assert metric(samples, "tokenfeed_object_store_retries_total", reason="throttled") > 0
        assert metric(samples, "tokenfeed_object_store_errors_total") == 0
        assert metric(samples, "tokenfeed_object_store_requests_total", op="get", outcome="ok")
    finally:
        assert proc.stop() == 0, proc.log()


def test_cache_stays_under_its_budget_and_evicts(
    tmp_path, corpus, faults, s3_bucket, local_batches
):
    upload(faults.endpoint, s3_bucket, corpus)
    # Above the job's working set (a window of token chunks plus the raw data of two chunks
    # tokenized at once), below the corpus's token chunks and raw blocks together.
    budget = 300 * 1024
    cache = tmp_path / "cache"
    peak, samples_taken, stop = [0], [0], threading.Event()
    proc = s3_server(
        tmp_path, faults.endpoint, s3_bucket, cache_dir=cache, cache_bytes=budget, prefetch_steps=2
    )

    def watch() -> None:
        # A directory walk is not atomic: files evicted early in a walk and written late in it
        # would both be counted. Freezing the server makes each sample a true snapshot.
        while not stop.is_set() and proc.proc.poll() is None:
            with frozen(proc.proc.pid):
                peak[0] = max(peak[0], dir_bytes(cache))
            samples_taken[0] += 1
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
        assert fetch_all(proc) == local_batches
        samples = scrape(proc.metrics)
    finally:
        stop.set()
        watcher.join()
        assert proc.stop() == 0, proc.log()
    assert samples_taken[0] > 20
    assert 0 < peak[0] <= budget
    assert metric(samples, "tokenfeed_cache_evictions_total", kind="chunk") > 0
    assert metric(samples, "tokenfeed_cache_evictions_total", kind="block") > 0
    assert metric(samples, "tokenfeed_cache_bytes") <= budget
    # Evicted bodies were rebuilt from the manifests' index, not the whole corpus re-planned.
    assert metric(samples, "tokenfeed_cache_misses_total", kind="chunk") > 0


def test_kill_9_while_downloading_then_restart_on_the_same_cache(
    tmp_path, corpus, faults, s3_bucket, local_batches
):
    upload(faults.endpoint, s3_bucket, corpus)
    faults.set_faults(1.0, ("delay",), delay_seconds=0.15)  # slow enough to be caught mid-build
    cache = tmp_path / "cache"
    proc = s3_server(tmp_path, faults.endpoint, s3_bucket, cache_dir=cache)
    deadline = time.monotonic() + 60
    while not list((cache / "tokens").rglob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    with proc.client("main") as c:
        info = c.describe()
    assert 0 < info["chunks_indexed"] < info["num_chunks"], info
    proc.kill()
    kept = len(list((cache / "tokens").rglob("*.json")))

    faults.clear_faults()
    again = s3_server(tmp_path, faults.endpoint, s3_bucket, cache_dir=cache)
    try:
        final = again.wait_ready("main", timeout=120)
        assert final["state"] == "JOB_STATE_READY", again.log()
        assert list(cache.rglob("*.tmp")) == []
        assert fetch_all(again) == local_batches
        samples = scrape(again.metrics)
    finally:
        assert again.stop() == 0, again.log()
    # The restart kept the finished chunks and tokenized only the rest.
    redone = metric(samples, "tokenfeed_tokenized_documents_total", tokenfeed_job="main")
    assert 0 < redone < final["num_documents"], (redone, final["num_documents"])
    total = info["num_chunks"]
    rebuilt = len(list((cache / "tokens").rglob("*.json"))) - kept
    assert kept > 0 and rebuilt == total - kept


def test_an_object_rewritten_mid_job_fails_the_job_naming_it(tmp_path, corpus, faults, s3_bucket):
    upload(faults.endpoint, s3_bucket, corpus)
    target = "corpus/part-1.jsonl.zst"
    # Reads of the target are held back until after it has been rewritten.
    faults.set_faults(1.0, ("delay",), key_filter=target, delay_seconds=1.0)
    proc = s3_server(tmp_path, faults.endpoint, s3_bucket)
    try:
        with proc.client("main") as c:
            deadline = time.monotonic() + 30
            while c.describe()["num_chunks"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)  # listed: every object's ETag is pinned
            s3_client(faults.endpoint).put_object(
                Bucket=s3_bucket, Key=target, Body=b'{"text": "rewritten"}\n'
            )
            info = proc.wait_ready("main", timeout=60)
            assert info["state"] == "JOB_STATE_FAILED", info
            assert f"s3://{s3_bucket}/{target}" in info["error"] and "changed" in info["error"]
            with pytest.raises(client_errors.JobFailed) as e:
                c.get_batch(0)
            assert target in str(e.value)
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_budget_below_the_working_set_is_refused_with_the_bytes_needed(
    tmp_path, corpus, faults, s3_bucket
):
    upload(faults.endpoint, s3_bucket, corpus)
    # Below what two chunks tokenized at once need: refused at start.
    with pytest.raises(RuntimeError, match=r"server.cache_bytes.*needs at least \d+ bytes"):
        s3_server(tmp_path, faults.endpoint, s3_bucket, cache_bytes="40KiB")
    # Enough to tokenize, not enough for a window of token chunks: the job is refused.
    proc = s3_server(tmp_path, faults.endpoint, s3_bucket, cache_bytes="60KiB")
    try:
        info = proc.wait_ready("main", timeout=120)
        assert info["state"] == "JOB_STATE_FAILED", info
        assert "working set of job main" in info["error"] and "needs at least" in info["error"]
        with proc.client("main") as c, pytest.raises(client_errors.JobFailed):
            c.get_batch(0)
    finally:
        assert proc.stop() == 0, proc.log()


def test_unreachable_object_store_is_unavailable_not_failed(tmp_path, corpus, faults, s3_bucket):
    upload(faults.endpoint, s3_bucket, corpus)
    faults.set_faults(1.0, ("503",), methods=("GET",), key_filter="corpus/")
    proc = s3_server(tmp_path, faults.endpoint, s3_bucket)
    try:
        time.sleep(1.0)
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.TokenFeedStub(channel)
            assert stub.DescribeJob(pb.DescribeJobRequest(job="main")).state == (
                pb.JOB_STATE_INDEXING
            )
            with pytest.raises(grpc.RpcError) as e:
                stub.GetBatch(pb.GetBatchRequest(job="main", step=0, world_size=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "failed 12 times" in e.value.details() and "SlowDown" in e.value.details()
        faults.clear_faults()  # the store recovers: the build goes on by itself
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    finally:
        assert proc.stop() == 0, proc.log()
