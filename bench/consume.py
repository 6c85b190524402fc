"""A consumer process for the wire benchmarks: streams or fetches steps and reports a rate.

    python -m bench.consume --target ADDR --job JOB --steps N [--mode stream|unary|raw]
                            [--rank R --world W] [--start S] [--wrap E]

Prints one JSON line: {"tokens", "seconds", "batches"}. `raw` reads the stream with a bare gRPC
stub and touches only the message's token bytes (the wire's own cost); the other modes use the
real client (decode, fingerprint check, `input_ids` and `labels` as int32 arrays), as a trainer
does. `--wrap E` reads steps start .. start + E - 1 over and over (E: the steps of one epoch),
so a small corpus measures warm serving, as a corpus of production size would. Run as a
separate process so the consumer never shares a GIL with the server or another consumer.
"""

from __future__ import annotations

import argparse
import json
import time

import grpc
from tokenfeed.client import Client
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


def consume(
    target: str, job: str, start: int, steps: int, mode: str, rank: int, world: int, wrap: int = 0
) -> dict:
    tokens = batches = 0
    if mode == "raw":
        with grpc.insecure_channel(target, options=OPTIONS) as channel:
            stub = pb_grpc.TokenFeedStub(channel)
            began = time.perf_counter()
            for a, b in spans(start, steps, wrap):
                request = pb.StreamBatchesRequest(
                    job=job, start_step=a, end_step=b, rank=rank, world_size=world
                )
                for msg in stub.StreamBatches(request):
                    tokens += msg.rows * msg.seq_len
                    batches += 1
            seconds = time.perf_counter() - began
        return {"tokens": tokens, "seconds": seconds, "batches": batches}
    with Client(target, job=job) as client:
        client.get_batch(start, rank, world)  # connected and warm before the clock starts
        began = time.perf_counter()
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
    return {"tokens": tokens, "seconds": seconds, "batches": batches}


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
    a = parser.parse_args()
    print(json.dumps(consume(a.target, a.job, a.start, a.steps, a.mode, a.rank, a.world, a.wrap)))


if __name__ == "__main__":
    main()
