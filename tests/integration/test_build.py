"""`tokenfeed build`: the offline build on several processes, its progress line, resuming after
kill -9 with only unfinished chunks redone, and a server that then tokenizes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ServerProcess, batch_bytes, job_spec, metric, scrape, write_config

STEPS = [0, 3, 50, 200, 700]


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory, texts) -> Path:
    """About 2.4 MB of JSON Lines: long enough to interrupt a build midway."""
    root = tmp_path_factory.mktemp("big")
    for part in range(2):
        lines = [json.dumps({"text": f"{t}\n[copy {k}]"}) + "\n" for k in range(4) for t in texts]
        (root / f"part-{part}.jsonl").write_text("".join(lines))
    return root


def config(tmp: Path, corpus: Path, name: str, **server) -> Path:
    spec = job_spec([corpus / "*.jsonl"], chunk_bytes="24KiB")
    return write_config(tmp / f"{name}.yaml", {"main": spec}, tmp / f"cache-{name}", **server)


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
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def store_files(cache: Path) -> dict[str, bytes]:
    root = cache / "tokens"
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_build_resumes_after_kill_and_matches_an_uninterrupted_build(tmp_path, big_corpus):
    whole = build(config(tmp_path, big_corpus, "whole"), "--workers", "2")
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out
    # the first line of the build's own (after the config's warnings, e.g. a small chunk_bytes)
    first = next(line for line in out.splitlines() if line.startswith("job main: "))
    total = int(first.split(": ")[1].split(" chunks")[0])
    assert total > 60 and "0 already in the store" in first and "2 process(es)" in first, first
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress and all(w in progress[-1] for w in (" docs,", " tokens,", " MB/s", "ETA"))
    assert progress[-1].startswith(f"[100.0%] {total}/{total} chunks")
    assert f"tokenized {total} chunks, 0 were already in the store" in out

    cfg = config(tmp_path, big_corpus, "killed")
    tokens = tmp_path / "cache-killed" / "tokens"
    proc = build(cfg, "--workers", "1", start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tokens.glob("*/*.json"))) < total // 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its worker processes
    proc.wait()
    finished = len(list(tokens.glob("*/*.json")))
    assert 0 < finished < total

    again = build(cfg, "--workers", "2")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert f"{finished} already in the store" in out, out
    assert f"tokenized {total - finished} chunks, {finished} were already" in out, out
    assert store_files(tmp_path / "cache-killed") == store_files(tmp_path / "cache-whole")

    # A rerun of a complete build tokenizes nothing.
    rerun = build(cfg, "--workers", "1")
    out, _ = rerun.communicate(timeout=300)
    assert f"tokenized 0 chunks, {total} were already" in out, out


def test_a_server_on_a_built_store_tokenizes_nothing_and_serves_the_same_batches(
    tmp_path, big_corpus
):
    cold = ServerProcess(config(tmp_path, big_corpus, "cold"), tmp_path / "cold.log")
    try:
        assert cold.wait_ready("main", timeout=180)["state"] == "JOB_STATE_READY"
        with cold.client("main", timeout=60) as c:
            expected = {s: batch_bytes(c.get_batch(s)) for s in STEPS}
    finally:
        assert cold.stop() == 0, cold.log()

    # Built into a shared store directory; a server with an empty cache reads it.
    shared = tmp_path / "shared"
    cfg = config(tmp_path, big_corpus, "builder")
    cfg.write_text(cfg.read_text() + f"store:\n  uri: {shared}\n  node: builder\n")
    done = build(cfg)
    out, _ = done.communicate(timeout=300)
    assert done.returncode == 0, out
    # With a shared store the builder keeps manifests only: bodies live in the store.
    assert not list((tmp_path / "cache-builder" / "tokens").glob("*/*.bin"))
    assert list(shared.glob("chunks/*/*.bin"))

    served = config(tmp_path, big_corpus, "reader", metrics_listen="127.0.0.1:0")
    served.write_text(served.read_text() + f"store:\n  uri: {shared}\n  node: reader\n")
    proc = ServerProcess(served, tmp_path / "reader.log")
    try:
        assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY"
        with proc.client("main", timeout=60) as c:
            assert {s: batch_bytes(c.get_batch(s)) for s in STEPS} == expected
        samples = scrape(proc.metrics)
        assert metric(samples, "tokenfeed_tokenized_documents_total", tokenfeed_job="main") == 0
        assert metric(samples, "tokenfeed_shared_store_chunks_total", outcome="fetched") > 0
    finally:
        assert proc.stop() == 0, proc.log()
