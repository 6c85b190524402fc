"""`tokenfeed build`: tokenize a config's jobs into the token store offline, on every core.

The parent lists the sources and plans the chunks once; worker processes (one per core by
default) tokenize chunks in sample order and write them to the store: the local cache directory
(`server.cache_dir`), and the shared store when `store.uri` is set (then bodies are published
there and only manifests are kept locally). A chunk's manifest is its commit point, so a build
that is interrupted, even by kill -9, resumes by skipping every chunk whose manifest exists: only
unfinished chunks are redone, and the store ends byte-identical to an uninterrupted build's.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tokenfeed.server.cache import DiskCache
from tokenfeed.server.chunkfiles import ChunkIndex
from tokenfeed.server.chunks import Chunk
from tokenfeed.server.config import Config
from tokenfeed.server.diskfiles import lock_directory
from tokenfeed.server.errors import JobFailedError
from tokenfeed.server.job import Job
from tokenfeed.server.sharedstore import SharedStore
from tokenfeed.server.storage import Storage
from tokenfeed.server.tokstore import TokenStore


@dataclass(frozen=True)
class Done:
    """What a worker reports for one chunk."""

    dataset: int
    chunk: int
    entry: ChunkIndex
    units: int  # in the dataset's stream (index.py)
    raw_bytes: int
    tokenized: bool  # False: it was already in the store


def _job(config: Config, name: str, keep_bodies: bool, scan: bool = True) -> Job:
    # An unbounded cache over the cache directory: the build's output is the whole store.
    if scan:  # the parent owns the directory; its worker processes write into it
        lock_directory(Path(config.server.cache_dir), "tokenfeed build")
    cache = DiskCache(config.server.cache_dir, 2**62)
    storage = Storage(config.object_store, None)
    shared = SharedStore(config.store, storage) if config.store.uri else None
    job = Job(config.job(name), TokenStore(cache.root, cache, scan), storage, shared)
    if job.state == "failed":  # a one-shot command wants the error, not a retry
        raise JobFailedError(job.error)
    job.load_tokenizer()
    for idx in job.indexes:
        idx.keep_bodies = keep_bodies
    return job


_worker: Job | None = None


def _init_worker(config: Config, name: str, keep: bool) -> None:
    global _worker
    _worker = _job(config, name, keep, scan=False)  # the parent scanned (and cleaned) first


def _build_chunk(d: int, i: int, chunk: Chunk) -> Done:
    """In a worker process."""
    return build_chunk(_worker, d, i, chunk)


def chunk_builder(config: Config, name: str) -> Job:
    """A job that builds chunks another process planned (`build_chunk`): a `tokenfeed build`
    worker process, or a Ray task (raybuild.py). It keeps only manifests locally when the
    config has a shared store, and leaves the local store's scan to the planner."""
    return _job(config, name, not config.store.uri, scan=False)


def planned_job(config: Config, name: str) -> Job:
    """The job with every dataset's sources listed and its chunks planned (and, with a shared
    store, its inputs checked against the store's): what the builders are handed."""
    job = _job(config, name, not config.store.uri)
    for idx in job.indexes:
        idx.plan()
    return job


def build_chunk(job: Job, d: int, i: int, chunk: Chunk) -> Done:
    """Chunk i of dataset d, planned elsewhere, into `job`'s store (and published to the shared
    store): read from the store when it is there already, else tokenized. Its tokens depend on
    the chunk alone (its key is its content address), so it is indexed as a one-chunk plan."""
    idx = job.indexes[d]
    idx.adopt([chunk])
    key = idx.keys[0]
    had = idx.store.get_index(key) is not None or (
        idx.shared is not None and idx.shared.manifest(key) is not None
    )
    entry, units = idx.index_chunk(0)
    return Done(d, i, entry, units, chunk.raw_bytes, not had)


class Progress:
    """One line: chunks, documents, tokens, MB/s of source, ETA; redrawn in place on a TTY."""

    def __init__(self, out: TextIO, total_chunks: int, total_bytes: int, interval=1.0):
        self.out, self.interval = out, interval
        self.total_chunks, self.total_bytes = total_chunks, total_bytes
        self.chunks = self.skipped = self.docs = self.tokens = self.bytes = self.tokenized = 0
        self.started = self._drawn = time.monotonic()
        self.tty = out.isatty()

    def add(self, done: Done) -> None:
        self.chunks += 1
        self.docs += done.entry.num_docs
        self.tokens += done.entry.num_tokens
        if done.tokenized:
            self.tokenized += 1
            self.bytes += done.raw_bytes
        else:
            self.skipped += 1
            self.total_bytes -= done.raw_bytes
        if time.monotonic() - self._drawn >= self.interval or self.chunks == self.total_chunks:
            self.draw()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.bytes / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.chunks / max(self.total_chunks, 1)
        return (
            f"[{pct:5.1f}%] {self.chunks}/{self.total_chunks} chunks, {self.docs:,} docs, "
            f"{self.tokens:,} tokens, {rate / 1e6:.2f} MB/s, "
            f"{self.tokens / elapsed / 1e6:.2f} M tokens/s, ETA {eta}"
        )

    def draw(self) -> None:
        self._drawn = time.monotonic()
        if self.tty:
            self.out.write("\r" + self.line() + "\x1b[K")
        else:
            self.out.write(self.line() + "\n")
        self.out.flush()


def build(config: Config, names: list[str], workers: int, out: TextIO = sys.stderr) -> int:
    """Build the named jobs' token stores; returns the number of chunks tokenized."""
    keep = not config.store.uri
    tokenized = 0
    context = multiprocessing.get_context("spawn")
    for name in names:
        # Workers spawn at the first submit, after this process scanned (cleaned) the store.
        pool = cf.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_init_worker, initargs=(config, name, keep)
        )
        with pool:
            tokenized += _build_job(config, name, workers, pool, out)
    return tokenized


def _build_job(
    config: Config, name: str, workers: int, pool: cf.ProcessPoolExecutor, out: TextIO
) -> int:
    job = planned_job(config, name)
    todo = [(d, int(i)) for d, idx in enumerate(job.indexes) for i in idx.order0]
    # Chunks stored before (an earlier, interrupted build) are indexed from their manifests.
    before = {
        (d, i)
        for d, i in todo
        if job.indexes[d].store.get_index(job.indexes[d].keys[i]) is not None
    }
    total_bytes = sum(c.raw_bytes for idx in job.indexes for c in idx.chunks)
    print(
        f"job {name}: {len(todo)} chunks in {len(job.indexes)} dataset(s), "
        f"{total_bytes / 1e6:.1f} MB of sources; {len(before)} already in the store, "
        f"building the rest with {workers} process(es)",
        file=out,
        flush=True,
    )
    progress = Progress(out, len(todo), total_bytes)
    for d, i in before:
        idx = job.indexes[d]
        entry, units = idx.index_chunk(i)
        idx.record(i, entry, units)
        progress.add(Done(d, i, entry, units, idx.chunks[i].raw_bytes, False))
    futures = [
        pool.submit(_build_chunk, d, i, job.indexes[d].chunks[i])
        for d, i in todo
        if (d, i) not in before
    ]
    try:
        for future in cf.as_completed(futures):
            done = future.result()
            job.indexes[done.dataset].record(done.chunk, done.entry, done.units)
            progress.add(done)
    except BaseException:
        for f in futures:
            f.cancel()
        raise
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
