"""The one place that builds a config's jobs and the chain they stand on: the disk cache, object
storage (its S3 blocks kept in the cache), the token store, the fleet's shared store, and the
jobs over them, with the eviction policy that knows the jobs' future. Every process gets its
stack here, by role:

- `open_server`: the process that owns the cache directory (a lone server, or the supervisor of
  serving workers): the directory's lock, the byte budget, the block cache, eviction;
- `open_worker`: a serving worker: a read-only view of the token store, and the supervisor
  (`upstream`) for what only the owner does;
- `open_build`: `tokenfeed build` and its chunk builders (worker processes, Ray tasks): an
  unbounded cache over the directory (the build's output is the whole store), no block cache.

Nothing else constructs these objects (tests/unit/test_imports.py checks that the classes are
called here only).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from tokenfeed.server.dataplan.keeper import PlanKeeper
from tokenfeed.server.diskcache.cache import DiskCache
from tokenfeed.server.diskcache.diskfiles import lock_directory
from tokenfeed.server.errors import ConfigError, JobFailedError
from tokenfeed.server.jobs.future import FutureUse
from tokenfeed.server.jobs.job import Job, JobState, Upstream
from tokenfeed.server.objstore.blockfiles import BlockFiles
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.pack.arenaformat import node_dir, remove
from tokenfeed.server.pack.sharedrows import SharedRows
from tokenfeed.server.settings.config import Config
from tokenfeed.server.store.blobs import CacheBlobs, LocalBlobs, S3Blobs
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.store.tokstore import TokenStore, TokenStoreView


@dataclass
class Stack:
    config: Config
    storage: ObjectStorage
    store: TokenStore
    shared: SharedStore | None
    jobs: dict[str, Job]

    @property
    def cache(self) -> DiskCache:
        return self.store.cache


def check_budget(config: Config) -> None:
    """Refuse to start when the cache cannot hold the raw chunks tokenized at once (the token
    working set is checked per job once its chunk sizes are known: Job.working_set)."""
    s = config.server
    for job in config.jobs:
        for d in job.datasets:
            if any(src.pattern.startswith("s3://") for src in d.sources):
                need = s.tokenize_threads * (d.chunk_bytes + 2 * config.object_store.block_bytes)
                if need > s.cache_bytes:
                    raise ConfigError(
                        f"server.cache_bytes: {s.cache_bytes} bytes cannot hold the raw data of "
                        f"{s.tokenize_threads} chunks of job {job.name} tokenized at once "
                        f"(chunk_bytes {d.chunk_bytes} plus two blocks each); it needs at "
                        f"least {need} bytes"
                    )


def plan_keepers(
    config: Config, storage: ObjectStorage, cache: DiskCache | None
) -> dict[str, PlanKeeper]:
    """Each job's plan log: under the shared store's prefix for a fleet (every server reads and
    writes the same log), else in the cache directory (every process of this server; counted
    under the budget by the process that owns the cache, `cache`)."""
    uri = config.store.uri
    blobs: LocalBlobs | S3Blobs
    if uri.startswith("s3://"):
        blobs, where = S3Blobs(storage.s3(), uri), uri
    elif uri:
        blobs, where = LocalBlobs(uri), uri
    else:
        # A cache directory's log is this host's alone: named with the host, so that clients
        # comparing servers' plans tell two servers' own logs apart (client/_plans.py).
        where = f"{socket.gethostname()}:{config.server.cache_dir}"
        blobs = CacheBlobs(cache) if cache is not None else LocalBlobs(config.server.cache_dir)
    return {
        spec.name: PlanKeeper(spec, blobs, where, config.origin, config.server.plan_freeze_steps)
        for spec in config.jobs
    }


def open_server(config: Config, shared_rows: bool = False) -> Stack:
    """The stack of the process that owns the cache directory (this process's alone while it
    lives: its rescan removes partial writes); a supervisor of serving workers
    (`shared_rows`) lays its row buffers out into the node's shared ones."""
    lock_directory(Path(config.server.cache_dir), "this process")
    cache = DiskCache(config.server.cache_dir, config.server.cache_bytes)
    storage = ObjectStorage(config.object_store, BlockFiles(cache))
    store = TokenStore(cache.root, cache)
    shared = SharedStore(config.store, storage) if config.store.uri else None
    # A supervisor of serving workers lays out row buffers ahead for them (jobs/layahead.py)
    # into the node's shared ones.
    rows = None
    if shared_rows:  # an earlier run's arena goes first: this server's workers map this one
        root = node_dir(config.server.cache_dir)
        remove(root)
        rows = SharedRows(root, config.server.stream_cache_bytes)
    keepers = plan_keepers(config, storage, cache)
    jobs = _jobs(config, store, storage, shared, None, keepers, rows)
    cache.set_policy(FutureUse(list(jobs.values())))
    return Stack(config, storage, store, shared, jobs)


def open_worker(config: Config, upstream: Upstream) -> Stack:
    """A serving worker's stack: it reads the token store the supervisor owns, and asks it
    (`upstream`) for chunk lists and evicted bodies. Its object storage serves Explain's reads
    only: no block cache here."""
    store = TokenStoreView(config.server.cache_dir)
    storage = ObjectStorage(config.object_store)
    # Row buffers laid out once for every worker of the node (pack/sharedrows.py).
    rows = SharedRows(node_dir(config.server.cache_dir), config.server.stream_cache_bytes)
    keepers = plan_keepers(config, storage, None)
    jobs = _jobs(config, store, storage, None, upstream, keepers, rows)
    return Stack(config, storage, store, None, jobs)


def _jobs(
    config: Config,
    store: TokenStore,
    storage: ObjectStorage,
    shared: SharedStore | None,
    upstream: Upstream | None,
    keepers: dict[str, PlanKeeper],
    rows: SharedRows | None = None,
) -> dict[str, Job]:
    """A serving process's jobs: each with its plan log's keeper."""
    return {
        spec.name: Job(
            spec,
            store,
            storage,
            shared,
            upstream,
            config.server.stream_cache_bytes,
            keepers[spec.name],
            rows,
        )
        for spec in config.jobs
    }


def open_build(config: Config, names: list[str], *, planner: bool) -> Stack:
    """The stack of an offline build of the named jobs: the planning process (`planner`: it
    owns the directory and rescans it first) or one of its chunk builders (a worker process or
    a Ray task: the planner scanned already). With a shared store only manifests are kept
    locally (the store has the bodies). Raises JobFailedError for a job that cannot build."""
    if planner:
        lock_directory(Path(config.server.cache_dir), "tokenfeed build")
    cache = DiskCache.unbounded(config.server.cache_dir)
    storage = ObjectStorage(config.object_store, None)
    store = TokenStore(cache.root, cache, planner)
    shared = SharedStore(config.store, storage) if config.store.uri else None
    jobs = {}
    for name in names:
        job = Job(config.job(name), store, storage, shared)
        if job.state == JobState.FAILED:  # a one-shot command wants the error, not a retry
            raise JobFailedError(job.error)
        job.load_tokenizer()
        for idx in job.indexes:
            idx.keep_bodies = not config.store.uri
        jobs[name] = job
    return Stack(config, storage, store, shared, jobs)


def object_storage(config: Config) -> ObjectStorage:
    """Object storage as the config says, without a cache: for a command that reads a
    tokenizer or lists sources without serving."""
    return ObjectStorage(config.object_store)


def build_jobs(config: Config) -> dict[str, Job]:
    """The jobs of a config over one disk cache, as a server owns them (tools and tests that
    build or inspect jobs in process)."""
    return open_server(config).jobs
