"""`tokenfeed build --ray [ADDRESS]`: tokenize a config's jobs as Ray tasks across a Ray
cluster's CPUs, publishing every chunk to the shared store (`store.uri`).

The driver (this process) plans the chunks once, lists which of them the store holds already
(a LIST per 1,000 objects, not a GET per chunk), and submits the rest in sample order as tasks
of a few chunks each. A task builds its chunks exactly as a `tokenfeed build` worker process
does (build.build_chunk): the same bytes, published by the same code. The store writes a
chunk's manifest last (SharedStore.publish), so nothing partial is ever visible:
- a task whose worker dies (SIGKILL, OOM, a lost node) is retried by Ray (`TASK_RETRIES`) from
  its first chunk; a chunk the lost attempt published is found in the store and not redone;
- a driver that dies leaves whole chunks (and perhaps bodies without a manifest, rewritten with
  the same bytes later); a rerun lists the store and builds only the rest.
Each worker process indexes into a private scratch directory that it empties after every chunk:
a retried task must never take a local manifest for a published chunk.

Ray is imported by this module alone; the server never imports it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

import ray
import ray.exceptions
from tokenfeed.server.errors import ConfigError, LocalError, TokenfeedError
from tokenfeed.server.indexing.chunkmaker import BAD_EXAMPLES_PER_CHUNK
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.offline import build
from tokenfeed.server.settings.config import Config
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.tokenizer import ENGINE_PROCESSES_ENV

TASK_RETRIES = 3  # attempts after the first when a worker process dies mid-task
# Chunks per task: enough tasks for every CPU to take several (the last ones end close
# together), but no more source per task than a few minutes of one core (~6 MB/s, bench/raybuild),
# which is what a lost worker costs again. Ray's own cost per task is about a millisecond.
TASKS_PER_CPU = 4
TASK_BYTES = 1 << 30
LIST_THREADS = 8  # LIST requests in flight while the driver looks for published chunks
BAD_SHOWN = 10  # bad record locations printed in the summary


@dataclasses.dataclass
class Summary:
    """What one job's Ray build did."""

    chunks: int = 0  # chunks of the job
    before: int = 0  # published before this run (listed, not read)
    tokenized: int = 0  # tokenized and published by this run's tasks
    found: int = 0  # published when their task came to them (a retried task, or a server)
    docs: int = 0  # of the chunks this run's tasks indexed
    tokens: int = 0
    raw_bytes: int = 0  # source bytes tokenized
    bad: Counter[str] = dataclasses.field(default_factory=Counter)
    bad_examples: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    fingerprint: str = ""  # the job's (DescribeJob's): known from the plan

    def add(self, done: build.Done) -> None:
        self.docs += done.entry.num_docs
        self.tokens += done.entry.num_tokens
        if done.tokenized:
            self.tokenized += 1
            self.raw_bytes += done.raw_bytes
        else:
            self.found += 1
        self.bad.update(done.entry.bad)
        self.bad_examples += done.entry.bad_examples[: BAD_SHOWN - len(self.bad_examples)]


def build_on_ray(
    config: Config,
    names: list[str],
    address: str,
    cpus: int = 0,
    out: TextIO = sys.stderr,
    interval: float = 1.0,
) -> list[Summary]:
    """Build the named jobs' chunks into the shared store on the Ray cluster at `address`
    (a local Ray when empty, with `cpus` CPUs if given)."""
    if not config.store.uri:
        raise ConfigError(
            f"{config.origin}: `tokenfeed build --ray` publishes to the shared store, and the "
            "config has none: add a `store:` section with `uri: s3://bucket/prefix/` (or a "
            "directory every Ray node mounts)"
        )
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=cpus or None, include_dashboard=False, logging_level=logging.WARNING)
    try:
        return [_build_job(config, name, out, interval) for name in names]
    finally:
        ray.shutdown()


def _build_job(config: Config, name: str, out: TextIO, interval: float) -> Summary:
    started = time.monotonic()
    job = build.planned_job(config, name)
    shared = job.indexes[0].shared
    assert shared is not None  # a shared store was checked for above
    keys = [(d, int(i), idx.keys[int(i)]) for d, idx in enumerate(job.indexes) for i in idx.order0]
    have = published(shared, [k for _, _, k in keys])
    todo = [(d, i, job.indexes[d].chunks[i]) for d, i, key in keys if key not in have]
    summary = Summary(chunks=len(keys), before=len(keys) - len(todo), fingerprint=job.fingerprint)
    cpus = max(int(ray.cluster_resources().get("CPU", 1)), 1)
    batches = batch(todo, cpus)
    todo_bytes = sum(c.raw_bytes for _, _, c in todo)
    print(
        f"job {name}: {len(keys)} chunks in {len(job.indexes)} dataset(s); "
        f"{summary.before} already published to {config.store.uri}; building the other "
        f"{len(todo)} ({todo_bytes / 1e6:.1f} MB of sources) as {len(batches)} Ray task(s) "
        f"on {cpus} CPU(s)",
        file=out,
        flush=True,
    )
    progress = build.ProgressLine(out, len(todo), todo_bytes, interval)
    config_ref = ray.put(config)
    pending = {build_chunks.remote(config_ref, name, b): b for b in batches}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=interval)
            for ref in ready:
                del pending[ref]
                for done in _result(ref):
                    summary.add(done)
                    progress.add(done)
            if not ready and progress.chunks < len(todo):
                progress.draw()  # a line per interval even while every task is long
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    if progress.tty:
        out.write("\n")
    summary.seconds = time.monotonic() - started
    report(name, summary, out)
    return summary


