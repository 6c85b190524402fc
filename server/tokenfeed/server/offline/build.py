"""`tokenfeed build`: tokenize a config's jobs into the token store offline, on every core.

The parent lists the sources and plans the chunks once, then tokenizes chunks in sample order
itself, on every core, from the first moment; worker processes (up to `--workers` in all, one
per core by default, but no more than there are chunks, PROCESS_BYTES of sources or
CORES_PER_PROCESS cores for: see `processes`) take chunks too as soon as each is up; they start
before the job is planned, by `tokenfeed build` before it imports this module (buildpool.py).
Every one writes to the store: the local cache directory (`server.cache_dir`), and the shared
store when `store.uri` is set (then bodies are published there and only manifests are kept
locally).
Within a process, a chunk's reading, parsing and writing overlap its tokenizing where the
engine allows (chunkmaker.py); across processes, one process's serial parts overlap the
others' tokenizing.

One chunk's build is chunkbuild.py's and the progress line progressline.py's (both shared
with the Ray build, which reaches them through this module too). A chunk's manifest is its
commit point, so a build that is interrupted, even by kill -9, resumes by skipping every chunk
whose manifest exists: only unfinished chunks are redone, and the store ends byte-identical to
an uninterrupted build's.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import queue
import sys
import threading
import time
from typing import TextIO

from tokenfeed.server.indexing.index import DatasetIndex
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.offline.buildpool import (
    CORES_PER_PROCESS,
    Workers,
    available_cores,
    most_processes,
)
from tokenfeed.server.offline.buildpool import build_chunk as build_chunk_in_worker
from tokenfeed.server.offline.chunkbuild import (  # build_chunk, chunk_builder: for raybuild.py
    Done,
    build_chunk,  # noqa: F401
    build_in,
    chunk_builder,  # noqa: F401
    planned_job,
)
from tokenfeed.server.offline.progressline import ProgressLine
from tokenfeed.server.settings.config import Config

# Sources per worker process at least. A worker costs about 0.8 s of a core to start (a new
# Python, its imports, its tokenizer), but `tokenfeed build` starts its workers before it
# imports what a build needs (buildpool.py), so they start while this process starts, lists and
# plans: 4 MiB of text, about 1.3 s of a core with tiktoken (5 s with HF's engine), is worth one.
PROCESS_BYTES = 4 * 2**20
# Chunks this process builds at once: while one is read or written (I/O, no GIL), the other
# tokenizes; as in a server's `tokenize` pool (server.tokenize_threads, default 2).
LOCAL_THREADS = 2


def build(
    config: Config,
    names: list[str],
    workers: int,
    out: TextIO = sys.stderr,
    started: Workers | None = None,
) -> int:
    """Build the named jobs' token stores on up to `workers` processes, this one included;
    returns the number of chunks tokenized. `started`: one job's worker processes, started
    before this module was imported (buildpool.start_for); they end with the build."""
    total = 0
    try:
        for name in names:
            early = started if started is not None and started.name == name else None
            total += _build_job(config, name, workers, out, early)
    finally:
        if started is not None:
            started.shutdown()
    return total


def processes(workers: int, chunks: int, source_bytes: int, cores: int) -> int:
    """How many processes build `chunks` chunks of `source_bytes` in all on `cores` cores:
    `workers` at most, and no more than there are chunks, PROCESS_BYTES of sources or
    CORES_PER_PROCESS cores for."""
    most = min(chunks, math.ceil(source_bytes / PROCESS_BYTES), cores // CORES_PER_PROCESS)
    return max(1, min(workers, most))


class _Builders:
    """Hands a job's chunks out in sample order: to this process, which starts on the first at
    once (on LOCAL_THREADS threads, sharing the planned job's tokenizer and store), and to each
    worker process as soon as it is up, one chunk at a time. A worker's start-up (a new Python,
    its imports, its tokenizer: about a second) so costs nothing: the chunks go to whoever is
    ready, and a small corpus may be done before a worker is."""

    def __init__(self, job: Job, todo: list[tuple[int, int]], pool: cf.ProcessPoolExecutor | None):
        self.job, self.pool = job, pool
        self.pending = collections.deque(todo)
        # What the builders hand the main thread, tagged by kind: ("done", Done) from this
        # process's builders, ("failed", exception), ("ready" | "worker", cf.Future[Done]).
        self.results: queue.Queue[
            tuple[str, Done | BaseException | cf.Future[Done] | cf.Future[None]]
        ] = queue.Queue()
        self.futures: set[cf.Future] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Each thread its own indexes: building a chunk adopts it as a one-chunk plan.
        self.local = [self._indexes(job) for _ in range(LOCAL_THREADS)]
        self._threads = [
            threading.Thread(target=self._run_local, args=(mine,), name=f"build-{k}", daemon=True)
            for k, mine in enumerate(self.local)
        ]

    @staticmethod
    def _indexes(job: Job) -> list[DatasetIndex]:
        return [planned.sibling() for planned in job.indexes]

    def start(self, workers_ready: list[cf.Future]) -> None:
        for f in workers_ready:
            f.add_done_callback(lambda f: self.results.put(("ready", f)))
        for thread in self._threads:
            thread.start()

    def _next(self) -> tuple[int, int] | None:
        with self._lock:
            if self._stop.is_set() or not self.pending:
                return None
            return self.pending.popleft()

    def _run_local(self, indexes: list[DatasetIndex]) -> None:
        try:
            while (item := self._next()) is not None:
                d, i = item
                chunk = self.job.indexes[d].chunks[i]
                self.results.put(("done", build_in(indexes[d], d, i, chunk)))
        except BaseException as e:  # handed to the main thread, which raises it
            self.results.put(("failed", e))

    def _submit(self) -> None:
        item = self._next()
        if item is not None and self.pool is not None:
            d, i = item
            f = self.pool.submit(build_chunk_in_worker, d, i, self.job.indexes[d].chunks[i])
            self.futures.add(f)
            f.add_done_callback(lambda f: self.results.put(("worker", f)))

    def take(self) -> Done:
        """The next chunk built, by this process or a worker; raises what a build raised."""
        while True:
            kind, value = self.results.get()
            if isinstance(value, BaseException):  # "failed"
                raise value
            if not isinstance(value, cf.Future):  # "done"
                return value
            future = value
            self.futures.discard(future)
            if kind == "ready":
                future.result()  # raises: a worker that could not start, or make its job
                self._submit()
                continue
            done = future.result()
            self._submit()
            if done is None:  # only "ready" futures carry None
                raise RuntimeError(f"a build worker's future of kind {kind!r} held no chunk")
            return done

    def stop(self) -> None:
        """No chunk is handed out any more; this process's chunk in progress is abandoned at
        its next encode batch, the workers' are finished (the pool's shutdown waits)."""
        self._stop.set()
        for indexes in self.local:
            for idx in indexes:
                idx.cancel()
        for f in list(self.futures):
            f.cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()


def _build_job(config: Config, name: str, workers: int, out: TextIO, early: Workers | None) -> int:
    cores = available_cores()
    # The workers start before the job is planned: their start-up overlaps the planning.
    if early is None:
        early = Workers.start(config, name, most_processes(workers, cores) - 1)
    try:
        return _build_planned(planned_job(config, name), workers, cores, out, early)
    finally:
        early.shutdown()


def _build_planned(job: Job, workers: int, cores: int, out: TextIO, started: Workers) -> int:
    name = job.name
    todo = [(d, int(i)) for d, idx in enumerate(job.indexes) for i in idx.order0]
    # Chunks stored before (an earlier, interrupted build) are indexed from their manifests.
    before = {
        (d, i)
        for d, i in todo
        if job.indexes[d].store.get_index(job.indexes[d].keys[i]) is not None
    }
    total_bytes = sum(c.raw_bytes for idx in job.indexes for c in idx.chunks)
    left = [(d, i) for d, i in todo if (d, i) not in before]
    left_bytes = sum(job.indexes[d].chunks[i].raw_bytes for d, i in left)
    used = min(processes(workers, len(left), left_bytes, cores), len(started.ready) + 1)
    how = f"{used} process(es)"
    if used < workers:
        how = (
            f"{used} of {workers} process(es) (one per chunk, {PROCESS_BYTES >> 20} MiB and "
            f"{CORES_PER_PROCESS} of the {cores} cores at most)"
        )
    print(
        f"job {name}: {len(todo)} chunks in {len(job.indexes)} dataset(s), "
        f"{total_bytes / 1e6:.1f} MB of sources; {len(before)} already in the store, "
        f"building the rest with {how}",
        file=out,
        flush=True,
    )
    progress = ProgressLine(out, len(todo), total_bytes)
    for d, i in before:
        idx = job.indexes[d]
        entry, units = idx.index_chunk(i)
        idx.record(i, entry, units)
        progress.add(Done(d, i, entry, units, idx.chunks[i].raw_bytes, False))
    pool = started.pool if used > 1 else None
    builders = _Builders(job, left, pool)
    try:
        # This process builds from the first moment; each worker takes chunks once it is up
        # (most are by now: they started before the job was planned).
        builders.start(started.ready[: used - 1] if pool else [])
        for _ in left:
            done = builders.take()
            job.indexes[done.dataset].record(done.chunk, done.entry, done.units)
            progress.add(done)
    finally:
        builders.stop()
    if progress.tty:
        out.write("\n")
    for idx in job.indexes:
        idx.finish()
    elapsed = time.monotonic() - progress.started
    print(
        f"job {name}: built; tokenized {progress.tokenized} chunks, "
        f"{progress.skipped} were already in the store; {progress.bytes / 1e6:.1f} MB in "
        f"{elapsed:.1f}s; fingerprint {job.fingerprint}",
        file=out,
        flush=True,
    )
    return progress.tokenized
