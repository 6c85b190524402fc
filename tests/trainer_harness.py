"""Runs real trainers in new processes on batches from a real server, and checks a resume at
another data-parallel size against the uninterrupted run.

One scenario per framework (tests/integration/test_trainer_<name>.py), four runs of a worker
script (tests/trainer_workers/run_<name>.py), two at a time:

    ref: 1 process, steps [0, STEPS), a checkpoint at step RESUME (the uninterrupted run)
    a:   2 processes, steps [0, RESUME), a checkpoint at RESUME
then
    b:   1 process, resumed from a's checkpoint (2 -> 1), to STEPS
    c:   2 processes, resumed from ref's checkpoint (1 -> 2), to STEPS

Each worker trains a tiny model with torch.distributed (gloo) through the framework's own loop
and checkpointing, and writes, per rank, what its model consumed at each global step (a digest
of the input ids and labels it trained on) and its loss. The test then checks that every
rank's rows are its slice of the global batch the server defines for that step (so the global
batch the resumed run trained on equals the uninterrupted run's, byte for byte), that the
resumed runs trained on exactly the steps after the checkpoint (no step repeated or skipped),
and that their loss continues the uninterrupted run's curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenfeed.client import Client

WORKERS = Path(__file__).parent / "trainer_workers"
STEPS, RESUME = 16, 8  # global steps of a run, and the step the checkpoint resumes at
VOCAB = 1024  # tests/data/tokenizer.json


def digest(input_ids: np.ndarray, labels: np.ndarray) -> str:
    """What a worker reports for the rows it trained on (int64, row-major)."""
    h = hashlib.sha256(np.ascontiguousarray(input_ids, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass
class Run:
    name: str
    world: int
    start: int  # the step a resumed run must resume at (0: a fresh run)
    end: int
    ckpt_out: Path  # where it checkpoints at RESUME
    ckpt_in: Path | None  # what it resumes from


def _free_ports(count: int) -> list[int]:
    """Distinct free ports (held together while picked, so two runs never get the same)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _launch(script: Path, run: Run, address: str, job: str, tmp: Path, port: int) -> list:
    procs = []
    for rank in range(run.world):
        args = {
            "address": address,
            "job": job,
            "rank": rank,
            "world": run.world,
            "steps": run.end,
            "resume_step": RESUME,
            "ckpt_out": str(run.ckpt_out),
            "ckpt_in": str(run.ckpt_in) if run.ckpt_in else None,
            "out": str(tmp / f"{run.name}.rank{rank}.json"),
            "work": str(tmp / f"{run.name}.work"),
            "vocab": VOCAB,
        }
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(run.world),
            "LOCAL_WORLD_SIZE": str(run.world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(WORKERS.parent), os.environ.get("PYTHONPATH", "")]),
        }
        log = open(tmp / f"{run.name}.rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(script), json.dumps(args)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _wait(groups: list[tuple[Run, list]], tmp: Path, timeout: float) -> dict[str, list[dict]]:
    deadline = time.monotonic() + timeout
    out = {}
    for run, procs in groups:
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                code = -9
            log.close()
            if code != 0:
                for p, other in procs:  # every rank's log, complete
                    p.kill()
                    other.close()
                logs = "".join(
                    f"\n--- rank {r}:\n" + (tmp / f"{run.name}.rank{r}.log").read_text()[-4000:]
                    for r in range(run.world)
                )
                raise AssertionError(f"run {run.name} rank {rank} exited {code}:{logs}")
        out[run.name] = [
            json.loads((tmp / f"{run.name}.rank{r}.json").read_text()) for r in range(run.world)
        ]
    return out


def scenario(name: str, address: str, job: str, tmp: Path, timeout: float = 240) -> dict:
    """The four runs of `tests/trainer_workers/run_<name>.py`; {run: [per-rank records]}."""
    script = WORKERS / f"run_{name}.py"  # (not named after the framework it imports)
    ref = Run("ref", 1, 0, STEPS, tmp / "ref.ckpt", None)
    a = Run("a", 2, 0, RESUME, tmp / "a.ckpt", None)
    b = Run("b", 1, RESUME, STEPS, tmp / "b.ckpt", a.ckpt_out)
    c = Run("c", 2, RESUME, STEPS, tmp / "c.ckpt", ref.ckpt_out)
    records = {}
    for phase in ((ref, a), (b, c)):
        ports = _free_ports(len(phase))
        groups = [
            (run, _launch(script, run, address, job, tmp, port))
            for run, port in zip(phase, ports, strict=True)
        ]
        records.update(_wait(groups, tmp, timeout))
    return {"runs": {r.name: r for r in (ref, a, b, c)}, "records": records}


def expected_digests(address: str, job: str, world: int) -> dict[int, list[str]]:
    """{step: [digest of rank r's slice of the server's global batch]} for every step."""
    out = {}
    with Client(address, job=job) as c:
        for step in range(STEPS):
            batch = c.get_batch(step, 0, 1)
            ids, labels = batch["input_ids"], batch["labels"]
            rows = len(ids) // world
            out[step] = [
                digest(ids[r * rows : (r + 1) * rows], labels[r * rows : (r + 1) * rows])
                for r in range(world)
            ]
    return out


def check(result: dict, address: str, job: str, loss_rtol: float = 1e-3) -> None:
    """The assertions every framework's scenario must pass."""
    runs, records = result["runs"], result["records"]
    expected = {w: expected_digests(address, job, w) for w in (1, 2)}
    losses: dict[str, dict[int, float]] = {}
    for name, run in runs.items():
        per_rank = records[name]
        steps = list(range(run.start, run.end))
        for rank, rec in enumerate(per_rank):
            trained = [int(s) for s in rec["steps"]]
            assert trained == steps, f"run {name} rank {rank} trained steps {trained}"
            if run.start:
                assert rec["resumed_at"] == run.start, (name, rank, rec["resumed_at"])
            for step, dig in zip(trained, rec["digests"], strict=True):
                assert dig == expected[run.world][step][rank], (
                    f"run {name} (world {run.world}) rank {rank} step {step}: its rows are not "
                    "its slice of the server's global batch"
                )
        # The global loss of a step: the mean of the ranks' (equal-sized) slices' losses.
        losses[name] = {
            s: float(np.mean([rec["losses"][i] for rec in per_rank])) for i, s in enumerate(steps)
        }
    ref = losses["ref"]
    for name in ("a", "b", "c"):
        for step, loss in losses[name].items():
            assert np.isclose(loss, ref[step], rtol=loss_rtol), (
                f"run {name} step {step}: loss {loss} where the uninterrupted run had {ref[step]}"
            )
    # The curve moved (a model that learns nothing would pass the comparison trivially).
    assert ref[STEPS - 1] < ref[0]
