"""The data plan from the trainer's side, against real servers: a checkpoint resumes across an
amendment of later steps and is refused, the step named, across a rewrite of the steps it read;
servers that keep their own plan logs and disagree are caught before a rank reads a step they
disagree on; a trainer that steers its own mixture replays bit for bit; and the operator's
`tokenfeed plan` verbs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support import ServerProcess, batch_bytes, job_spec, write_config, write_jsonl
from tokenfeed.client import Client, PlanRewritten
from tokenfeed.client.integrations._feed import RankFeed


def corpus(tmp: Path, texts: list[str]) -> dict:
    out = {}
    for name, docs in (("web", texts[:160]), ("code", texts[160:260])):
        root = tmp / name
        if not root.exists():
            root.mkdir()
            write_jsonl(root / "part.jsonl", docs)
        out[name] = {"sources": [str(root / "*.jsonl")], "chunk_bytes": "8KiB"}
    return out


def mixture(tmp: Path, texts: list[str], **over) -> dict:
    spec = job_spec([], seq_len=32, global_batch_size=8, **over)
    del spec["sources"]
    spec["datasets"] = corpus(tmp, texts)
    spec["datasets"]["web"]["weight"] = "1/2"
    spec["datasets"]["code"]["weight"] = "1/2"
    return spec


def serve(tmp: Path, name: str, spec: dict, cache: str | None = None, **server) -> ServerProcess:
    server.setdefault("plan_freeze_steps", 2)
    cfg = write_config(
        tmp / f"{name}.yaml", {"main": spec}, tmp / (cache or f"cache-{name}"), **server
    )
    proc = ServerProcess(cfg, tmp / f"{name}.{time.monotonic_ns()}.log")
    assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    return proc


def test_a_checkpoint_resumes_across_an_amendment_and_not_across_a_rewrite(tmp_path, texts):
    spec = mixture(tmp_path, texts, schedule=[{"start_step": 5, "weights": {"web": 3}}])
    proc = serve(tmp_path, "a", spec, cache="cache")
    try:
        with Client(proc.address, job="main") as c:
            feed = RankFeed(c, 0, 2)
            read = [b.step for _, b in zip(range(10), feed.batches(), strict=False)]
            assert read == list(range(10))
            state = feed.state_dict()
            assert state["next_step"] == 10 and [s for s, _ in state["plan"]] == [0, 5]
            c.amend_plan(40, weights={"code": 1})  # later steps only: the checkpoint holds
        with Client(proc.address, job="main") as c:
            resumed = RankFeed(c, 1, 4)
            resumed.restore(state)
            assert next(resumed.batches()).step == 10
        proc.stop()
        # The cache (and the plan log in it) lost, the config edited: step 5 decided otherwise.
        shutil.rmtree(tmp_path / "cache")
        edited = mixture(tmp_path, texts, schedule=[{"start_step": 5, "weights": {"web": 7}}])
        proc = serve(tmp_path, "b", edited, cache="cache")
        with Client(proc.address, job="main") as c:
            again = RankFeed(c, 0, 2)
            with pytest.raises(PlanRewritten, match="step 5") as e:
                again.restore(state)
            assert e.value.step == 5
    finally:
        proc.stop()


def test_servers_with_their_own_plans_are_caught_before_a_step_they_disagree_on(tmp_path, texts):
    """Two servers, each its own plan log. A change made on one only: a rank reading through
    either holds back the first step of the change until the other has it too, then reads the
    changed plan; no batch of that step is handed over before. (The change is made more than
    plan_check_seconds before the rank reaches it: a rank reading only from the lagging
    server learns of it at its next comparison, docs/data-plan.md.)"""
    a = serve(tmp_path, "a", mixture(tmp_path, texts))
    b = serve(tmp_path, "b", mixture(tmp_path, texts))
    ref = serve(
        tmp_path,
        "ref",
        mixture(tmp_path, texts, schedule=[{"start_step": 30, "weights": {"code": 1}}]),
    )
    try:
        with ref.client("main") as c:
            want = {s: batch_bytes(c.get_batch(s)) for s in range(40)}
        got: dict[int, dict[str, bytes]] = {}
        handed: dict[int, float] = {}
        errors: list[BaseException] = []
        waiting = threading.Event()

        def trainer() -> None:
            try:
                with Client(f"{a.address},{b.address}", job="main", plan_check_seconds=0.2) as c:
                    for step in range(40):
                        batch = c.get_batch(step)
                        got[step], handed[step] = batch_bytes(batch), time.monotonic()
                        if step == 20:
                            waiting.wait(60)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=trainer)
        thread.start()
        deadline = time.monotonic() + 60
        while 20 not in handed and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        with Client(a.address, job="main") as c:
            c.amend_plan(30, weights={"code": 1})
        time.sleep(0.5)  # more than plan_check_seconds: the trainer's next comparison sees it
        waiting.set()
        time.sleep(3)  # the trainer reaches step 30 and is held back there
        assert 30 not in handed and not errors, errors
        held_since = time.monotonic()
        with Client(b.address, job="main") as c:
            c.amend_plan(30, weights={"code": 1})
        thread.join(120)
        assert not errors, errors
        assert handed[30] >= held_since
        assert got == want
    finally:
        for p in (a, b, ref):
            p.stop()


def test_a_trainer_steering_its_mixture_replays_bit_for_bit(tmp_path, texts):
    """Rank 0 appends new weights every 8 steps from what it read (an online mixing policy);
    a fresh client reading steps 0.. of the final plan gets every batch again, bit for bit."""
    proc = serve(tmp_path, "steer", mixture(tmp_path, texts), plan_freeze_steps=1)
    try:
        first: dict[int, bytes] = {}
        with Client(proc.address, job="main") as c:
            for step in range(60):
                batch = c.get_batch(step)
                first[step] = batch["input_ids"].tobytes()
                if step % 8 == 7:
                    rows = c.explain(step)["rows"]
                    code = sum(r["dataset"] == "code" for r in rows)
                    # More of what was seen least: weights from the rows just read.
                    c.amend_plan(step + 3, weights={"web": 1 + code, "code": 1 + len(rows) - code})
            plan = c.plan()
        assert plan["version"] == 1 + 7 and len(plan["phases"]) == 8
        with Client(proc.address, job="main") as replay:
            again = {s: replay.get_batch(s)["input_ids"].tobytes() for s in range(60)}
        assert again == first
    finally:
        proc.stop()


def test_the_plan_verbs_show_and_append(tmp_path, texts):
    proc = serve(tmp_path, "cli", mixture(tmp_path, texts))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tokenfeed.server.commands.cli", "plan", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        with proc.client("main") as c:
            for s in range(4):
                c.get_batch(s)
        shown = cli("show", "--target", proc.address, "--job", "main", "--step", "4")
        assert shown.returncode == 0, shown.stderr
        assert "version 1" in shown.stdout and "web: 16 rows, 512 row tokens" in shown.stdout
        done = cli(
            "append",
            "--target",
            proc.address,
            "--job",
            "main",
            "--at-step",
            "100",
            "--weights",
            "web=1,code=3",
            "--global-batch-size",
            "16",
        )
        assert done.returncode == 0, done.stderr + done.stdout
        assert "version 2" in done.stdout and "code=3" in done.stdout
        refused = cli(
            "append",
            "--target",
            proc.address,
            "--job",
            "main",
            "--at-step",
            "1",
            "--weights",
            "web=1",
        )
        assert refused.returncode == 1 and "frozen" in refused.stdout
        bad = cli(
            "append",
            "--target",
            proc.address,
            "--job",
            "main",
            "--at-step",
            "200",
            "--weights",
            "web",
        )
        assert bad.returncode == 2 and "name=weight" in bad.stderr
        with proc.client("main") as c:
            assert c.get_batch(100)["input_ids"].shape == (16, 32)
            assert np.array_equal(c.get_batch(99)["input_ids"].shape, (8, 32))
    finally:
        proc.stop()
