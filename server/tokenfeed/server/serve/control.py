"""The control socket between a supervisor and its serving workers (`server.workers` > 1).

The supervisor owns the cache: it plans and tokenizes every chunk, evicts, prefetches and
answers for the budget. Workers serve gRPC on the shared port and only read the token store.
They ask the supervisor, over a Unix socket in the cache directory, for what only the owner
may do:

- `chunks(job)`: the planned chunk list of each of the job's datasets (listed once, by the
  supervisor, so every process has the same chunk keys);
- `ensure(job, dataset, chunk)`: make a chunk's body present (rebuilt if it was evicted or
  found corrupt), so the worker can map it;
- `progress(notes)`: the steps trainers asked for, so prefetch and eviction follow them.

Messages are pickled tuples over `multiprocessing.connection` with an authentication key that
only the supervisor's children know. Each worker thread keeps its own connection; the
supervisor answers each connection in a thread of its own (the requests are blocking disk or
tokenizer work, or a hop to the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client as _Connect
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from tokenfeed.server.errors import (
    BadRecordError,
    JobFailedError,
    NotReadyError,
    SourceChangedError,
    SourceError,
    StoreCorruptError,
    SupervisorUnavailable,
    TokenfeedError,
)
from tokenfeed.server.indexing.index import JobState

log = logging.getLogger(__name__)


PLAN_WAIT_SECONDS = 0.05  # how often `chunks` looks again while the supervisor still plans
# The errors a worker raises again as they are (their gRPC status is what the client needs).
_PASSED_ON = {
    cls.__name__: cls
    for cls in (BadRecordError, JobFailedError, SourceError, SourceChangedError, StoreCorruptError)
}


class Supervised:
    """The supervisor's side: answers workers' requests about its jobs (app.Job objects)."""

    def __init__(
        self,
        path: Path,
        jobs: dict,
        loop: asyncio.AbstractEventLoop,
        on_metrics: Callable[[int, list], None] | None = None,
    ):
        self.path, self.jobs, self.loop, self.on_metrics = path, jobs, loop, on_metrics
        self.authkey = os.urandom(32)
        path.unlink(missing_ok=True)
        self._listener = Listener(str(path), family="AF_UNIX", authkey=self.authkey)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):  # closed, or a peer that failed the handshake
                if self._closed.is_set():
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply: tuple[object, ...] = ("ok", self._handle(*request))
                except TokenfeedError as e:
                    reply = ("error", type(e).__name__, str(e))
                except Exception as e:  # a bug or a local failure: the worker reports it
                    log.exception("control request %s failed", request[0])
                    reply = ("error", type(e).__name__, f"{type(e).__name__}: {e}")
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return

    def _handle(self, op: str, *args):
        if op == "chunks":
            return self._chunks(*args)
        if op == "ensure":
            name, d, c = args
            idx = self.jobs[name].indexes[d]
            # Pinned while built: admitted to the cache whatever Belady would say, since a
            # worker is about to map it.
            with idx.store.cache.pinned([("chunk", idx.keys[c])]):
                idx.ensure_chunk(c, body=True)
            return None
        if op == "progress":
            self.loop.call_soon_threadsafe(self._note, *args)
            return None
        if op == "metrics":
            if self.on_metrics is not None:
                self.on_metrics(*args)
            return None
        raise ValueError(f"unknown control request {op!r}")

    def _chunks(self, name: str, timeout: float, at_least: int = 0):
        job = self.jobs[name]
        deadline = time.monotonic() + timeout
        if len(job.indexes) < at_least and job.plans.keeper is not None:
            job.plans.keeper.refresh()  # a worker's plan is newer: datasets were added
        while any(not idx.chunks for idx in job.indexes):
            if job.state == JobState.FAILED:
                raise JobFailedError(job.error)
            if time.monotonic() > deadline:
                raise NotReadyError(f"job {name}: sources still being listed", retry_after=1.0)
            time.sleep(PLAN_WAIT_SECONDS)
        return [idx.chunks for idx in job.indexes]

    def _note(self, notes: list[tuple[str, int, int, int]], served: dict[str, int]) -> None:
        for name, step, rank, world_size in notes:
            job = self.jobs.get(name)
            if job is not None:
                job.note_request(step, rank, world_size)
        for name, tokens in served.items():
            if name in self.jobs:
                self.jobs[name].progress.tokens_served += tokens


class SupervisorLink:
    """A worker's side: blocking calls (run them off the event loop), one connection per
    thread, reconnected after the supervisor restarts or a call fails."""

    def __init__(self, path: str, authkey: bytes):
        self.path, self.authkey = path, authkey
        self._local = threading.local()
        self._notes: dict[tuple[str, int, int], int] = {}
        self._served: dict[str, int] = {}
        self._notes_lock = threading.Lock()

    def _conn(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _Connect(self.path, family="AF_UNIX", authkey=self.authkey)
            self._local.conn = conn
        return conn

    def call(self, op: str, *args):
        try:
            conn = self._conn()
            conn.send((op, *args))
            reply = conn.recv()
        except (OSError, EOFError) as e:
            self._local.conn = None
            raise SupervisorUnavailable(
                f"the supervisor of this server is not answering ({e})"
            ) from None
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        raise _PASSED_ON.get(kind, SupervisorUnavailable)(message)

    def chunks(self, job: str, timeout: float = 5.0, at_least: int = 0) -> list:
        return self.call("chunks", job, timeout, at_least)

    def ensure(self, job: str, dataset: int, chunk: int) -> None:
        self.call("ensure", job, dataset, chunk)

    # Progress is coalesced: the latest step per (job, rank, world_size), sent every
    # FLUSH_SECONDS, not one message per request.
    FLUSH_SECONDS = 0.05

    def note(self, job: str, step: int, rank: int, world_size: int) -> None:
        with self._notes_lock:
            key = (job, rank, world_size)
            self._notes[key] = max(step, self._notes.get(key, -1))

    def served(self, job: str, tokens: int) -> None:
        with self._notes_lock:
            self._served[job] = self._served.get(job, 0) + tokens

    def flush(self) -> None:
        with self._notes_lock:
            notes, self._notes = self._notes, {}
            served, self._served = self._served, {}
        if notes or served:
            self.call("progress", [(j, s, r, w) for (j, r, w), s in notes.items()], served)

    async def flush_forever(self, run: Callable) -> None:
        """Send the progress notes every FLUSH_SECONDS (`run` runs a blocking call off the
        loop), until cancelled; a supervisor that does not answer loses only notes."""
        while True:
            await asyncio.sleep(self.FLUSH_SECONDS)
            try:
                await run(self.flush)
            except SupervisorUnavailable:
                pass
