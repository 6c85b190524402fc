"""A consumer process for the wire benchmarks: streams or fetches steps and reports a rate.

    python -m bench.consume --target ADDR --job JOB --steps N [--mode stream|unary|raw]
                            [--rank R --world W] [--start S]

Prints one JSON line: {"tokens", "seconds", "batches"}. `raw` reads the stream with a bare gRPC
stub and touches only the message's token bytes (the wire's own cost); the other modes use the
real client (decode, fingerprint check, `input_ids` and `labels` as int32 arrays), as a trainer
does. Run as a separate process so the consumer never shares a GIL with the server or another
consumer.
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


def consume(target: str, job: str, start: int, steps: int, mode: str, rank: int,
            world: int) -> dict:  # fmt: skip
    tokens = batches = 0
    if mode == "raw":
        with grpc.insecure_channel(target, options=OPTIONS) as channel:
            stub = pb_grpc.TokenFeedStub(channel)
            request = pb.StreamBatchesRequest(job=job, start_step=start, end_step=start + steps,
                                              rank=rank, world_size=world)  # fmt: skip
            began = time.perf_counter()
            for msg in stub.StreamBatches(request):
                tokens += msg.rows * msg.seq_len
                batches += 1
            seconds = time.perf_counter() - began
        return {"tokens": tokens, "seconds": seconds, "batches": batches}
    with Client(target, job=job) as client:
        client.get_batch(start, rank, world)  # connected and warm before the clock starts
        began = time.perf_counter()
        if mode == "stream":
            batch_iter = client.iter_batches(start, start + steps, rank, world)
        else:
            batch_iter = (client.get_batch(s, rank, world) for s in range(start, start + steps))
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
    a = parser.parse_args()
    print(json.dumps(consume(a.target, a.job, a.start, a.steps, a.mode, a.rank, a.world)))


if __name__ == "__main__":
    main()
