"""A data plan changed under a fleet: three servers share a store on the S3-compatible test
server, eight rank clients stream through the change, one server is cut off from the store by
a fault proxy and one is restarted with the old config file. Every batch every rank reads is
the batch of a server configured with the change from the start: the cut-off server refuses
(UNAVAILABLE) the steps it cannot confirm and the clients go elsewhere, the restarted one serves
the log's plan, never its config's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from s3env import FaultProxy, s3_client
from support import TOKENIZER, ServerProcess, write_config, write_jsonl
from tokenfeed.client import Client
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

WORLD, BATCH, SEQ_LEN = 8, 16, 32
AT, STEPS = 40, 64
NEW = {"web": "1/8", "code": "7/8"}


def spec(root: str, schedule: list | None = None) -> dict:
    out = {
        "datasets": {
            "web": {"sources": [f"{root}/web/*.jsonl"], "weight": "3/4"},
            "code": {"sources": [f"{root}/code/*.jsonl"], "weight": "1/4"},
        },
        "tokenizer": str(TOKENIZER),
        "seq_len": SEQ_LEN,
        "global_batch_size": BATCH,
        "seed": 3,
        "chunk_bytes": "8KiB",
        "window_chunks": 2,
    }
    if schedule:
        out["schedule"] = schedule
    return out


def node(tmp: Path, name: str, endpoint: str, bucket: str) -> tuple[Path, ServerProcess]:
    cfg = write_config(
        tmp / f"{name}.yaml",
        {"main": spec(f"s3://{bucket}/data")},
        tmp / f"cache-{name}",
        object_store={"endpoint_url": endpoint, "addressing_style": "path", "max_attempts": 2},
        plan_freeze_steps=4,
        plan_refresh_seconds=0.2,
        tokenize_threads=1,
    )
    cfg.write_text(cfg.read_text() + f"store:\n  uri: s3://{bucket}/store/\n  node: {name}\n")
    return cfg, ServerProcess(cfg, tmp / f"{name}.log")


def amend(address: str) -> pb.PlanInfo:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TokenFeedStub(channel).AmendPlan(
            pb.AmendPlanRequest(
                job="main",
                start_step=AT,
                weights=[pb.DatasetWeight(dataset=k, weight=v) for k, v in NEW.items()],
            ),
            timeout=30,
        )


def version_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TokenFeedStub(channel)
        return stub.GetPlan(pb.GetPlanRequest(job="main"), timeout=10).version


def test_a_fleet_changes_its_plan_with_no_rank_reading_two_plans(
    tmp_path, texts, moto_server, s3_bucket
):
    local = tmp_path / "data"
    for name, docs in (("web", texts[:200]), ("code", texts[200:320])):
        (local / name).mkdir(parents=True)
        write_jsonl(local / name / "part.jsonl", docs)
    client = s3_client(moto_server.endpoint)
    for path in sorted(local.rglob("*.jsonl")):
        key = f"data/{path.relative_to(local)}"
        client.put_object(Bucket=s3_bucket, Key=key, Body=path.read_bytes())

    # The reference: one server configured with the change from the start, local files.
    ref_cfg = write_config(
        tmp_path / "ref.yaml",
        {"main": spec(str(local), [{"start_step": AT, "weights": NEW}])},
        tmp_path / "cache-ref",
    )
    ref = ServerProcess(ref_cfg, tmp_path / "ref.log")
    proxies = [FaultProxy(moto_server.endpoint) for _ in range(3)]
    servers: list[ServerProcess] = []
    try:
        assert ref.wait_ready("main", timeout=180)["state"] == "JOB_STATE_READY", ref.log()
        with ref.client("main") as c:
            reference = {
                (s, r): c.get_batch(s, r, WORLD)["input_ids"].tobytes()
                for s in range(STEPS)
                for r in range(WORLD)
            }
        configs = []
        for i, proxy in enumerate(proxies):
            cfg, proc = node(tmp_path, f"n{i}", proxy.endpoint, s3_bucket)
            configs.append(cfg)
            servers.append(proc)
        for proc in servers:
            assert proc.wait_ready("main", timeout=180)["state"] == "JOB_STATE_READY", proc.log()
        target = ",".join(p.address for p in servers)

        got: dict[tuple[int, int], bytes] = {}
        errors: list[BaseException] = []
        at_step = [0] * WORLD
        go = threading.Event()

        def rank(r: int) -> None:
            try:
                with Client(target, job="main", timeout=120) as c:
                    # Steps 0..8 one call each (a stream would run ahead of the trainer and
                    # freeze the plan past the change), then a stream through the change.
                    for step in range(9):
                        got[(step, r)] = c.get_batch(step, r, WORLD)["input_ids"].tobytes()
                        at_step[r] = step
                    go.wait(120)
                    for b in c.iter_batches(9, STEPS, rank=r, world_size=WORLD, prefetch=1):
                        got[(b.step, r)] = b["input_ids"].tobytes()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(at_step) < 8 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)

        # Cut server 2 off from the plan log: it cannot confirm any step past its horizon.
        proxies[2].set_faults(1.0, ("503",), methods=("GET", "PUT"), key_filter="store/plans/")
        started = time.monotonic()
        info = amend(servers[0].address)
        assert info.version == 2 and [p.start_step for p in info.phases] == [0, AT]
        # The change reaches every server that can reach the store.
        reached: dict[int, float] = {}
        while len(reached) < 2 and time.monotonic() - started < 30:
            for i in (0, 1):
                if i not in reached and version_of(servers[i].address) == 2:
                    reached[i] = time.monotonic() - started
            time.sleep(0.02)
        assert set(reached) == {0, 1}, reached
        print(f"plan version 2 on servers 0, 1 after {max(reached.values()):.2f} s")
        # Server 2 answers UNAVAILABLE, with a retry hint, for a step it cannot confirm.
        with grpc.insecure_channel(servers[2].address) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.TokenFeedStub(channel).GetBatch(
                    pb.GetBatchRequest(job="main", step=STEPS - 1), timeout=30
                )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "cannot confirm the data plan" in e.value.details()

        # Server 1 restarted with the old config file: the log's plan, not the config's.
        servers[1].stop()
        servers[1] = ServerProcess(configs[1], tmp_path / "n1-again.log")
        # It listens on a new port: the ranks' target lists its old one, which they leave.
        assert servers[1].wait_ready("main", timeout=180)["state"] == "JOB_STATE_READY"
        assert version_of(servers[1].address) == 2
        go.set()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert sorted(got) == sorted(reference)
        differ = [k for k in reference if got[k] != reference[k]]
        assert not differ, (
            f"{len(differ)} rank batches differ from the reference, first {differ[0]}"
        )

        # Once the store is reachable again, server 2 serves the new plan too.
        proxies[2].clear_faults()
        with servers[2].client("main") as c:
            for s in (AT - 1, AT, STEPS - 1):
                for r in (0, WORLD - 1):
                    assert c.get_batch(s, r, WORLD)["input_ids"].tobytes() == reference[(s, r)]
        with servers[1].client("main") as c:
            batch = c.get_batch(AT, 0, 1)
            assert np.array_equal(
                batch["input_ids"],
                np.concatenate(
                    [
                        np.frombuffer(reference[(AT, r)], dtype=np.int32).reshape(-1, SEQ_LEN)
                        for r in range(WORLD)
                    ]
                ),
            )
    finally:
        for proc in servers:
            proc.stop()
        ref.stop()
        for proxy in proxies:
            proxy.stop()
