"""A consumer process for the wire benchmarks: streams or fetches steps and reports a rate.

    python -m bench.consume --target ADDR --job JOB --steps N [--mode stream|unary|raw]
                            [--rank R --world W] [--start S] [--wrap E] [--sync]

Prints one JSON line: {"tokens", "seconds", "batches", "began", "ended", "cpu"} (began and
ended: wall-clock times, so the runs of several consumers can be put on one clock; cpu: this
process's CPU seconds over the run). `raw` reads the
stream with a bare gRPC stub and touches only the message's token bytes; the other modes use
the real client (decode, fingerprint check, `input_ids` and `labels` as int32 arrays), as a
trainer does. `--wrap E` reads steps start .. start + E - 1 over and over (E: the steps of one
epoch): warm serving, a second row of the benchmark; training reads each row once, streaming on
through epoch ends, which `--wrap 0` (the default) does. `--sync` prints "ready" once connected
and starts when a line arrives on stdin, so several consumers start together.
`--keep-freed-memory` tunes the process's allocator first, as a trainer may (docs/client.md);
the benchmark's tables leave it off. Run as a
separate process so the consumer never shares a GIL with the server or another consumer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# As a trainer's script does: the client first, so that it chooses how grpc reads this process's
# sockets (tokenfeed/client/_grpcsetting.py), for the Client and the raw stub alike.
from tokenfeed.client import Client

# isort: split
import grpc
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

OPTIONS = [("grpc.max_receive_message_length", 1 << 30)]


def spans(start: int, steps: int, wrap: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `steps` steps, none longer than `wrap` (0: no limit)."""
    out, left = [], steps
    while left > 0:
        n = min(left, wrap) if wrap else left
        out.append((start, start + n))
        left -= n
    return out


def wait_for_go() -> None:
    """Say "ready" and wait for the line that starts every consumer at once."""
    print("ready", flush=True)
    sys.stdin.readline()


def consume(
    target: str,
    job: str,
    start: int,
    steps: int,
    mode: str,
    rank: int,
    world: int,
    wrap: int = 0,
    sync: bool = False,
    prefetch: int | None = None,
) -> dict:
    tokens = batches = 0
    if mode == "raw":
        with grpc.insecure_channel(target, options=OPTIONS) as channel:
            stub = pb_grpc.TokenFeedStub(channel)
            if sync:
                wait_for_go()
            wall, began, cpu = time.time(), time.perf_counter(), time.process_time()
            for a, b in spans(start, steps, wrap):
                request = pb.StreamBatchesRequest(
                    job=job, start_step=a, end_step=b, rank=rank, world_size=world
                )
                for msg in stub.StreamBatches(request):
                    tokens += msg.rows * msg.seq_len
                    batches += 1
            seconds = time.perf_counter() - began
        return _figures(tokens, seconds, batches, wall, time.process_time() - cpu)
    with Client(target, job=job, **({} if prefetch is None else {"prefetch": prefetch})) as client:
        client.describe()  # connected before the clock starts (no row read: each is read once)
        if sync:
            wait_for_go()
        wall, began, cpu = time.time(), time.perf_counter(), time.process_time()
        if mode == "stream":
            batch_iter = (
                batch
                for a, b in spans(start, steps, wrap)
                for batch in client.iter_batches(a, b, rank, world)
            )
        else:
            batch_iter = (
                client.get_batch(s, rank, world)
                for a, b in spans(start, steps, wrap)
                for s in range(a, b)
            )
        for batch in batch_iter:
            ids, labels = batch["input_ids"], batch["labels"]  # what every trainer reads
            tokens += ids.size
            batches += 1
            assert labels.shape == ids.shape
        seconds = time.perf_counter() - began
    return _figures(tokens, seconds, batches, wall, time.process_time() - cpu)


def _figures(tokens: int, seconds: float, batches: int, wall: float, cpu: float) -> dict:
    return {
        "cpu": cpu,
        "tokens": tokens,
        "seconds": seconds,
        "batches": batches,
        "began": wall,
        "ended": wall + seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--mode", choices=("stream", "unary", "raw"), default="stream")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--wrap", type=int, default=0)
    parser.add_argument("--sync", action="store_true", help="start on a line on stdin")
    parser.add_argument("--prefetch", type=int, help="the Client's prefetch (default: its own)")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="tune this process's allocator first (tokenfeed.client.keep_freed_memory)",
    )
    a = parser.parse_args()
    if a.keep_freed_memory:
        # Imported here: `--before REV` runs this script over an earlier client, which may
        # predate it.
        from tokenfeed.client import keep_freed_memory

        keep_freed_memory()
    figures = consume(
        a.target, a.job, a.start, a.steps, a.mode, a.rank, a.world, a.wrap, a.sync, a.prefetch
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