def published(shared: SharedStore, keys: list[str]) -> set[str]:
    """The keys among `keys` whose manifest is in the store: listed one `chunks/<key[:2]>/`
    prefix at a time (up to 256 prefixes, a LIST per 1,000 objects each), several at once."""
    prefixes = sorted({k[:2] for k in keys})
    with ThreadPoolExecutor(LIST_THREADS) as pool:
        listings = list(pool.map(lambda p: shared.blobs.modified(f"chunks/{p}/"), prefixes))
    names = set().union(*listings)
    return {k for k in keys if f"{k}.json" in names}


def batch(todo: list[tuple[int, int, Chunk]], cpus: int) -> list[list[tuple[int, int, Chunk]]]:
    """Consecutive chunks (in sample order) in tasks of at most `len(todo) / (TASKS_PER_CPU *
    cpus)` chunks and `TASK_BYTES` of source (a larger chunk is a task of its own)."""
    most = max(math.ceil(len(todo) / (TASKS_PER_CPU * cpus)), 1)
    batches: list[list[tuple[int, int, Chunk]]] = []
    size = 0
    for item in todo:
        raw = item[2].raw_bytes
        if not batches or len(batches[-1]) >= most or size + raw > TASK_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += raw
    return batches


def _result(ref: ray.ObjectRef) -> list[build.Done]:
    """A task's Dones, or its error as tokenfeed's own (the command line prints those)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, TokenfeedError):
            raise e.cause from None
        raise
    except (
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.ObjectLostError,
    ) as e:
        raise LocalError(
            f"a Ray task died {TASK_RETRIES + 1} times building its chunks ({e}); every chunk "
            "published so far is kept: run the same command again to build the rest"
        ) from None


def report(name: str, s: Summary, out: TextIO) -> None:
    bad = sum(s.bad.values())
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(s.bad.items()))
    print(
        f"job {name}: built on Ray; {s.chunks} chunks: tokenized {s.tokenized}, "
        f"{s.before} were already published, {s.found} were found published when their "
        f"task ran; {s.docs:,} documents, {s.tokens:,} tokens, {bad} bad record(s)"
        f"{f' ({reasons})' if bad else ''}; {s.raw_bytes / 1e6:.1f} MB in "
        f"{s.seconds:.1f}s; fingerprint {s.fingerprint}",
        file=out,
    )
    for example in s.bad_examples:
        print(f"  bad record: {example}", file=out)
    if bad > len(s.bad_examples):
        print(
            f"  ... and {bad - len(s.bad_examples)} more (each chunk's manifest lists its "
            f"first {BAD_EXAMPLES_PER_CHUNK} in `bad_examples`)",
            file=out,
        )
    out.flush()


# ---------------------------------------------------------------- in the Ray worker processes

_jobs: dict[str, Job] = {}  # a Ray worker process serves one driver: one config


def _worker_job(config: Config, name: str) -> Job:
    job = _jobs.get(name)
    if job is None:
        # As many Ray workers as the node has cores may build at once, each with a tiktoken
        # engine: each takes that share of the memory for its threads' own Encodings.
        os.environ.setdefault(ENGINE_PROCESSES_ENV, str(os.cpu_count() or 1))
        scratch = _scratch()
        server = dataclasses.replace(config.server, cache_dir=str(scratch / name))
        job = _jobs[name] = build.chunk_builder(dataclasses.replace(config, server=server), name)
    return job


@functools.cache
def _scratch() -> Path:
    """This worker process's scratch directory, `<tmp>/tokenfeed-ray/<pid>`. Ray ends worker
    processes without running atexit, so each new one first removes those of dead ones."""
    root = Path(tempfile.gettempdir()) / "tokenfeed-ray"
    for other in root.glob("*"):
        try:
            os.kill(int(other.name), 0)
        except ProcessLookupError:
            shutil.rmtree(other, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not ours, or alive under another user
    mine = root / str(os.getpid())
    mine.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, mine, True)
    return mine


@ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)
def build_chunks(config: Config, name: str, items: list[tuple[int, int, Chunk]]):
    """A task: build and publish each chunk of `items`, (dataset, chunk id, chunk)."""
    job = _worker_job(config, name)
    dones = []
    for d, i, chunk in items:
        dones.append(build.build_chunk(job, d, i, chunk))
        # Published: the scratch copy goes (not through the cache, which would log a drop).
        root, key = job.indexes[d].store.root, job.indexes[d].keys[0]
        for suffix in ("json", "bin", "idx", "rec"):
            (root / key[:2] / f"{key}.{suffix}").unlink(missing_ok=True)
    return dones
