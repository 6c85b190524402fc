"""Warm serving: tokenfeed's GetBatch and StreamBatches against a raw gRPC ceiling.

Both servers run as child processes for the whole section and the client alternates between them
round by round, so slow spells of a noisy machine land on both sides rather than on whichever
happened to run during them. Each server is driven by the real `Client`, so decoding and
fingerprint checks cost the same on both sides and the ratio isolates the server's own work.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus

from bench.procs import ServerProcess, Stopped

JOB = "bench"
SEQ_LEN = 2048
GLOBAL_BATCH = 8
GRACE_SECONDS = 5.0
START_TIMEOUT = 60.0
READY_TIMEOUT = 300.0


@dataclass(frozen=True)
class ServingSizes:
    rounds: int  # alternating rounds; each figure is the median over rounds
    unary_calls: int  # GetBatch calls per round and server
    stream_steps: int  # steps streamed per round and server


@dataclass
class Figures:
    """What one server delivered over all rounds."""

    latencies: list[float] = field(default_factory=list)  # seconds per GetBatch call
    unary_rates: list[float] = field(default_factory=list)  # tokens/s, one per round
    stream_rates: list[float] = field(default_factory=list)
    mismatches: int = 0  # batches whose fingerprint differed from the warm-up's
    stopped: Stopped | None = None


@dataclass
class ServingResult:
    docs: int
    steps_per_epoch: int
    tokenfeed: Figures
    ceiling: Figures


def write_config(path: Path, corpus: Path, tokenizer: Path, cache: Path, threads: int) -> None:
    config = {
        "server": {
            "listen": "127.0.0.1:0",
            "cache_dir": str(cache),
            "tokenize_threads": threads,
            "grace_seconds": GRACE_SECONDS,
        },
        "jobs": {
            JOB: {
                "sources": [str(corpus / "*")],
                "tokenizer": str(tokenizer),
                "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH,
                "seed": 1,
                "chunk_bytes": "256KiB",
                "window_chunks": 4,
            }
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def wait_ready(client: Client, timeout: float) -> int:
    """Steps per epoch, once the job has indexed its whole corpus."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.describe()
        if info["state"] == "JOB_STATE_READY":
            return int(info["steps_per_epoch"])  # int64 fields arrive as JSON strings
        if info["state"] == "JOB_STATE_FAILED":
            raise RuntimeError(f"job {JOB} failed: {info['error']}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {JOB} not ready after {timeout:.0f}s: {info}")
        time.sleep(0.1)


def warm_up(client: Client, steps: int) -> list[str]:
    """Fetch every step once (opens and verifies every chunk); the fingerprint of each."""
    return [client.get_batch(step, rank=0, world_size=1).fingerprint for step in range(steps)]


def measure_unary(
    client: Client, calls: int, steps: int, figures: Figures, expected: list[str] | None
) -> None:
    tokens = 0
    start = time.perf_counter()
    for i in range(calls):
        step = i % steps
        before = time.perf_counter()
        batch = client.get_batch(step, rank=0, world_size=1)
        figures.latencies.append(time.perf_counter() - before)
        tokens += batch["input_ids"].size
        if expected is not None and batch.fingerprint != expected[step]:
            figures.mismatches += 1
    figures.unary_rates.append(tokens / (time.perf_counter() - start))


def measure_stream(
    client: Client, total: int, steps: int, figures: Figures, expected: list[str] | None
) -> None:
    """Stream `total` steps as streams of at most one epoch, so every step stays warm."""
    tokens = 0
    start = time.perf_counter()
    while total > 0:
        n = min(steps, total)
        for step, batch in enumerate(client.iter_batches(0, n)):
            tokens += batch["input_ids"].size
            if expected is not None and batch.fingerprint != expected[step]:
                figures.mismatches += 1
        total -= n
    figures.stream_rates.append(tokens / (time.perf_counter() - start))


def server_processes(work: Path, config: Path) -> tuple[ServerProcess, ServerProcess]:
    tokenfeed = [
        str(Path(sys.executable).parent / "tokenfeed"),
        "serve",
        "--config",
        str(config),
        "--listen",
        "127.0.0.1:0",
    ]
    ceiling = [
        sys.executable,
        "-m",
        "bench.ceiling",
        "--rows",
        str(GLOBAL_BATCH),
        "--seq-len",
        str(SEQ_LEN),
    ]
    return ServerProcess("tokenfeed", tokenfeed, work), ServerProcess("ceiling", ceiling, work)


def alternate(
    sizes: ServingSizes,
    clients: dict[str, Client],
    steps: int,
    expected: dict[str, list[str] | None],
    figures: dict[str, Figures],
) -> None:
    """Each round measures both servers, unary then stream, so drifts hit both alike."""
    for _ in range(sizes.rounds):
        for name, client in clients.items():
            measure_unary(client, sizes.unary_calls, steps, figures[name], expected[name])
        for name, client in clients.items():
            measure_stream(client, sizes.stream_steps, steps, figures[name], expected[name])


def run(sizes: ServingSizes, out: Path, threads: int) -> ServingResult:
    corpus, tokenizer, docs = democorpus.prepare(out / "democorpus")
    work = out / "serving"
    shutil.rmtree(work, ignore_errors=True)  # a fresh cache: the job indexes, then serves
    work.mkdir(parents=True)
    config = work / "tokenfeed.yaml"
    write_config(config, corpus, tokenizer, work / "cache", threads)
    real, ceiling = server_processes(work, config)
    figures = {"tokenfeed": Figures(), "ceiling": Figures()}
    with real, ceiling:
        with Client(real.start(START_TIMEOUT), job=JOB) as tf_client:
            steps = wait_ready(tf_client, READY_TIMEOUT)
            # tokenfeed's batches are checked against their warm-up: a pure function of the step.
            # The ceiling sends one canned batch, so there is nothing to check.
            expected = {"tokenfeed": warm_up(tf_client, steps), "ceiling": None}
            with Client(ceiling.start(START_TIMEOUT), job="ceiling") as cl_client:
                warm_up(cl_client, steps)
                clients = {"tokenfeed": tf_client, "ceiling": cl_client}
                alternate(sizes, clients, steps, expected, figures)
        figures["tokenfeed"].stopped = real.stop(GRACE_SECONDS + 10)
        figures["ceiling"].stopped = ceiling.stop(GRACE_SECONDS + 10)
    return ServingResult(docs, steps, figures["tokenfeed"], figures["ceiling"])
