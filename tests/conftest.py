"""Shared fixtures: a real-text corpus on disk in every source format, and running servers."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from s3env import fault_proxy, faults, moto_server, s3_bucket  # noqa: F401
from support import ServerProcess, job_spec, write_config, write_jsonl
from tokenfeed.server.commands import democorpus


@pytest.fixture(scope="session")
def texts() -> list[str]:
    """About 300 KB of real English prose: documents from Python's own documentation."""
    return democorpus.documents()[:400]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, texts) -> Path:
    """The texts split over plain JSONL, JSONL.zst and a Parquet file with 3 row groups."""
    root = tmp_path_factory.mktemp("corpus")
    a, b = len(texts) * 6 // 10, len(texts) * 8 // 10
    write_jsonl(root / "part-0.jsonl", texts[:a])
    plain = write_jsonl(root / "tmp.jsonl", texts[a:b])
    (root / "part-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    plain.unlink()
    rest = texts[b:]
    pq.write_table(
        pa.table({"text": rest}), root / "part-2.parquet", row_group_size=len(rest) // 3 + 1
    )
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, corpus):
    """One server with job `main` over the corpus, index built."""
    tmp = tmp_path_factory.mktemp("server")
    cfg = write_config(tmp / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    info = proc.wait_ready("main")
    assert info["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0, proc.log()
