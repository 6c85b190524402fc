"""A tokenizer in object storage that cannot be fetched fails its job only: the server starts,
its other jobs serve, the job answers UNAVAILABLE with the reason and is retried with backoff
until the store answers again; then it serves the same bytes as a job that never waited. A
tokenizer object that is not a tokenizer fails its job (FAILED_PRECONDITION), nothing else."""

from __future__ import annotations

import grpc
import pytest
from s3env import s3_client
from support import TOKENIZER, ServerProcess, job_spec, write_config
from tokenfeed.client import errors as client_errors


def test_an_unreachable_tokenizer_fails_its_job_only(tmp_path, corpus, faults, s3_bucket):
    client = s3_client(faults.endpoint)
    client.put_object(Bucket=s3_bucket, Key="tok/tokenizer.json", Body=TOKENIZER.read_bytes())
    client.put_object(Bucket=s3_bucket, Key="bad/tokenizer.json", Body=b"{not a tokenizer")
    # Every request for the tokenizer fails (listing and reading it), whatever is retried.
    faults.set_faults(1.0, ("503",), methods=("GET", "HEAD"), key_filter="tok/")
    jobs = {
        "local": job_spec([corpus / "*"]),
        "remote": job_spec([corpus / "*"], tokenizer=f"s3://{s3_bucket}/tok/tokenizer.json"),
        "broken": job_spec([corpus / "*"], tokenizer=f"s3://{s3_bucket}/bad/tokenizer.json"),
    }
    object_store = {
        "endpoint_url": faults.endpoint,
        "addressing_style": "path",
        "max_attempts": 2,
        "backoff_base_seconds": 0.01,
    }
    cfg = write_config(tmp_path / "tf.yaml", jobs, tmp_path / "cache", object_store=object_store)
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        assert proc.wait_ready("local")["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("local") as c:
            local = [c.get_batch(s).fingerprint for s in range(4)]
            broken = c.describe("broken")
            assert broken["state"] == "JOB_STATE_FAILED"
            assert "bad/tokenizer.json" in broken["error"], broken
            remote = c.describe("remote")
            assert remote["state"] == "JOB_STATE_INDEXING"
            assert "tok/tokenizer.json" in remote["error"] and "retrying" in remote["error"]
        with proc.client("remote") as c:
            with pytest.raises(client_errors.TokenfeedClientError) as unavailable:
                c.get_batch(0, timeout=5)
            assert unavailable.value.code == grpc.StatusCode.UNAVAILABLE, unavailable.value
            assert "tokenizer" in str(unavailable.value)
        faults.clear_faults()  # the store answers again: the next try loads it
        assert proc.wait_ready("remote", timeout=90)["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("remote") as c:
            assert [c.get_batch(s).fingerprint for s in range(4)] == local
        assert proc.proc.poll() is None
    finally:
        faults.clear_faults()
        assert proc.stop() == 0, proc.log()
    assert "retrying" in proc.log()
