"""Serving while the index builds: a step is served as soon as the windows it needs are built,
and its batch equals the batch of the fully built index; a step whose chunks are not built yet
waits for them or is told UNAVAILABLE with a retry hint, never given a wrong batch."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from s3env import s3_client
from support import TOKENIZER, ServerProcess, batch_bytes, job_spec, write_config, write_jsonl
from tokenfeed.client import wire
from tokenfeed.server.errors import NotBuiltError
from tokenfeed.server.indexing.index import READY
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc


def _jobs(tmp, texts, cache: str):
    web = write_jsonl(tmp / "web.jsonl", texts[:250])
    books = write_jsonl(tmp / "books.jsonl", texts[250:330])
    mix = job_spec([], chunk_bytes="8KiB", window_chunks=2)
    del mix["sources"]
    mix["datasets"] = {
        "web": {"sources": [str(web)], "weight": 3},
        "books": {"sources": [str(books)], "weight": 1},
    }
    raw = {
        "server": {"cache_dir": str(tmp / cache)},
        "jobs": {"mix": mix, "fit": job_spec([web], packing="best_fit", chunk_bytes="8KiB")},
    }
    return build_jobs(configmod.from_dict(raw))


@pytest.mark.parametrize("name", ["mix", "fit"])
def test_each_step_is_served_once_its_windows_are_built_and_equals_the_full_build(
    tmp_path, texts, name
):
    full = _jobs(tmp_path, texts, "full")[name]
    partial = _jobs(tmp_path, texts, "partial")[name]

    async def build_full() -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            await full.build_index(pool, 2, retry=False)

    asyncio.run(build_full())
    assert full.state == READY
    steps = range(60)
    expected = {s: full.batch(s, 0, 1)[1] for s in steps}

    # Build the other job's chunks one at a time, in the order the server builds them (each
    # dataset in its epoch-0 order, datasets interleaved), and serve at every stage.
    for idx in partial.indexes:
        idx.plan()
    queues = [list(map(int, idx.order0)) for idx in partial.indexes]
    first_served: dict[int, int] = {}  # step -> chunks built when it was first served
    built, refused = 0, 0
    while any(queues):
        for d, idx in enumerate(partial.indexes):
            if queues[d]:
                i = queues[d].pop(0)
                idx.record(i, *idx.index_chunk(i))
                built += 1
        for s in steps:
            try:
                plan = partial.plan(s, 0, 1)
            except NotBuiltError as e:
                refused += 1
                assert "rows are built so far" in str(e) and e.retry_after >= 1.0
                assert s not in first_served, "a step once served stays servable"
                continue
            compact = partial.assemble(plan)[1]
            got = {name: wire.expand(compact, name) for name in wire.TENSOR_NAMES}
            for k in expected[s]:
                np.testing.assert_array_equal(got[k], expected[s][k], err_msg=f"step {s} {k}")
            first_served.setdefault(s, built)
    total = sum(len(idx.chunks) for idx in partial.indexes)
    assert refused > 0 and sorted(first_served) == list(steps)
    # Steps become servable in order, long before the last chunk is built.
    stages = [first_served[s] for s in steps]
    assert stages == sorted(stages) and stages[0] < total // 4 and stages[-1] < total, stages
    # Everything built; the index completes as a server's build would.
    for idx in partial.indexes:
        idx.finish()
    assert partial.fingerprint == full.fingerprint
    for s in steps:
        assert all((partial.batch(s, 0, 1)[1][k] == expected[s][k]).all() for k in expected[s])


def upload(endpoint: str, bucket: str, corpus) -> None:
    client = s3_client(endpoint)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=bucket, Key=f"c/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="tokenizer.json", Body=TOKENIZER.read_bytes())


def _s3_server(tmp, name: str, endpoint: str, bucket: str, **server) -> ServerProcess:
    spec = job_spec(
        [f"s3://{bucket}/c/*"],
        tokenizer=f"s3://{bucket}/tokenizer.json",
        chunk_bytes="8KiB",
        window_chunks=2,
    )
    store = {"endpoint_url": endpoint, "addressing_style": "path", "block_bytes": "4KiB"}
    cfg = write_config(
        tmp / f"{name}.yaml",
        {"main": spec},
        tmp / name,
        object_store=store,
        tokenize_threads=1,
        **server,
    )
    return ServerProcess(cfg, tmp / f"{name}.log")


def test_a_cold_server_serves_the_first_steps_while_later_chunks_are_tokenized(
    tmp_path, corpus, faults, s3_bucket
):
    upload(faults.endpoint, s3_bucket, corpus)
    faults.set_faults(1.0, ("delay",), key_filter="/c/", delay_seconds=0.06)  # a slow build
    proc = _s3_server(tmp_path, "cold", faults.endpoint, s3_bucket, max_wait_seconds=0.5)
    channel = grpc.insecure_channel(proc.address)
    stub = pb_grpc.TokenFeedStub(channel)
    try:
        steps, early = range(12), {}
        # Retrying at once (no pushback): the steps are asked for as soon as they can be served,
        # well before the slow build ends.
        with proc.client("main", timeout=120, max_pushback=0) as c:
            for s in steps:
                early[s] = batch_bytes(c.get_batch(s))
                info = c.describe()
                if s == steps[-1]:
                    assert info["state"] == "JOB_STATE_INDEXING", info
                    assert info["chunks_indexed"] < info["num_chunks"], info
            # A step of the last window is not built yet: UNAVAILABLE after max_wait_seconds,
            # with a retry hint in the message and in the standard trailer.
            last = info["num_chunks"] * 6
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetBatch(pb.GetBatchRequest(job="main", step=last, world_size=1), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rows are built so far" in refused.value.details()
            assert "retry in about" in refused.value.details()
            trailers = dict(refused.value.trailing_metadata())
            assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
            faults.clear_faults()
            assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY"
            again = {s: batch_bytes(c.get_batch(s)) for s in steps}
            assert again == early
    finally:
        channel.close()
        assert proc.stop() == 0, proc.log()

    # A server on a store built to the end (another cache, no delays) serves the same bytes.
    built = _s3_server(tmp_path, "built", faults.endpoint, s3_bucket)
    try:
        assert built.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY"
        with built.client("main", timeout=60) as c:
            assert {s: batch_bytes(c.get_batch(s)) for s in steps} == early
    finally:
        assert built.stop() == 0, built.log()
