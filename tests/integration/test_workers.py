"""Several serving processes on one port (server.workers): a supervisor owns the cache, the
workers serve. The same bytes as one process; a worker killed with SIGKILL is replaced while
the client carries on; no chunk is tokenized twice; the cache stays under its budget; one
metrics endpoint counts every worker's requests; SIGTERM drains them all."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from support import ServerProcess, job_spec, metric, scrape, workers_server, write_config
from tokenfeed.client import Client
from tokenfeed.server.pack import arenaformat
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

STEPS = 24


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _disk_bytes(root: Path) -> int:
    total = 0
    for p in root.rglob("*"):
        try:  # a temporary file may be renamed or removed meanwhile
            if p.is_file() and p.suffix != ".sock":
                total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("single")
    cfg = write_config(tmp / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
    with proc.client("main") as c:
        expected = [c.get_batch(s).fingerprint for s in range(STEPS)]
        world4 = [c.get_batch(7, r, 4).fingerprint for r in range(4)]
    assert proc.stop() == 0, proc.log()
    return expected, world4


def _worker_pids(proc: ServerProcess) -> list[int]:
    return json.loads(proc.ready.read_text())["workers"]


def test_two_workers_serve_the_bytes_of_one_process(tmp_path, corpus, single):
    expected, world4 = single
    proc = workers_server(tmp_path, corpus)
    try:
        pids = _worker_pids(proc)
        assert len(pids) == 2
        before = [_cpu_seconds(p) for p in pids]
        # Separate clients open separate connections, which the kernel spreads over workers.
        clients = [Client(proc.address, job="main") for _ in range(8)]
        for c in clients:
            assert [c.get_batch(s).fingerprint for s in range(STEPS)] == expected
        assert [clients[0].get_batch(7, r, 4).fingerprint for r in range(4)] == world4
        streamed = [b.fingerprint for b in clients[1].iter_batches(0, STEPS)]
        assert streamed == expected
        # Both workers serve: more connections until each one's CPU time has moved (the
        # kernel's spread is random, and CPU time is counted in 10 ms ticks).
        extra = []
        while not all(a > b for a, b in zip([_cpu_seconds(p) for p in pids], before, strict=True)):
            assert len(extra) < 32, "a worker served nothing"
            # a channel of its own (grpc shares connections between channels otherwise)
            own = [("grpc.use_local_subchannel_pool", 1)]
            channel = grpc.insecure_channel(proc.address, options=own)
            extra.append(channel)
            stub = pb_grpc.TokenFeedStub(channel)
            for _ in range(4):
                stub.GetBatch(pb.GetBatchRequest(job="main", step=3), timeout=30)
        for c in extra:
            c.close()
        for c in clients:
            c.close()
        time.sleep(1.5)  # the workers send their counters every second
        samples = scrape(proc.metrics)
        assert metric(samples, "tokenfeed_serving") == 1  # the supervisor's, as one process's
        served = metric(samples, "tokenfeed_served_tokens_total", tokenfeed_job="main")
        # 8 clients x STEPS x 8 rows + 4 quarter batches + STEPS streamed, 64 tokens a row
        extra_calls = 4 * len(extra)
        assert served == (8 * STEPS * 8 + 8 + STEPS * 8 + extra_calls * 8) * 64
        assert metric(samples, "tokenfeed_requests_total", method="GetBatch", code="OK") == (
            8 * STEPS + 4 + extra_calls
        )
        # Only the supervisor tokenizes: every document once, whatever the workers read.
        with clients[0].__class__(proc.address, job="main") as c:
            docs = int(c.describe()["num_documents"])
        assert metric(samples, "tokenfeed_tokenized_documents_total", tokenfeed_job="main") == docs
        # Row buffers are laid out once for both workers: each by one process, into the node's
        # arena, the others read it (pack/sharedrows.py); none laid out twice. The ring did not
        # come round here: every buffer laid out has its entry.
        rows = arenaformat.node_dir(tmp_path / "cache")
        entries = [p for p in rows.rglob("*") if p.is_file() and p.parent != rows]
        laid_out = metric(samples, "tokenfeed_row_buffers_total", outcome="laid_out")
        assert laid_out == len(entries) > 0
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="mapped") > 0
        assert metric(samples, "tokenfeed_row_buffers_total", outcome="unshared") == 0
    finally:
        assert proc.stop() == 0, proc.log()
    log = proc.log()
    assert log.count("worker 0 stopped") == 1 and log.count("worker 1 stopped") == 1
    assert not rows.exists()  # removed with the server


def test_a_killed_worker_is_replaced_and_the_client_carries_on(tmp_path, corpus, single):
    expected, _ = single
    proc = workers_server(tmp_path, corpus)
    try:
        pids = _worker_pids(proc)
        with Client(proc.address, job="main") as c:
            got = [c.get_batch(s).fingerprint for s in range(5)]
            for pid in pids:  # whichever worker holds this connection dies
                os.kill(pid, signal.SIGKILL)
                got.append(c.get_batch(len(got)).fingerprint)
            got += [b.fingerprint for b in c.iter_batches(len(got), STEPS)]
        assert got == expected
        deadline = time.monotonic() + 30
        while proc.log().count("restarting it") < 2:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.1)
        with Client(proc.address, job="main") as c:  # the replacements serve too
            assert [c.get_batch(s).fingerprint for s in range(3)] == expected[:3]
    finally:
        assert proc.stop() == 0, proc.log()


def test_the_cache_stays_under_its_budget_with_twoworkers_server(tmp_path, corpus, single):
    expected, _ = single
    budget = 200 * 1024
    proc = workers_server(tmp_path, corpus, cache_bytes=budget)
    cache = tmp_path / "cache"
    try:
        peak = 0
        with Client(proc.address, job="main") as a, Client(proc.address, job="main") as b:
            info = a.describe()
            steps = int(info["steps_per_epoch"]) + 3  # a whole epoch: every chunk is read
            for s in range(steps):
                assert a.get_batch(s).fingerprint == b.get_batch(s).fingerprint
                if s < STEPS:
                    assert a.get_batch(s).fingerprint == expected[s]
                # A walk of the directory is not atomic: files written and evicted during it
                # may both be counted. Two walks in a row both overcounting would need churn
                # in both; a real excess shows in every walk.
                peak = max(peak, min(_disk_bytes(cache), _disk_bytes(cache)))
        assert peak <= budget, f"{peak} bytes on disk, budget {budget}"
        samples = scrape(proc.metrics)
        assert metric(samples, "tokenfeed_cache_bytes") <= budget
        # The budget was needed: the epoch read every chunk, whose bodies (evicted, or never
        # kept by Belady's bypass) are larger than the budget together.
        manifests = [json.loads(p.read_text()) for p in (cache / "tokens").glob("*/*.json")]
        bodies = sum(m["bin_bytes"] + m["idx_bytes"] + m["rec_bytes"] for m in manifests)
        assert bodies > budget, (bodies, budget)
    finally:
        assert proc.stop() == 0, proc.log()
