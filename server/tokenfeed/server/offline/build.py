"""`tokenfeed build`: tokenize a config's jobs into the token store offline, on every core.

The parent lists the sources and plans the chunks once, then tokenizes chunks in sample order
itself, on every core, from the first moment; worker processes (up to `--workers` in all, one
per core by default, but no more than there are chunks, PROCESS_BYTES of sources or
CORES_PER_PROCESS cores for: see `processes`) take chunks too as soon as each is up. Every one
writes to the store: the local cache directory (`server.cache_dir`), and the shared store when
`store.uri` is set (then bodies are published there and only manifests are kept locally).
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
import multiprocessing
import os
import queue
import sys
import threading
import time
from typing import TextIO

from tokenfeed.server.indexing.index import DatasetIndex
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.offline.chunkbuild import (
    Done,
    build_chunk,
    build_in,
    chunk_builder,
    planned_job,
)
from tokenfeed.server.offline.progressline import ProgressLine
from tokenfeed.server.settings.config import Config
from tokenfeed.server.source.chunks import Chunk

# Sources per worker process at least. A process costs about a second of a core to start
# (a new Python and its imports; bench/tokenization.py); this one tokenizes on every core from
# the start, so another is worth starting only for work well beyond that: 128 MiB of text is
# about a minute of a core with HF's engine, 20 s with tiktoken.
PROCESS_BYTES = 128 * 2**20
# Cores per process at least. Every process's tokenizer runs on all cores; another process pays
# off where one cannot keep them busy (its GIL: parsing, and tiktoken's per-document calls).
# On 2 cores a second process made a 47 MB build slower (tiktoken: 6.0-9.8 s against 4.9-8.4 s
# alone, 4 rounds) and HF's no faster, so 2 cores get one.
CORES_PER_PROCESS = 2


# Chunks this process builds at once: while one is read or written (I/O, no GIL), the other
# tokenizes; as in a server's `tokenize` pool (server.tokenize_threads, default 2).
LOCAL_THREADS = 2


_worker: Job | None = None


def _init_worker(config: Config, name: str) -> None:
    global _worker
    _worker = chunk_builder(config, name)


def _build_chunk(d: int, i: int, chunk: Chunk) -> Done:
    """In a worker process."""
    if _worker is None:
        raise RuntimeError("a build worker process was started without _init_worker")
    return build_chunk(_worker, d, i, chunk)


def build(config: Config, names: list[str], workers: int, out: TextIO = sys.stderr) -> int:
    """Build the named jobs' token stores on up to `workers` processes, this one included;
    returns the number of chunks tokenized."""
    return sum(_build_job(config, name, workers, out) for name in names)


def processes(workers: int, chunks: int, source_bytes: int, cores: int) -> int:
    """How many processes build `chunks` chunks of `source_bytes` in all on `cores` cores:
    `workers` at most, and no more than there are chunks, PROCESS_BYTES of sources or
    CORES_PER_PROCESS cores for."""
    most = min(chunks, math.ceil(source_bytes / PROCESS_BYTES), cores // CORES_PER_PROCESS)
    return max(1, min(workers, most))


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _ready() -> None:
    """In a worker process: nothing; its answer says the process is up (its initializer ran)."""


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
            f = self.pool.submit(_build_chunk, d, i, self.job.indexes[d].chunks[i])
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
                future.result()  # a worker that could not start: BrokenProcessPool
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


def _build_job(config: Config, name: str, workers: int, out: TextIO) -> int:
    job = planned_job(config, name)
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
    cores = available_cores()
    used = processes(workers, len(left), left_bytes, cores)
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
    pool = None
    if used > 1:
        pool = cf.ProcessPoolExecutor(
            used - 1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(config, name),
        )
    builders = _Builders(job, left, pool)
    try:
        # Worker processes start now, after the scan above cleaned the store; this process
        # builds from the first moment, so their start-up delays nothing.
        builders.start([pool.submit(_ready) for _ in range(used - 1)] if pool else [])
        for _ in left:
            done = builders.take()
            job.indexes[done.dataset].record(done.chunk, done.entry, done.units)
            progress.add(done)
    finally:
        builders.stop()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
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
