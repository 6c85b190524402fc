"""One chunk built wherever a builder runs it (this process, a `tokenfeed build` worker process
or a Ray task, raybuild.py): the job that builds chunks planned elsewhere, the planned job, and a
chunk built as a one-chunk plan (read from the store when it is there already), reported as a
`Done`."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfeed.server.indexing.index import DatasetIndex
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.jobs.stack import open_build
from tokenfeed.server.settings.config import Config
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.store.chunkfiles import ChunkIndex


@dataclass(frozen=True)
class Done:
    """What a worker reports for one chunk."""

    dataset: int
    chunk: int
    entry: ChunkIndex
    units: int  # in the dataset's stream (index.py)
    raw_bytes: int
    tokenized: bool  # False: it was already in the store


def chunk_builder(config: Config, name: str) -> Job:
    """A job that builds chunks another process planned (`build_chunk`): a `tokenfeed build`
    worker process, or a Ray task (raybuild.py). It keeps only manifests locally when the
    config has a shared store, and leaves the local store's scan to the planner."""
    return open_build(config, [name], planner=False).jobs[name]


def planned_job(config: Config, name: str) -> Job:
    """The job with every dataset's sources listed and its chunks planned (and, with a shared
    store, its inputs checked against the store's): what the builders are handed."""
    job = open_build(config, [name], planner=True).jobs[name]
    for idx in job.indexes:
        idx.plan()
    return job


def build_chunk(job: Job, d: int, i: int, chunk: Chunk) -> Done:
    """Chunk i of dataset d, planned elsewhere, into `job`'s store (and published to the shared
    store): read from the store when it is there already, else tokenized. Its tokens depend on
    the chunk alone (its key is its content address), so it is indexed as a one-chunk plan."""
    return build_in(job.indexes[d], d, i, chunk)


def build_in(idx: DatasetIndex, d: int, i: int, chunk: Chunk) -> Done:
    """Chunk i of dataset d through `idx` (whose plan it replaces with the chunk alone)."""
    idx.adopt([chunk])
    key = idx.keys[0]
    had = idx.store.get_index(key) is not None or (
        idx.shared is not None and idx.shared.manifest(key) is not None
    )
    entry, units = idx.index_chunk(0)
    return Done(d, i, entry, units, chunk.raw_bytes, not had)
