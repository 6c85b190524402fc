"""What the data plan costs a server, and how fast a change reaches a fleet (docs/data-plan.md).

    python -m bench.dataplan [--quick]

1. GetBatch latency of the requests that move a job's frozen horizon on (a conditional write of
   its plan log: a local file for a lone server, an S3 object for a fleet) against the others,
   on the same server in the same run; and the same requests on a server that never has to
   (a horizon past every step measured), as the reference.
2. A phase appended on one server of a two-server fleet sharing a store: the time until the
   other server's GetPlan shows it (its background read, `server.plan_refresh_seconds`), and
   the time until the other server serves a step of the new phase (read before serving a step
   past its horizon: immediate, whatever the refresh interval).

The S3-compatible server is moto's, on loopback (tests/s3env.py), so S3 latencies are loopback
ones: a real store adds its own round trips to the writes measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest import mock

import grpc
import yaml
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

from bench.objstore import CREDENTIALS, from_tests
from bench.procs import ServerProcess
from bench.stats import percentile
from bench.table import number, render

OUT = Path(__file__).resolve().parent / "out" / "dataplan"
FREEZE = 64  # server.plan_freeze_steps, its default


def _config(work: Path, name: str, corpus: Path, tokenizer: Path, **extra) -> Path:
    server = {"listen": "127.0.0.1:0", "cache_dir": str(work / f"cache-{name}")}
    server.update(extra.pop("server", {}))
    raw = {
        "server": server,
        "jobs": {
            "main": {
                "sources": [str(corpus / "*")],
                "tokenizer": str(tokenizer),
                "seq_len": 256,
                "global_batch_size": 4,
                "chunk_bytes": "64KiB",
            }
        },
        **extra,
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _serve(work: Path, name: str, config: Path) -> ServerProcess:
    proc = ServerProcess(
        name,
        [sys.executable, "-m", "tokenfeed.server.commands.cli", "serve", "--config", str(config)],
        work,
    )
    proc.start(timeout=180)
    with Client(proc.address, job="main") as c:
        deadline = time.monotonic() + 180
        while c.describe()["state"] != "JOB_STATE_READY" and time.monotonic() < deadline:
            time.sleep(0.05)
    return proc


def _latencies(address: str, steps: int) -> list[float]:
    """One GetBatch per step, in order (a trainer's pace), each timed."""
    out = []
    with Client(address, job="main") as c:
        for step in range(steps):
            t = time.perf_counter()
            c.get_batch(step)
            out.append(time.perf_counter() - t)
    return out


def _split(lat: list[float], freeze: int) -> tuple[list[float], list[float]]:
    """(requests that moved the horizon on, the others): the first request freezes through
    step 0 + freeze, then each request for step H + 1 moves it on by freeze + 1."""
    movers = {0}
    h = freeze
    while h + 1 < len(lat):
        movers.add(h + 1)
        h = h + 1 + freeze
    return [x for i, x in enumerate(lat) if i in movers], [
        x for i, x in enumerate(lat) if i not in movers
    ]


def _row(label: str, lat: list[float]) -> list[str]:
    return [
        label,
        str(len(lat)),
        number(percentile(lat, 50) * 1e3, 2),
        number(percentile(lat, 99) * 1e3, 2),
        number(max(lat) * 1e3, 2),
    ]


def measure(quick: bool) -> str:
    work = OUT
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer, _ = democorpus.prepare(work / "corpus")
    steps = 400 if quick else 2000
    rows: list[list[str]] = []

    # 1a. A lone server: the log is a file in its cache directory.
    for name, freeze in (("local", FREEZE), ("local-ref", 10**9)):
        cfg = _config(work, name, corpus, tokenizer, server={"plan_freeze_steps": freeze})
        proc = _serve(work, name, cfg)
        try:
            lat = _latencies(proc.address, steps)
        finally:
            proc.stop(30)
        if freeze == FREEZE:
            movers, others = _split(lat, freeze)
            rows.append(_row("lone server: requests that move the horizon on", movers))
            rows.append(_row("lone server: the others", others))
        else:
            rows.append(_row("lone server, horizon never moved (reference)", lat[1:]))

    # 1b and 2. A fleet of two sharing a store on S3 (moto on loopback).
    s3env, _ = from_tests()
    propagation: list[tuple[str, float]] = []
    with s3env.MotoServer(work) as moto, mock.patch.dict(os.environ, CREDENTIALS):
        client = s3env.s3_client(moto.endpoint)
        client.create_bucket(Bucket="plan")
        store = {"uri": "s3://plan/store/"}
        object_store = {"endpoint_url": moto.endpoint, "addressing_style": "path"}
        procs = []
        try:
            for i in range(2):
                cfg = _config(
                    work,
                    f"fleet{i}",
                    corpus,
                    tokenizer,
                    server={"plan_refresh_seconds": 5.0},
                    store={**store, "node": f"n{i}"},
                    object_store=object_store,
                )
                procs.append(_serve(work, f"fleet{i}", cfg))
            lat = _latencies(procs[0].address, steps)
            movers, others = _split(lat, FREEZE)
            rows.append(_row("fleet on S3: requests that move the horizon on", movers))
            rows.append(_row("fleet on S3: the others", others))
            # 2. A change made on server 0, seen by server 1.
            with grpc.insecure_channel(procs[0].address) as ch:
                info = pb_grpc.TokenFeedStub(ch).GetPlan(pb.GetPlanRequest(job="main"))
                at = info.horizon + 10
                started = time.monotonic()
                pb_grpc.TokenFeedStub(ch).AmendPlan(
                    pb.AmendPlanRequest(job="main", start_step=at, global_batch_size=8)
                )
            amended = time.monotonic() - started
            with grpc.insecure_channel(procs[1].address) as ch:
                stub = pb_grpc.TokenFeedStub(ch)
                t0 = time.monotonic()
                batch = stub.GetBatch(pb.GetBatchRequest(job="main", step=at))
                served_new = time.monotonic() - t0
                assert batch.rows == 8, batch.rows
                # A third phase, then wait for server 1's background read to show it.
                with grpc.insecure_channel(procs[0].address) as ch0:
                    h = pb_grpc.TokenFeedStub(ch0).GetPlan(pb.GetPlanRequest(job="main")).horizon
                    t0 = time.monotonic()
                    pb_grpc.TokenFeedStub(ch0).AmendPlan(
                        pb.AmendPlanRequest(job="main", start_step=h + 500, global_batch_size=4)
                    )
                while stub.GetPlan(pb.GetPlanRequest(job="main")).version < 3:
                    time.sleep(0.01)
                seen = time.monotonic() - t0
            propagation = [
                ("AmendPlan on server 0 (a conditional PUT of the log)", amended),
                ("server 1 serves a step of the new phase (first request)", served_new),
                ("server 1's GetPlan shows the change (background read every 5 s)", seen),
            ]
        finally:
            for p in procs:
                p.stop(30)

    one = render(
        "Data plan: GetBatch latency of requests that move the frozen horizon on "
        f"(every {FREEZE} steps), same run",
        ["requests", "n", "p50 (ms)", "p99 (ms)", "max (ms)"],
        rows,
    )
    two = render(
        "Data plan: a change reaching a fleet of two servers sharing a store (moto on loopback)",
        ["event", "seconds"],
        [[label, number(seconds, 3)] for label, seconds in propagation],
    )
    return one + "\n\n" + two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(measure(args.quick))


if __name__ == "__main__":
    main()
