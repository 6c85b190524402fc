"""The bare transport: a grpc.aio server-stream of opaque messages of a given size, and a reader
that only wraps each message's bytes with `np.frombuffer`. No tokenfeed code or message on
either side: the reference every serving figure is divided by (bench/wire.py).

    python -m bench.transport serve --bytes N [--procs P] --ready-file FILE
    python -m bench.transport read --target ADDR --messages N --tokens-per-message T [--sync]

The server answers one generic method (`/bench.Bare/Stream`, request and response raw bytes,
no (de)serializer) with the same pre-built `bytes` object over and over, `N` bytes each: gRPC
copies it into its frames as it does tokenfeed's serialized batches. `--procs P` starts P
processes on one port (SO_REUSEPORT, as `server.workers` does), so the reference of a
multi-worker server has as many serving processes. The reader prints one JSON line like
bench/consume.py's: {"tokens", "seconds", "batches", "began", "ended", "cpu", "bytes"}, and takes
its `--sync` (print "ready", start on a line on stdin).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
import numpy as np

METHOD = "/bench.Bare/Stream"
# The same limits a tokenfeed server and client set: messages of a [32, 4096] batch and more.
OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.so_reuseport", 1),
]


def _stream_handler(payload: bytes):
    async def stream(request: bytes, context):
        count = int.from_bytes(request[:8], "little") or 2**62
        for _ in range(count):
            yield payload

    return grpc.method_handlers_generic_handler(
        "bench.Bare",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream)},  # bytes in, bytes out
    )


async def _serve(port: int, size: int, ready=None) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((_stream_handler(bytes(os.urandom(size))),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


def _child(port: int, size: int, ready) -> None:
    import uvloop

    uvloop.run(_serve(port, size, ready))


def serve(size: int, procs: int, ready_file: Path) -> None:
    """`procs` server processes on one free port; the ready file names the address and every
    serving pid (the first is this process)."""
    with socket.socket() as s:  # a free port, held with SO_REUSEPORT while the servers bind
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        children = []
        for _ in range(procs - 1):
            ready = ctx.Event()
            p = ctx.Process(target=_child, args=(port, size, ready), daemon=True)
            p.start()
            ready.wait(60)
            children.append(p)

    def announce() -> None:
        info = {"address": f"127.0.0.1:{port}", "pid": os.getpid()}
        info["workers"] = [p.pid for p in children]
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(ready_file)

    import uvloop

    async def main() -> None:
        task = asyncio.create_task(_serve(port, size, None))
        await asyncio.sleep(0.2)
        announce()
        await task

    try:
        uvloop.run(main())
    finally:
        for p in children:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
            p.join(5)


def read(target: str, messages: int, tokens_per_message: int, sync: bool = False) -> dict:
    """Stream `messages` messages and wrap each with np.frombuffer, nothing else."""
    with grpc.insecure_channel(target, options=OPTIONS) as channel:
        call = channel.unary_stream(METHOD)  # no (de)serializer: bytes both ways
        for msg in call((1).to_bytes(8, "little")):  # connected before the clock starts
            np.frombuffer(msg, dtype=np.uint8)
        got = size = 0
        if sync:
            print("ready", flush=True)
            sys.stdin.readline()
        wall, began, cpu = time.time(), time.perf_counter(), time.process_time()
        for msg in call(messages.to_bytes(8, "little")):
            view = np.frombuffer(msg, dtype=np.uint8)
            size += view.size
            got += 1
        seconds = time.perf_counter() - began
        cpu = time.process_time() - cpu
    return {
        "cpu": cpu,
        "tokens": got * tokens_per_message,
        "seconds": seconds,
        "batches": got,
        "began": wall,
        "ended": wall + seconds,
        "bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--procs", type=int, default=1)
    s.add_argument("--ready-file", type=Path, required=True)
    r = sub.add_parser("read")
    r.add_argument("--target", required=True)
    r.add_argument("--messages", type=int, required=True)
    r.add_argument("--tokens-per-message", type=int, required=True)
    r.add_argument("--sync", action="store_true")
    a = parser.parse_args()
    if a.mode == "serve":
        serve(a.bytes, a.procs, a.ready_file)
    else:
        print(json.dumps(read(a.target, a.messages, a.tokens_per_message, a.sync)))


if __name__ == "__main__":
    main()
