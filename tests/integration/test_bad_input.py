"""Bad records are counted, located and skipped (or refused under `strict`); bad requests get
the right status with a message that says what to fix; nothing crashes the server."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import InvalidRequest, JobFailed, JobNotFound
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

GOOD = "The quick brown fox jumps over the lazy dog. " * 8


def _bad_corpus(root):
    """Line by line: which lines are bad and why."""
    lines = [
        json.dumps({"text": GOOD + "one"}).encode(),  # 1 good
        b'{"text": "unterminated',  # 2 malformed_json
        json.dumps({"body": "no text field"}).encode(),  # 3 missing_field
        b'{"text": "caf\xe9 latin-1 bytes"}',  # 4 invalid_utf8
        json.dumps({"text": ""}).encode(),  # 5 empty
        json.dumps({"text": GOOD + "two"}).encode(),  # 6 good
        json.dumps({"text": 42}).encode(),  # 7 not_text
        json.dumps(["a", "list"]).encode(),  # 8 not_an_object
        b"",  # 9 empty (blank line)
    ] + [json.dumps({"text": GOOD + str(i)}).encode() for i in range(40)]
    path = root / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


EXPECTED = {
    "malformed_json": 2,
    "missing_field": 3,
    "invalid_utf8": 4,
    "empty": 5,
    "not_text": 7,
    "not_an_object": 8,
}


@pytest.fixture(scope="module")
def bad_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    path = _bad_corpus(tmp)
    jobs = {
        "skip": job_spec([path], seq_len=32, chunk_bytes="1KiB"),
        "strict": job_spec([path], seq_len=32, chunk_bytes="1KiB", bad_records="strict"),
    }
    proc = ServerProcess(write_config(tmp / "tf.yaml", jobs, tmp / "cache"), tmp / "log.txt")
    for job in jobs:
        proc.wait_ready(job)
    yield proc, path
    assert proc.stop() == 0, proc.log()


def test_skip_policy_serves_and_counts_each_bad_record(bad_server):
    proc, path = bad_server
    with proc.client("skip") as c:
        info = c.describe()
        assert info["state"] == "JOB_STATE_READY"
        counts = {b["reason"]: int(b["count"]) for b in info["bad_records"]}
        assert counts == {
            "malformed_json": 1,
            "missing_field": 1,
            "invalid_utf8": 1,
            "empty": 2,
            "not_text": 1,
            "not_an_object": 1,
        }
        assert int(info["num_documents"]) == 42
        assert c.get_batch(0)["input_ids"].shape == (8, 32)
    log = proc.log()
    for reason, line in EXPECTED.items():
        assert f"{path}:{line}: {reason}" in log, (reason, line)
    assert f"{path}:9: empty" in log


def test_strict_policy_refuses_with_the_location(bad_server):
    proc, path = bad_server
    with proc.client("strict") as c:
        info = c.describe()
        assert info["state"] == "JOB_STATE_FAILED"
        assert f"{path}:2" in info["error"] and "strict" in info["error"]
        with pytest.raises(JobFailed) as err:
            c.get_batch(0)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{path}:2: malformed_json" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"step": -1}, InvalidRequest, "step must be in"),
        ({"step": 0, "rank": 2, "world_size": 2}, InvalidRequest, "rank must be in [0, 2)"),
        ({"step": 0, "rank": -1, "world_size": 2}, InvalidRequest, "rank must be in"),
        ({"step": 0, "world_size": 3}, InvalidRequest, "valid world sizes: [1, 2, 4, 8]"),
        ({"step": 0, "world_size": -4}, InvalidRequest, "world_size must be in [1, 2**31)"),
        ({"step": 0, "world_size": 2**40}, InvalidRequest, "world_size must be in [1, 2**31)"),
        ({"step": 0, "rank": 2**33, "world_size": 8}, InvalidRequest, "rank must be in [0, 8)"),
        ({"step": 2**62}, InvalidRequest, "step must be in"),
        ({"step": 0, "job": "nope"}, JobNotFound, "unknown job 'nope'"),
    ],
)
def test_invalid_requests_get_a_status_that_says_what_to_fix(bad_server, kwargs, error, words):
    proc, _ = bad_server
    with proc.client("skip") as c:
        with pytest.raises(error) as err:
            c.get_batch(**kwargs)
        assert words in str(err.value)


def test_invalid_stream_request_and_server_still_healthy(bad_server):
    proc, _ = bad_server
    with proc.client("skip") as c:
        with pytest.raises(InvalidRequest, match="valid world sizes"):
            list(c.iter_batches(0, 2, world_size=5))
    with grpc.insecure_channel(proc.address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        request = pb.StreamBatchesRequest(job="skip", start_step=5, end_step=3)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamBatches(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "end_step 3 must be after start_step 5" in err.value.details()
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="tokenfeed.v1.TokenFeed"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert proc.proc.poll() is None


def test_corpus_smaller_than_a_row_fails_the_job_clearly(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "tiny"}) + "\n")
    cfg = write_config(
        tmp_path / "tf.yaml", {"tiny": job_spec([path], seq_len=4096)}, tmp_path / "cache"
    )
    proc = ServerProcess(cfg, tmp_path / "log.txt")
    try:
        info = proc.wait_ready("tiny")
        assert info["state"] == "JOB_STATE_FAILED"
        assert "no row of seq_len 4096" in info["error"]
        with proc.client("tiny") as c, pytest.raises(JobFailed, match="lower seq_len"):
            c.get_batch(0)
    finally:
        assert proc.stop() == 0


def test_one_broken_job_does_not_stop_the_others(tmp_path, corpus):
    jobs = {
        "good": job_spec([corpus / "*"]),
        "nothing": job_spec([tmp_path / "missing-*.jsonl"]),
    }
    proc = ServerProcess(write_config(tmp_path / "tf.yaml", jobs, tmp_path / "c"), tmp_path / "l")
    try:
        assert proc.wait_ready("good")["state"] == "JOB_STATE_READY"
        info = proc.wait_ready("nothing")
        assert info["state"] == "JOB_STATE_FAILED"
        assert "missing-*.jsonl" in info["error"] and "matched no objects" in info["error"]
        with proc.client("nothing") as c, pytest.raises(JobFailed, match="matched no objects"):
            c.get_batch(0)
        with proc.client("good") as c:
            assert c.get_batch(0)["input_ids"].shape == (8, 64)
    finally:
        assert proc.stop() == 0
