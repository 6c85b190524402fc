"""The raw gRPC ceiling: a minimal server that answers tokenfeed's RPCs with one pre-built batch.

Same generated protos, same server options, same event loop (grpc.aio on uvloop) as the daemon,
and the same token count as raw int32 bytes: one int32 token array [rows, seq_len + 1] and no
document boundaries, with a valid fingerprint, so the client decodes and verifies exactly as it
does against tokenfeed (whose tokens travel as uint16 when the vocabulary fits). It does no work
per request beyond what gRPC itself does, so it measures what the transport and the client cost
on this machine.

    python -m bench.ceiling --rows 8 --seq-len 2048 --ready-file FILE [--listen 127.0.0.1:0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import grpc
import numpy as np
import uvloop
from tokenfeed.client import wire
from tokenfeed.server.pack.packing import TENSOR_NAMES
from tokenfeed.server.serve.front import GRPC_OPTIONS
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

JOB = "ceiling"
# Far beyond any stream the benchmark asks for; a stream with end_step 0 runs until cancelled.
ENDLESS = 2**62


def make_batch(rows: int, seq_len: int, vocab: int = 4096) -> pb.Batch:
    """A batch of the same token count as raw int32, random ids (gRPC ignores content)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (rows, seq_len + 1), dtype=np.int32)
    compact = wire.compact_from_starts(tokens, np.zeros(tokens.shape, dtype=bool))
    return pb.Batch(job=JOB, step=0, rank=0, world_size=1, **wire.encode(compact))


class CeilingServicer(pb_grpc.TokenFeedServicer):
    def __init__(self, batch: pb.Batch, rows: int, seq_len: int):
        self.batch = batch
        self.info = pb.JobInfo(
            name=JOB,
            state=pb.JOB_STATE_READY,
            seq_len=seq_len,
            global_batch_size=rows,
            steps_per_epoch=ENDLESS,
            tensor_names=list(TENSOR_NAMES),
        )

    # The step is set on the shared message just before it is handed to gRPC, which serializes
    # it before this coroutine runs again: clients check that each batch carries its step.
    async def GetBatch(self, request, context):
        self.batch.step = request.step
        return self.batch

    async def StreamBatches(self, request, context):
        for step in range(request.start_step, request.end_step or ENDLESS):
            self.batch.step = step
            yield self.batch

    async def DescribeJob(self, request, context):
        return self.info

    async def ListJobs(self, request, context):
        return pb.ListJobsResponse(jobs=[self.info])


async def serve(listen: str, ready_file: Path, rows: int, seq_len: int) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    servicer = CeilingServicer(make_batch(rows, seq_len), rows, seq_len)
    pb_grpc.add_TokenFeedServicer_to_server(servicer, server)
    port = server.add_insecure_port(listen)
    await server.start()
    address = f"{listen.rsplit(':', 1)[0]}:{port}"
    tmp = ready_file.with_name(ready_file.name + ".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    tmp.replace(ready_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--ready-file", required=True, type=Path)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.listen, args.ready_file, args.rows, args.seq_len))


if __name__ == "__main__":
    main()
