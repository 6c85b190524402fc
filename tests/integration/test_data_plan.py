"""A running job's data plan changed live, on one server: a phase appended while a client streams
(no restart) changes no step before it and makes every step from it what a server configured
with that phase from the start serves; the plan log survives a restart and outranks an old
config file; a context-extension phase serves every token once per epoch across the change; and
bad changes are refused with the right status, changing nothing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from support import ServerProcess, batch_bytes, job_spec, write_config, write_jsonl
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

BATCH, SEQ_LEN = 10, 64
AT = 60  # the appended phase's first step: past what the stream has frozen when it is made
STEPS = 75


def datasets(tmp: Path, texts: list[str]) -> dict:
    parts = {"web": texts[:150], "code": texts[150:250], "books": texts[250:350]}
    out = {}
    for name, docs in parts.items():
        root = tmp / name
        if not root.exists():  # written once: a running server pins the files it listed
            root.mkdir()
            write_jsonl(root / "part.jsonl", docs)
        out[name] = {"sources": [str(root / "*.jsonl")], "chunk_bytes": "8KiB"}
    return out


def mixture(tmp: Path, texts: list[str], **phases) -> dict:
    ds = datasets(tmp, texts)
    weights = {"web": "1/2", "code": "3/10", "books": "1/5"}
    for name, w in weights.items():
        ds[name]["weight"] = w
    spec = job_spec([], seq_len=SEQ_LEN, global_batch_size=BATCH, **phases)
    del spec["sources"]
    spec["datasets"] = ds
    return spec


def serve(tmp: Path, name: str, spec: dict, token: str = "", **server) -> ServerProcess:
    server.setdefault("plan_freeze_steps", 4)
    cfg = write_config(tmp / f"{name}.yaml", {"main": spec}, tmp / f"cache-{name}", **server)
    proc = ServerProcess(cfg, tmp / f"{name}.log")
    if token:
        with proc.client("main", token=token) as c:
            deadline = time.monotonic() + 120
            while c.describe()["state"] == "JOB_STATE_INDEXING" and time.monotonic() < deadline:
                time.sleep(0.05)
        return proc
    assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    return proc


def stub(proc: ServerProcess, token: str | None = None):
    channel = grpc.insecure_channel(proc.address)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return channel, pb_grpc.TokenFeedStub(channel), metadata


def amend(proc: ServerProcess, token: str | None = None, **fields) -> pb.PlanInfo:
    weights = fields.pop("weights", {})
    request = pb.AmendPlanRequest(
        job="main",
        weights=[pb.DatasetWeight(dataset=k, weight=v) for k, v in weights.items()],
        **fields,
    )
    channel, s, metadata = stub(proc, token)
    with channel:
        return s.AmendPlan(request, timeout=30, metadata=metadata)


def plan(proc: ServerProcess, step: int = 0) -> pb.PlanInfo:
    channel, s, _ = stub(proc)
    with channel:
        return s.GetPlan(pb.GetPlanRequest(job="main", step=step), timeout=30)


def datasets_of(proc: ServerProcess, step: int) -> Counter:
    with proc.client("main") as c:
        return Counter(r["dataset"] for r in c.explain(step)["rows"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, texts):
    """A live server whose plan is amended at step AT while a client streams, and a server
    configured with that phase from the start (the reference)."""
    tmp = tmp_path_factory.mktemp("plan")
    new = {"web": "1/10", "code": "1/10", "books": "4/5"}
    live = serve(tmp, "live", mixture(tmp, texts))
    ref_spec = mixture(tmp, texts, schedule=[{"start_step": AT, "weights": new}])
    ref = serve(tmp, "ref", ref_spec)
    try:
        with live.client("main") as c:
            before = {s: batch_bytes(c.get_batch(s)) for s in range(20)}
        streamed: dict[int, dict[str, bytes]] = {}
        reached = threading.Event()
        amended = threading.Event()

        def trainer() -> None:
            with live.client("main") as c:
                for b in c.iter_batches(0, STEPS, prefetch=1):
                    streamed[b.step] = batch_bytes(b)
                    if b.step == 10:
                        reached.set()
                        amended.wait(60)

        thread = threading.Thread(target=trainer)
        thread.start()
        assert reached.wait(60)
        info = amend(live, start_step=AT, weights=new)
        amended.set()
        thread.join(120)
        channel, s, _ = stub(live)
        with channel:
            got = {
                step: s.GetBatch(pb.GetBatchRequest(job="main", step=step)) for step in range(STEPS)
            }
        plan_fields = {k: (m.plan_phase_start, m.plan_fingerprint) for k, m in got.items()}
        with ref.client("main") as c:
            reference = {s: batch_bytes(c.get_batch(s)) for s in range(STEPS)}
        yield live, ref, info, before, streamed, plan_fields, reference
    finally:
        live.stop()
        ref.stop()


def test_a_phase_appended_while_streaming_changes_no_earlier_step(runs):
    live, _, info, before, streamed, _, reference = runs
    assert info.version == 2
    assert [p.start_step for p in info.phases] == [0, AT]
    assert sorted(streamed) == list(range(STEPS))
    for step in range(AT):
        assert streamed[step] == reference[step], step
        if step in before:
            assert streamed[step] == before[step], step


def test_steps_from_the_new_phase_are_the_configured_phase_s(runs):
    live, _, _, _, streamed, _, reference = runs
    for step in range(AT, STEPS):
        assert streamed[step] == reference[step], step
    # The new weights (1/10, 1/10, 4/5 of 10 rows) hold within one row per step.
    for step in (AT, AT + 3, STEPS - 1):
        got = datasets_of(live, step)
        assert abs(got["books"] - 8) <= 1 and abs(got["web"] - 1) <= 1, got


def test_batches_carry_the_fingerprint_of_the_plan_up_to_their_step(runs):
    live, ref, _, _, _, fields, _ = runs
    starts = {fields[s][0] for s in range(AT)}
    assert starts == {0}
    assert {fields[s][0] for s in range(AT, STEPS)} == {AT}
    assert len({fields[s][1] for s in range(AT)}) == 1
    assert fields[AT][1] != fields[0][1]
    # The reference server, configured with the phase, has the same chain.
    ref_plan = plan(ref)
    assert [(p.start_step, p.fingerprint) for p in ref_plan.phases] == [
        (0, fields[0][1]),
        (AT, fields[AT][1]),
    ]


def test_describe_counts_what_each_dataset_gave_up_to_a_step(runs):
    live, _, _, _, _, _, _ = runs
    info = plan(live, step=STEPS)
    by_name = {c.dataset: c for c in info.consumed}
    assert sum(c.rows for c in info.consumed) == STEPS * BATCH
    assert all(c.tokens == c.rows * SEQ_LEN for c in info.consumed)
    # Exact rational apportionment: 1/2, 3/10, 1/5 of 600 rows, then 1/10, 1/10, 4/5 of 150.
    assert by_name["web"].rows == 300 + 15
    assert by_name["code"].rows == 180 + 15
    assert by_name["books"].rows == 120 + 120
    assert info.phase == 1
    with live.client("main") as c:
        rows = c.explain(AT + 1)["rows"]
    assert all("dataset_row" in r for r in rows)


def test_hostile_changes_are_refused_and_change_nothing(runs):
    live, _, _, _, _, _, _ = runs
    version = plan(live).version
    horizon = plan(live).horizon
    far = horizon + 100
    bad = [
        ({"start_step": far, "weights": {"web": "-1"}}, grpc.StatusCode.INVALID_ARGUMENT, ">= 0"),
        (
            {"start_step": far, "weights": {"web": "x"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "rational",
        ),
        (
            {"start_step": far, "weights": {"web": "0", "code": "0", "books": "0"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sum",
        ),
        ({"start_step": far, "weights": {"wiki": "1"}}, grpc.StatusCode.INVALID_ARGUMENT, "wiki"),
        ({"start_step": 1}, grpc.StatusCode.FAILED_PRECONDITION, "frozen"),
        ({"start_step": far, "expected_version": 1}, grpc.StatusCode.ABORTED, "version"),
        ({"start_step": far, "global_batch_size": -3}, grpc.StatusCode.INVALID_ARGUMENT, ">= 1"),
        (
            {"start_step": far, "packing": "padded"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "packing must be one of concat, best_fit",
        ),
    ]
    for fields, code, words in bad:
        with pytest.raises(grpc.RpcError) as e:
            amend(live, **fields)
        assert e.value.code() == code, (fields, e.value.details())
        assert words in e.value.details(), e.value.details()
    assert plan(live).version == version


def test_the_plan_log_outlives_a_restart_with_the_old_config(tmp_path, texts):
    proc = serve(tmp_path, "a", mixture(tmp_path, texts))
    try:
        amend(proc, start_step=50, global_batch_size=20)
        with proc.client("main") as c:
            amended = batch_bytes(c.get_batch(52))
        proc.stop()
        proc = ServerProcess(tmp_path / "a.yaml", tmp_path / "a2.log")  # the same, old config
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        info = plan(proc)
        assert [(p.start_step, p.global_batch_size) for p in info.phases] == [(0, 10), (50, 20)]
        with proc.client("main") as c:
            assert batch_bytes(c.get_batch(52)) == amended
            assert c.get_batch(52)["input_ids"].shape[0] == 20
    finally:
        proc.stop()


def test_changing_the_plan_needs_the_admin_scope(tmp_path, texts):
    tokens = tmp_path / "tokens"
    tokens.write_text("reader-token\nadmin-token:+admin\n")
    proc = serve(
        tmp_path,
        "auth",
        mixture(tmp_path, texts),
        token="admin-token",
        auth={"tokens_file": str(tokens)},
    )
    try:
        with pytest.raises(grpc.RpcError) as e:
            amend(proc, token="reader-token", start_step=500)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in e.value.details()
        info = amend(proc, token="admin-token", start_step=500, weights={"web": "1"})
        assert [p.start_step for p in info.phases] == [0, 500]
    finally:
        proc.stop()


def test_a_context_extension_phase_serves_every_token_once_per_epoch(tmp_path, texts):
    """seq_len 64 -> 256 from step 6: over two epochs every document token is an input twice
    (or three times: the third epoch's first tokens), never once or four times."""
    spec = job_spec([], seq_len=64, global_batch_size=4, chunk_bytes="8KiB")
    every, shapes = coverage_across_changes(
        tmp_path, texts, "ctx", spec, [{"start_step": 6, "seq_len": 256}], 10**6
    )
    assert all(shape == ((4, 64) if s < 6 else (4, 256)) for s, shape in shapes.items())
    assert every.min() == 2 and every.max() <= 3


def coverage_across_changes(tmp_path, texts, name, spec: dict, changes: list[dict], fits: int):
    """Serve documents of fewer than `fits` tokens under `spec`, append `changes`, and read
    steps until every document token has been an input twice: returns the coverage and the
    shape of each step's rows. Each step is also checked: the same rows for 1, 2 and 4 ranks,
    and Explain's pieces equal the tokens in the rows."""
    from support import TOKENIZER
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    # Short documents (pieces of the texts), so that best-fit rows never split one: then every
    # document token is an input of its row (a split piece's last slot is a label only).
    pieces = [t[i : i + 3 * fits] for t in texts[:80] for i in range(0, len(t), 3 * fits)]
    encoded = tok.encode_batch(pieces, add_special_tokens=False)
    docs = [t for t, e in zip(pieces, encoded, strict=True) if 0 < len(e.ids) < fits][:150]
    root = tmp_path / name
    root.mkdir()
    write_jsonl(root / "part.jsonl", docs)
    spec = {**spec, **{"sources": [str(root / "*.jsonl")]}}
    proc = serve(tmp_path, name, spec)
    shapes: dict[int, tuple[int, ...]] = {}
    try:
        for change in changes:
            amend(proc, **change)
        ids_of = {
            f"line {i + 1}": e.ids
            for i, e in enumerate(tok.encode_batch(docs, add_special_tokens=False))
        }
        coverage = {k: np.zeros(len(v), dtype=np.int64) for k, v in ids_of.items()}
        with proc.client("main") as c:
            step = 0
            while min(int(v.min()) for v in coverage.values()) < 2 and step < 400:
                batch = c.get_batch(step)
                ids = batch["input_ids"]
                shapes[step] = ids.shape
                for world in (2, 4):
                    parts = [c.get_batch(step, r, world)["input_ids"] for r in range(world)]
                    assert np.array_equal(np.concatenate(parts), ids)
                for row, why in zip(ids, c.explain(step)["rows"], strict=True):
                    for p in why["pieces"]:
                        ts, te = int(p["token_start"]), int(p["token_end"])
                        rs, re = int(p["row_start"]), int(p["row_end"])
                        assert row[rs:re].tolist() == ids_of[p["record"]][ts:te]
                        coverage[p["record"]][ts:te] += 1
                step += 1
        return np.concatenate(list(coverage.values())), shapes
    finally:
        proc.stop()


def test_a_phase_that_changes_to_best_fit_serves_every_token_once_per_epoch(tmp_path, texts):
    """concat at seq_len 64, then best_fit at 256 from step 6: the rows the last window of
    the concat phase had not served are read first (cut at 256, the last one padded), then
    whole chunks' best-fit rows; over two epochs every token is an input twice (or three
    times: the third epoch's first tokens), never once or four times."""
    spec = job_spec([], seq_len=64, global_batch_size=4, chunk_bytes="8KiB")
    every, shapes = coverage_across_changes(
        tmp_path,
        texts,
        "tobf",
        spec,
        [{"start_step": 6, "seq_len": 256, "packing": "best_fit"}],
        250,
    )
    assert {s for s, shape in shapes.items() if shape == (4, 64)} == set(range(6))
    assert all(shape == (4, 256) for s, shape in shapes.items() if s >= 6)
    assert every.min() == 2 and every.max() <= 3


def test_best_fit_phases_may_change_seq_len_and_go_back_to_concat(tmp_path, texts):
    """best_fit at 64, best_fit at 128 from step 5, concat at 96 from step 12: every token is
    an input twice over two epochs across both changes."""
    spec = job_spec([], seq_len=64, global_batch_size=4, chunk_bytes="8KiB", packing="best_fit")
    changes = [
        {"start_step": 5, "seq_len": 128},
        {"start_step": 12, "seq_len": 96, "packing": "concat"},
    ]
    every, shapes = coverage_across_changes(tmp_path, texts, "frombf", spec, changes, 60)
    assert [shapes[s][1] for s in (0, 4, 5, 11, 12)] == [64, 64, 128, 128, 96]
    assert every.min() == 2 and every.max() <= 3


@pytest.mark.parametrize("workers", [1, 2])
def test_a_mixture_s_packing_change_streams_and_outlives_a_restart(tmp_path, texts, workers):
    """Three datasets under concat, best_fit at 128 from step 8 (a step of the change mixes
    carry rows and best-fit rows of several datasets): a stream through the change gives the
    bytes GetBatch gives, two ranks split each step, Explain's pieces are the rows' tokens, and
    a restarted server (which counts the best-fit rows again) serves every step the same; with
    serving workers too (each counts on its own)."""
    proc = serve(tmp_path, "mixbf", mixture(tmp_path, texts), workers=workers)
    steps = range(60)
    try:
        amend(proc, start_step=8, seq_len=128, packing="best_fit")
        with proc.client("main") as c:
            single = {s: batch_bytes(c.get_batch(s)) for s in steps}
            streamed = {b.step: batch_bytes(b) for b in c.iter_batches(0, len(steps), prefetch=2)}
            assert streamed == single
            for s in (7, 8, 9, 15):
                ids = c.get_batch(s)["input_ids"]
                halves = [c.get_batch(s, r, 2)["input_ids"] for r in range(2)]
                assert np.array_equal(np.concatenate(halves), ids)
            from support import TOKENIZER
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(TOKENIZER))
            ids_of = {}
            for name, docs in {"web": texts[:150], "code": texts[150:250]}.items():
                for i, e in enumerate(tok.encode_batch(docs, add_special_tokens=False)):
                    ids_of[(name, f"line {i + 1}")] = e.ids
            checked = 0
            for s in (8, 9, 30, 45, 59):
                batch = c.get_batch(s)
                for row, why in zip(batch["input_ids"], c.explain(s)["rows"], strict=True):
                    for p in why["pieces"]:
                        key = (why["dataset"], p["record"])
                        if key not in ids_of:
                            continue
                        ts, te = int(p["token_start"]), int(p["token_end"])
                        rs, re = int(p["row_start"]), int(p["row_end"])
                        assert row[rs:re].tolist() == ids_of[key][ts:te]
                        checked += 1
            assert checked > 50
            # the carries' last rows, then best-fit rows, are padded (masked); concat rows never
            masked = [int((c.get_batch(s)["loss_mask"] == 0).sum()) for s in steps]
            assert sum(masked[:8]) == 0 and sum(masked[8:]) > 0
        # every worker's copy of the plan follows the log (GetPlan may reach another worker than
        # AmendPlan did: it holds the change once it has refreshed): several calls in a row,
        # whichever workers they reach, agree
        deadline = time.monotonic() + 60
        while True:
            seen = [[p.packing for p in plan(proc).phases] for _ in range(2 * workers + 2)]
            if all(s == ["concat", "best_fit"] for s in seen) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert all(s == ["concat", "best_fit"] for s in seen), seen
        proc.stop()
        proc = ServerProcess(tmp_path / "mixbf.yaml", tmp_path / "mixbf2.log")
        assert proc.wait_ready("main")["state"] == "JOB_STATE_READY", proc.log()
        with proc.client("main") as c:
            assert {s: batch_bytes(c.get_batch(s)) for s in steps} == single
    finally:
        proc.stop()
