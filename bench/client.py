"""Client and fleet: what the client costs per batch, how long a trainer waits on data, and how
long a SIGKILLed server stalls it.

Three `tokenfeed serve` processes share one config (each with its own cache directory) and stay
up for the whole section; the failover part kills one per repetition and restarts it on its
warm cache. Trainers "compute" by sleeping, so the client and the servers get the CPU that a
trainer waiting on a GPU would leave them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tokenfeed.client import Batch, Client
from tokenfeed.client.wire import TENSOR_NAMES
from tokenfeed.server.commands import democorpus
from tokenfeed.v1 import tokenfeed_pb2 as pb

from bench.procs import ServerProcess
from bench.serving import GRACE_SECONDS, READY_TIMEOUT, SEQ_LEN, START_TIMEOUT, wait_ready
from bench.stats import median

ONE_RANK = "rows8"  # one rank of world 1: the per-rank payload of sections 1 and 3
THREE_RANKS = "rows24"  # world 3 needs rows divisible by 3; 8 rows per rank, as above
ROWS = {ONE_RANK: 8, THREE_RANKS: 24}
SERVERS = 3
# A rank's compute per step: 2 ms alone, 6 ms each for three ranks, so the fleet is asked for
# 500 steps/s either way: about half of what one server streams on 2 cores, a sustainable rate.
COMPUTE_SECONDS = {1: 0.002, 3: 0.006}
REPEATS = 5  # timing repeats of the in-process costs; the median is reported
KILL_AT = 30  # batches delivered before the kill: well into the stream, queue and windows full
AFTER_FAILOVER = 20  # batches read from the new server before the repetition ends


@dataclass(frozen=True)
class ClientSizes:
    decodes: int  # decodes of one message per repeat and variant
    handoffs: int  # items passed through the queue per repeat
    trainer_steps: int  # steps each trainer consumes per run
    rounds: int  # alternating rounds of the 1-server and 3-server runs
    failovers: int  # kill repetitions


@dataclass(frozen=True)
class Failover:
    to_other: float  # seconds from SIGKILL to the first batch from another server
    longest_gap: float  # longest time between consecutive batches around the kill
    usual_gap: float  # median time between consecutive batches before the kill
    stale: int  # batches from the killed server delivered after the kill (already buffered)
    out_of_order: int  # batches whose step was not the next one


@dataclass
class ClientResult:
    costs: dict[str, float]  # label -> microseconds per batch
    # (ranks, servers) -> one (wait fraction, steps/s per rank, distinct servers) per round
    trainers: dict[tuple[int, int], list[tuple[float, float, int]]] = field(default_factory=dict)
    failovers: list[Failover] = field(default_factory=list)


def write_config(path: Path, corpus: Path, tokenizer: Path, threads: int) -> None:
    job = {
        "sources": [str(corpus / "*")],
        "tokenizer": str(tokenizer),
        "seq_len": SEQ_LEN,
        "seed": 1,
        "chunk_bytes": "256KiB",
        "window_chunks": 4,
    }
    config = {
        "server": {
            "listen": "127.0.0.1:0",
            "tokenize_threads": threads,
            "grace_seconds": GRACE_SECONDS,
        },
        "jobs": {name: {**job, "global_batch_size": rows} for name, rows in ROWS.items()},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


class Fleet:
    """Server processes over one config; `stack` kills whatever is still running on exit."""

    def __init__(self, work: Path, config: Path, stack: contextlib.ExitStack, warm: int):
        self.warm = warm
        exe = str(Path(sys.executable).parent / "tokenfeed")
        self.servers = [
            stack.enter_context(
                ServerProcess(
                    f"server{i}",
                    [
                        exe,
                        "serve",
                        "--config",
                        str(config),
                        "--listen",
                        "127.0.0.1:0",
                        "--cache-dir",
                        str(work / f"cache{i}"),
                    ],
                    work,
                )
            )
            for i in range(SERVERS)
        ]
        with ThreadPoolExecutor(SERVERS) as pool:  # indexing overlaps: a third of the wait
            list(pool.map(self._start, self.servers))

    def _start(self, server: ServerProcess) -> None:
        server.start(START_TIMEOUT)
        for job in ROWS:  # a job still indexing answers UNAVAILABLE: a failover of its own
            with Client(server.address, job=job) as client:
                wait_ready(client, READY_TIMEOUT)
                # The first pass over an epoch costs the server twice a warm one (window
                # permutations, chunk opens); the demo corpus has an epoch every 7-21 steps.
                for _ in client.iter_batches(0, self.warm):
                    pass

    @property
    def target(self) -> str:
        return ",".join(s.address for s in self.servers)

    def sigkill(self, address: str) -> ServerProcess:
        """Kill without reaping, so the trainer's clock sees only the signal being sent."""
        server = next(s for s in self.servers if s.address == address)
        os.kill(json.loads(server.ready_file.read_text())["pid"], signal.SIGKILL)
        return server

    def restart(self, server: ServerProcess) -> None:
        server.kill()  # reaps the killed process
        self._start(server)


def per_call_us(fn, calls: int) -> float:
    def once() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    return median([once() for _ in range(REPEATS)])


