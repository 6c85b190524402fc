"""A server that comes back is asked again as soon as it can be reached, not when the client's
backoff pause would have ended (_comeback.py): sync calls, streams and the asyncio client, in a
trainer's process with the client's gRPC setting (GRPC_EXPERIMENTS=-event_engine_client, where
a channel reconnects only while polled: _grpcsetting.py) and with gRPC's defaults. A pause
before a server that answered (its connection up) is waited out in full.

A `Door` is a real gRPC server on a fixed loopback port that forwards to a real tokenfeed
server: shut, its port refuses connections, as a restarting server's does; opened again, it
listens on the same port. The clients back off 4-8 s a round (`backoff=8`), so a call that
waited its pause out could not come back within 3.5 s of the door shutting."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from forward import Forwarder
from tokenfeed.client import AsyncClient, Client
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

BACKOFF = {"backoff": 8.0, "max_backoff": 8.0, "timeout": 60.0}
SHUT_SECONDS = 1.0
WITHIN = 3.5  # seconds from shutting the door to the answer (a full pause: 4 s at least)


class Door(Forwarder):
    """Forwards to `upstream` on one port; `refusals` calls are answered UNAVAILABLE first."""

    def __init__(self, upstream: str, refusals: int = 0):
        super().__init__(upstream)
        self.refusals, self.calls = refusals, []
        self.port = 0
        self.server: grpc.Server | None = None
        self.open()
        self.address = f"127.0.0.1:{self.port}"

    def open(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_TokenFeedServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def shut(self) -> None:
        assert self.server is not None
        self.server.stop(None)

    def shut_for(self, seconds: float) -> threading.Thread:
        """Shut now, open again `seconds` later (in a thread, returned)."""
        self.shut()

        def later():
            time.sleep(seconds)
            self.open()

        t = threading.Thread(target=later, daemon=True)
        t.start()
        return t

    def _gate(self, context) -> None:
        self.calls.append(time.monotonic())
        if self.refusals > 0:
            self.refusals -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "not now")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(None)
        self.close_upstream()


@pytest.fixture
def door(server):
    d = Door(server.address)
    yield d
    d.close()


def reference(server, steps: int) -> list[str]:
    with Client(server.address, job="main") as c:
        return [c.get_batch(s).fingerprint for s in range(steps)]


def test_a_call_reaches_a_server_back_before_its_backoff_ends(server, door):
    with Client(door.address, job="main", **BACKOFF) as c:
        first = c.get_batch(0).fingerprint
        opened = door.shut_for(SHUT_SECONDS)
        shut = time.monotonic()
        second = c.get_batch(1).fingerprint
        took = time.monotonic() - shut
        opened.join()
    assert [first, second] == reference(server, 2)
    assert SHUT_SECONDS <= took < WITHIN, took


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stream_reaches_a_server_back_before_its_backoff_ends(server, door, prefetch):
    got, gaps = [], []
    with Client(door.address, job="main", prefetch=prefetch, **BACKOFF) as c:
        last = time.monotonic()
        for batch in c.iter_batches(0, 40):
            got.append(batch.fingerprint)
            now = time.monotonic()
            gaps.append(now - last)
            if len(got) == 5:
                door.shut_for(SHUT_SECONDS)
            last = time.monotonic()
    assert got == reference(server, 40)
    assert max(gaps) < WITHIN, gaps


def test_the_asyncio_client_reaches_a_server_back_before_its_backoff_ends(server, door):
    async def main() -> tuple[list[str], float, float]:
        async with AsyncClient(door.address, job="main", **BACKOFF) as c:
            got = [(await c.get_batch(0)).fingerprint]
            door.shut_for(SHUT_SECONDS)
            shut = time.monotonic()
            got.append((await c.get_batch(1)).fingerprint)
            unary = time.monotonic() - shut
            worst, last = 0.0, time.monotonic()
            async for batch in c.iter_batches(2, 40):
                got.append(batch.fingerprint)
                worst, last = max(worst, time.monotonic() - last), time.monotonic()
                if batch.step == 6:
                    door.shut_for(SHUT_SECONDS)
                    last = time.monotonic()
            return got, unary, worst

    got, unary, worst = asyncio.run(main())
    assert got == reference(server, 40)
    assert SHUT_SECONDS <= unary < WITHIN, unary
    assert worst < WITHIN, worst


def test_a_pause_before_a_server_that_answered_is_waited_out(server):
    door = Door(server.address, refusals=1)
    try:
        with Client(door.address, job="main", backoff=2.0, max_backoff=2.0) as c:
            batch = c.get_batch(0)
        assert batch.fingerprint == reference(server, 1)[0]
        # Refused with the connection up: the pause (1-2 s) is not cut short by the channel.
        assert len(door.calls) == 2 and door.calls[1] - door.calls[0] >= 0.95, door.calls
    finally:
        door.close()


# A trainer's process: calls one step at a time, the door shut meanwhile.
TRAINER = """
import json, sys, time
from tokenfeed.client import Client, grpc_setting
target = sys.argv[1]
with Client(target, job="main", backoff=8.0, max_backoff=8.0, timeout=60.0) as c:
    fps, worst = [c.get_batch(0).fingerprint], 0.0
    print("started", flush=True)
    for step in range(1, 30):
        t = time.monotonic()
        fps.append(c.get_batch(step).fingerprint)
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.1)
print(json.dumps({"fps": fps, "worst": worst, "setting": grpc_setting()}))
"""


@pytest.mark.parametrize(
    "grpc_experiments, setting",
    [
        (None, "GRPC_EXPERIMENTS=-event_engine_client"),  # the client's choice
        ("", "left alone: GRPC_EXPERIMENTS is set ('')"),  # gRPC's defaults
    ],
)
def test_a_trainer_process_reaches_a_server_back_as_soon(server, door, grpc_experiments, setting):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if grpc_experiments is not None:
        env["GRPC_EXPERIMENTS"] = grpc_experiments
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, door.address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "started", proc.stderr.read()[-3000:]
        time.sleep(0.5)
        door.shut_for(SHUT_SECONDS).join()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["setting"].startswith(setting), got["setting"]
    assert got["fps"] == reference(server, 30)
    assert SHUT_SECONDS - 0.2 <= got["worst"] < WITHIN, got["worst"]
