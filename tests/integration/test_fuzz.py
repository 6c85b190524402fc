"""Fuzzing the gRPC surface with bytes: random, truncated and mutated valid requests to every
method, through a raw channel (the bytes go as they are). No call may end in UNKNOWN or
INTERNAL, every status is one that says what happened, and the server serves a correct batch
afterwards. Bounded in cases and in time."""

from __future__ import annotations

import random
import time
from collections import Counter

import grpc
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import Client
from tokenfeed.v1 import tokenfeed_pb2 as pb

CASES = 5000
SECONDS = 60.0
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def seeds() -> dict[str, list[bytes]]:
    get = [
        pb.GetBatchRequest(job="main", step=s, rank=r, world_size=w)
        for s, r, w in ((0, 0, 1), (5, 1, 2), (100, 3, 4), (2**40, 0, 8))
    ]
    return {
        "GetBatch": [m.SerializeToString() for m in get],
        "Explain": [m.SerializeToString() for m in get[:2]],
        "StreamBatches": [
            pb.StreamBatchesRequest(
                job="main", start_step=s, end_step=s + 2, rank=0, world_size=1
            ).SerializeToString()
            for s in (0, 9)
        ],
        "DescribeJob": [pb.DescribeJobRequest(job="main").SerializeToString()],
        "ListJobs": [pb.ListJobsRequest().SerializeToString()],
    }


def mutate(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0 or not data:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 1:
        return data[: rng.randrange(len(data))]
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(b))
        if kind == 2:
            b[i] = rng.randrange(256)
        elif kind == 3:
            b.insert(i, rng.randrange(256))
        else:
            b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def test_fuzzed_requests_never_crash_or_confuse_the_server(tmp_path, corpus):
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"main": job_spec([corpus / "*"])},
        tmp_path / "cache",
        max_wait_seconds=0.5,
    )
    proc = ServerProcess(cfg, tmp_path / "server.log")
    try:
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        with Client(proc.address, job="main") as c:
            want = c.get_batch(5).fingerprint
        rng, statuses, cases = random.Random(1234), Counter(), 0
        deadline = time.monotonic() + SECONDS
        with grpc.insecure_channel(proc.address) as channel:
            calls = {
                m: (channel.unary_stream if m == "StreamBatches" else channel.unary_unary)(
                    f"/tokenfeed.v1.TokenFeed/{m}"
                )
                for m in seeds()
            }
            corpus_of = seeds()
            while cases < CASES and time.monotonic() < deadline:
                method = rng.choice(sorted(corpus_of))
                data = mutate(rng, rng.choice(corpus_of[method]))
                try:
                    reply = calls[method](data, timeout=5)
                    if method == "StreamBatches":  # a mutated end_step may stream forever
                        for i, _ in enumerate(reply):
                            if i == 2:
                                reply.cancel()
                                break
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                    if code == grpc.StatusCode.CANCELLED:  # our own cancel, after 3 batches
                        code = grpc.StatusCode.OK
                statuses[code.name] += 1
                assert code in ALLOWED, (method, data, code, statuses)
                cases += 1
        summary = ", ".join(f"{k} {v}" for k, v in statuses.most_common())
        print(f"\n{cases} fuzz cases: {summary}")
        assert cases >= 500, f"only {cases} cases in {SECONDS}s"
        assert statuses["INVALID_ARGUMENT"] > 0  # malformed requests were among them
        assert proc.proc.poll() is None
        with Client(proc.address, job="main") as c:
            assert c.get_batch(5).fingerprint == want
    finally:
        assert proc.stop() == 0, proc.log()