def handoff_us(item: Batch, items: int) -> float:
    """One put and one get through the prefetcher's kind of queue, producer in another thread:
    the thread switches and GIL hand-offs a trainer pays per batch, without any decoding."""

    def once() -> float:
        q: queue.Queue = queue.Queue(maxsize=4)
        producer = threading.Thread(target=lambda: [q.put(item, timeout=0.1) for _ in range(items)])
        start = time.perf_counter()
        producer.start()
        for _ in range(items):
            q.get()
        elapsed = time.perf_counter() - start
        producer.join()
        return elapsed / items * 1e6

    return median([once() for _ in range(REPEATS)])


def client_costs(address: str, sizes: ClientSizes) -> dict[str, float]:
    with Client(address, job=ONE_RANK) as client:
        request = pb.GetBatchRequest(job=ONE_RANK, step=0, rank=0, world_size=1)
        msg = client.stub(address).GetBatch(request)  # a real message, as gRPC hands it over
        wire = msg.SerializeToString()
        batch = Batch(msg)
        start = time.perf_counter()
        for _ in client.iter_batches(0, sizes.trainer_steps):
            pass
        flat_out = (time.perf_counter() - start) / sizes.trainer_steps * 1e6
    return {
        "protobuf parse": per_call_us(lambda: pb.Batch.FromString(wire), sizes.decodes),
        "Batch(msg), fingerprint verified": per_call_us(lambda: Batch(msg), sizes.decodes),
        "Batch(msg, verify=False)": per_call_us(lambda: Batch(msg, False), sizes.decodes),
        "Batch(msg) and all five int32 tensors": per_call_us(
            lambda: [Batch(msg)[name] for name in TENSOR_NAMES], sizes.decodes
        ),
        "prefetch queue hand-off": handoff_us(batch, sizes.handoffs),
        "iter_batches read flat out": flat_out,
    }


def trainer(target: str, job: str, rank: int, world: int, steps: int, start: threading.Barrier):
    """(seconds blocked in next(), wall seconds, servers seen), from the second batch on: the
    first one pays for opening the stream, once per run."""
    with Client(target, job=job) as client:
        batches = client.iter_batches(0, steps + 1, rank, world)
        try:
            servers = {next(batches).server}
            start.wait()
            waited, began = 0.0, time.perf_counter()
            for _ in range(steps):
                before = time.perf_counter()
                servers.add(next(batches).server)
                waited += time.perf_counter() - before
                time.sleep(COMPUTE_SECONDS[world])
            return waited, time.perf_counter() - began, servers
        except BaseException:
            start.abort()  # the other ranks stop waiting for this one
            raise
        finally:
            batches.close()


def trainers(target: str, ranks: int, steps: int) -> tuple[float, float, int]:
    job = ONE_RANK if ranks == 1 else THREE_RANKS
    start = threading.Barrier(ranks, timeout=READY_TIMEOUT)
    with ThreadPoolExecutor(ranks) as pool:
        runs = [pool.submit(trainer, target, job, r, ranks, steps, start) for r in range(ranks)]
        results = [run.result() for run in runs]
    waited = sum(r[0] for r in results)
    wall = sum(r[1] for r in results)
    return waited / wall, steps * ranks / wall, len(set().union(*(r[2] for r in results)))


def failover(fleet: Fleet, steps: int) -> tuple[Failover, ServerProcess]:
    times, servers, out_of_order = [], [], 0
    killed_at, victim, first_other = 0.0, None, None
    with Client(fleet.target, job=ONE_RANK) as client:
        batches = client.iter_batches(0, steps)
        try:
            for i, batch in enumerate(batches):
                times.append(time.perf_counter())
                servers.append(batch.server)
                out_of_order += batch.step != i
                if i == KILL_AT:
                    killed_at, victim = time.perf_counter(), fleet.sigkill(batch.server)
                elif victim and first_other is None and batch.server != victim.address:
                    first_other = i
                if first_other is not None and i >= first_other + AFTER_FAILOVER:
                    break
                time.sleep(COMPUTE_SECONDS[1])
        finally:
            batches.close()
    if victim is None or first_other is None:
        raise RuntimeError(f"no failover seen in {len(times)} batches from {set(servers)}")
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Failover(
        to_other=times[first_other] - killed_at,
        longest_gap=max(gaps[KILL_AT - 5 : first_other + 5]),
        usual_gap=median(gaps[:KILL_AT]),
        stale=first_other - KILL_AT - 1,
        out_of_order=out_of_order,
    ), victim


def run(sizes: ClientSizes, out: Path, threads: int) -> ClientResult:
    corpus, tokenizer, _ = democorpus.prepare(out / "democorpus")
    work = out / "client"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = work / "tokenfeed.yaml"
    write_config(config, corpus, tokenizer, threads)
    with contextlib.ExitStack() as stack:
        fleet = Fleet(work, config, stack, sizes.trainer_steps + 1)
        result = ClientResult(client_costs(fleet.servers[0].address, sizes))
        targets = {1: fleet.servers[0].address, SERVERS: fleet.target}
        for _ in range(sizes.rounds):  # alternating, so slow spells hit both fleet sizes
            for ranks in (1, 3):
                for count, target in targets.items():
                    figures = trainers(target, ranks, sizes.trainer_steps)
                    result.trainers.setdefault((ranks, count), []).append(figures)
        for i in range(sizes.failovers):
            figures, victim = failover(fleet, 10 * (KILL_AT + AFTER_FAILOVER))
            result.failovers.append(figures)
            if i + 1 < sizes.failovers:
                fleet.restart(victim)
        for server in fleet.servers:
            server.stop(GRACE_SECONDS + 10)
    return result
