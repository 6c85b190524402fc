"""A token store shared by a fleet on the S3-compatible server: each chunk is tokenized by one
node, every node serves the same bytes, and a store made from other inputs is refused."""

from __future__ import annotations

import threading
import time

import pytest
from s3env import s3_client
from support import TOKENIZER, ServerProcess, batch_bytes, job_spec, metric, scrape, write_config

STEPS = [0, 1, 7, 40, 120, 329, 400]


def upload(endpoint: str, bucket: str, corpus) -> None:
    client = s3_client(endpoint)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=bucket, Key=f"c/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="tokenizer.json", Body=TOKENIZER.read_bytes())


def node(tmp, name: str, endpoint: str, bucket: str, **store) -> ServerProcess:
    spec = job_spec([f"s3://{bucket}/c/*"], tokenizer=f"s3://{bucket}/tokenizer.json")
    cfg = write_config(
        tmp / f"{name}.yaml",
        {"main": spec},
        tmp / f"cache-{name}",
        object_store={"endpoint_url": endpoint, "addressing_style": "path"},
        metrics_listen="127.0.0.1:0",
        tokenize_threads=1,
    )
    text = (
        cfg.read_text()
        + "store:\n"
        + "".join(
            f"  {k}: {v}\n"
            for k, v in {"uri": f"s3://{bucket}/store/", "node": name, **store}.items()
        )
    )
    cfg.write_text(text)
    return ServerProcess(cfg, tmp / f"{name}.log")


def counts(proc: ServerProcess) -> dict[str, float]:
    samples = scrape(proc.metrics)
    return {
        o: metric(samples, "tokenfeed_shared_store_chunks_total", outcome=o)
        for o in ("published", "indexed", "fetched", "taken_over")
    }


def batches(proc: ServerProcess) -> dict[int, dict[str, bytes]]:
    with proc.client("main", timeout=60) as c:
        return {s: batch_bytes(c.get_batch(s)) for s in STEPS}


def manifests(endpoint: str, bucket: str) -> list[str]:
    pages = s3_client(endpoint).get_paginator("list_objects_v2")
    return [
        o["Key"]
        for p in pages.paginate(Bucket=bucket, Prefix="store/chunks/")
        for o in p.get("Contents", [])
        if o["Key"].endswith(".json")
    ]


def test_two_nodes_tokenize_disjoint_chunks_and_serve_identical_batches(
    tmp_path, corpus, moto_server, s3_bucket
):
    endpoint = moto_server.endpoint
    upload(endpoint, s3_bucket, corpus)
    a = node(tmp_path, "node-a", endpoint, s3_bucket, min_nodes=2, takeover_seconds=600)
    b = node(tmp_path, "node-b", endpoint, s3_bucket, min_nodes=2, takeover_seconds=600)
    try:
        infos = [p.wait_ready("main", timeout=180) for p in (a, b)]
        assert all(i["state"] == "JOB_STATE_READY" for i in infos), a.log() + b.log()
        total = infos[0]["num_chunks"]
        ca, cb = counts(a), counts(b)
        # Each chunk was tokenized once, by one of the two; each node read the other's share.
        assert ca["published"] > 0 and cb["published"] > 0, (ca, cb)
        assert ca["published"] + cb["published"] == total, (ca, cb)
        assert ca["indexed"] == cb["published"] and cb["indexed"] == ca["published"]
        assert ca["taken_over"] == cb["taken_over"] == 0
        assert len(manifests(endpoint, s3_bucket)) == total
        served = batches(a)
        assert batches(b) == served
    finally:
        assert a.stop() == 0, a.log()
        assert b.stop() == 0, b.log()

    # A third node finds everything published: it tokenizes nothing and serves the same bytes.
    c = node(tmp_path, "node-c", endpoint, s3_bucket)
    try:
        assert c.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", c.log()
        assert batches(c) == served
        got = counts(c)
        assert got["published"] == 0 and got["indexed"] == total and got["fetched"] > 0
        samples = scrape(c.metrics)
        assert metric(samples, "tokenfeed_tokenized_documents_total", tokenfeed_job="main") == 0
    finally:
        assert c.stop() == 0, c.log()

    # A changed source makes other inputs: the store refuses the job and says what differs.
    s3_client(endpoint).put_object(
        Bucket=s3_bucket, Key="c/part-0.jsonl", Body=(corpus / "part-0.jsonl").read_bytes() + b"\n"
    )
    d = node(tmp_path, "node-d", endpoint, s3_bucket)
    try:
        info = d.wait_ready("main", timeout=120)
        assert info["state"] == "JOB_STATE_FAILED", info
        assert "made from other inputs" in info["error"]
        assert "1 sources changed" in info["error"] and "c/part-0.jsonl" in info["error"]
        assert "new prefix" in info["error"]
    finally:
        assert d.stop() == 0, d.log()


def test_a_node_takes_over_the_chunks_of_a_node_that_never_publishes(
    tmp_path, corpus, moto_server, s3_bucket
):
    endpoint = moto_server.endpoint
    upload(endpoint, s3_bucket, corpus)
    client, stop = s3_client(endpoint), threading.Event()

    def ghost() -> None:  # a live node that owns half the chunks and never tokenizes
        while not stop.is_set():
            client.put_object(Bucket=s3_bucket, Key="store/nodes/ghost.json", Body=b"{}")
            stop.wait(0.5)

    beat = threading.Thread(target=ghost, daemon=True)
    beat.start()
    proc = node(tmp_path, "solo", endpoint, s3_bucket, takeover_seconds=1.5, min_nodes=2)
    try:
        started = time.monotonic()
        info = proc.wait_ready("main", timeout=180)
        assert info["state"] == "JOB_STATE_READY", proc.log()
        got = counts(proc)
        assert got["published"] == info["num_chunks"] and 0 < got["taken_over"] < got["published"]
        assert time.monotonic() - started >= 1.5
        assert "taking over" in proc.log() and "from node ghost" in proc.log()
    finally:
        stop.set()
        beat.join()
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("uri", ["dir"])
def test_a_directory_is_a_shared_store_too(tmp_path, corpus, uri):
    store = tmp_path / "shared"
    spec = job_spec([corpus / "*"])
    procs = []
    for name in ("x", "y"):
        cfg = write_config(
            tmp_path / f"{name}.yaml",
            {"main": spec},
            tmp_path / f"cache-{name}",
            metrics_listen="127.0.0.1:0",
        )
        cfg.write_text(cfg.read_text() + f"store:\n  uri: {store}\n  node: {name}\n")
        procs.append(ServerProcess(cfg, tmp_path / f"{name}.log"))
        assert procs[-1].wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY"
    try:
        first, second = (counts(p) for p in procs)
        assert second["published"] == 0 and second["indexed"] == first["published"] > 0
        assert batches(procs[0]) == batches(procs[1])
        assert len(list((store / "chunks").glob("*/*.json"))) == first["published"]
    finally:
        for p in procs:
            assert p.stop() == 0, p.log()
