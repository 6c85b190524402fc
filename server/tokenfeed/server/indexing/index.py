"""A dataset's token index: list its sources, plan its chunks, make sure each is tokenized.

A job has one index per dataset (one for a plain job). `DatasetIndex.build` runs listing and
tokenization in worker threads, several chunks at once, in the epoch-0 chunk order (schedule.py
picks each worker's next chunk); while it runs, epoch 0's rows of the leading windows whose
chunks are all built (`rows_built`, kept by builtrows.py) can be served. With a shared store
(sharedstore.py), chunks are read from it when published, chunks assigned to other live nodes
wait for them, and chunks tokenized here are published. Outcomes:
- READY: every chunk is stored; documents and tokens per chunk are known (`num_docs`,
  `num_tokens`). The dataset's fingerprint (its chunks' keys) is known once it is planned.
- FAILED: the data itself refuses the job (a bad record under `strict`, a source that matches
  nothing or changed after it was pinned, a corpus too small for one row). Every server would
  reach the same verdict, so clients are told so (FAILED_PRECONDITION).
- anything else (an I/O error on this server's disk, a bug) is this server's problem: the build
  is retried with backoff while requests get UNAVAILABLE, so clients fail over.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from enum import StrEnum

import numpy as np
from tokenfeed.server.errors import (
    BuildCancelled,
    LocalError,
    NotReadyError,
    SourceError,
    TokenfeedError,
)
from tokenfeed.server.indexing import listing
from tokenfeed.server.indexing.builtrows import BuiltRows, epoch0_order
from tokenfeed.server.indexing.chunkkeys import ChunkKeys
from tokenfeed.server.indexing.chunkmaker import ChunkMaker, MakerSetup
from tokenfeed.server.indexing.owner import ChunkOwner
from tokenfeed.server.indexing.schedule import build_in_order
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.server.settings.config import DatasetSpec, JobSpec
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.store.chunkfiles import ChunkIndex
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.store.tokstore import TokenChunk, TokenStore
from tokenfeed.server.telemetry import metrics
from tokenfeed.server.tokenizer.tokenize import TextTokenizer

log = logging.getLogger(__name__)


class JobState(StrEnum):
    """Where a dataset's index (and a job, from its datasets') stands. A StrEnum: its values
    are the words the status page, logs and metrics show."""

    INDEXING = "indexing"
    READY = "ready"
    FAILED = "failed"


INDEXING, READY, FAILED = JobState.INDEXING, JobState.READY, JobState.FAILED
RETRY_SECONDS = (1.0, 60.0)  # first and longest pause between builds after a local failure
POLL_SECONDS = 0.5  # how often a chunk another node tokenizes is looked for in the shared store
WORKER_POLL_SECONDS = 0.05  # how often a serving worker looks for the supervisor's manifests


class DatasetIndex:
    def __init__(
        self,
        spec: JobSpec,
        dataset: DatasetSpec,
        store: TokenStore,
        tokenizer: TextTokenizer | None,
        storage: ObjectStorage,
        shared: SharedStore | None = None,
        owner: ChunkOwner | None = None,
        position: int | None = None,
        seq_len: int | None = None,
    ):
        self.spec, self.dataset, self.store = spec, dataset, store
        self._tokenizer = tokenizer
        self.storage, self.shared = storage, shared
        # In a serving worker (control.py): the owner of the cache plans and tokenizes; this
        # index only reads the manifests it commits, and asks it for evicted bodies.
        self.owner = owner
        # Its place in the job: the config's datasets, then those its data plan adds.
        self.position = spec.datasets.index(dataset) if position is None else position
        self.name = (
            spec.name
            if len(spec.datasets) == 1 and self.position == 0
            else f"{spec.name}/{dataset.name}"
        )
        # The sequence length of the phase that made the dataset known: its rows are cut
        # with it until a phase changes it (sampling/planner.py's segments).
        self.seq_len = spec.seq_len if seq_len is None else seq_len
        self.chunks: list[Chunk] = []
        self.keys = ChunkKeys([])
        self.num_docs = np.zeros(0, dtype=np.int64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.body_bytes = np.zeros(0, dtype=np.int64)
        self.bad_records: Counter[str] = Counter()
        self.state: JobState = INDEXING
        self.error, self.fingerprint = "", ""
        # The dataset's stream (order.py): units per chunk (concat: tokens of the chunk's packed
        # stream; best_fit: its rows); row r is units [r*per_row, r*per_row + span).
        if spec.packing == "concat":
            self.per_row, self.span = self.seq_len, self.seq_len + 1
        else:
            self.per_row, self.span = 1, 1
        self.units_per_chunk = np.zeros(0, dtype=np.int64)
        self.units_per_epoch = 0  # known once READY
        # Serving while building: chunks are built in epoch 0's order, and the rows of the
        # leading windows whose chunks (and the units their last row reads on into) are all
        # built can be served before the rest exists.
        self.built = BuiltRows(spec.window_chunks, self.per_row, self.span)
        self.listeners: list[Callable[[], None]] = []  # told when rows_built grows
        self.started = time.monotonic()
        self._cancel = threading.Event()
        setup = MakerSetup(
            self.name,
            spec.name,
            self.position,
            spec.bad_records == "strict",
            store,
            storage,
            shared,
            owner,
        )
        self.maker = ChunkMaker(setup, self._cancel)
        self.maker.tokenizer = tokenizer

    @property
    def rows_per_epoch(self) -> int:
        """Rows that start in an epoch, at least (an epoch's first and last rows may be shared
        with its neighbours: rows run on from one epoch into the next)."""
        return self.units_per_epoch // self.per_row

    @property
    def order0(self) -> np.ndarray:
        """Epoch 0's chunk order: the order chunks are built in."""
        return self.built.order0

    @property
    def rows_built(self) -> int:
        """Epoch-0 rows [0, rows_built) are built: they can be served before READY."""
        return self.built.rows

    @property
    def chunks_indexed(self) -> int:
        return int((self.num_docs >= 0).sum())

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def build(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        """Build until READY or FAILED, retrying failures local to this server (or, without
        `retry`, failing on them too: a one-shot command wants the error, not a wait)."""
        pause = RETRY_SECONDS[0]
        while not self._cancel.is_set():
            try:
                await self._build_once(executor, parallel)
                return
            except LocalError as e:  # this server's cache or network path: retried here
                log.warning("job %s: %s; retrying in %.0fs", self.name, e, pause)
                self.error = f"index build failed on this server: {e}"
                self._tell()  # waiting requests go elsewhere now
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_SECONDS[1])
            except BuildCancelled:
                return
            except TokenfeedError as e:
                self._fail(str(e))
                return
            except Exception as e:  # local: disk, memory, a bug; another server may do better
                if not retry:
                    self._fail(f"index build failed: {type(e).__name__}: {e}")
                    return
                log.exception(
                    "job %s: index build failed here; retrying in %.0fs", self.name, pause
                )
                self.error = f"index build failed on this server: {type(e).__name__}: {e}"
                self._tell()
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_SECONDS[1])

    async def _build_once(self, executor: Executor, parallel: int) -> None:
        loop = asyncio.get_running_loop()
        if not self.chunks and self.owner is not None:  # planned once, by the owner
            planned = await loop.run_in_executor(
                executor, self.owner.chunks, self.spec.name, 5.0, self.position + 1
            )
            if len(planned) <= self.position:
                raise LocalError(
                    f"the process that owns the cache does not know dataset "
                    f"{self.dataset.name} yet (its data plan is older)"
                )
            self.adopt(planned[self.position])
        elif not self.chunks:
            await loop.run_in_executor(executor, self.plan)
            self.store.cache.claim(
                self.raw_claim,
                self.raw_working_set(parallel),
                f"job {self.name} (the raw data of {parallel} chunks tokenized at once)",
            )
        todo = [int(i) for i in self.order0 if self.num_docs[i] < 0]
        poll = POLL_SECONDS if self.owner is None else WORKER_POLL_SECONDS
        await build_in_order(
            todo,
            self.built.position0,
            self.index_or_defer,
            lambda i, got: self.record(i, *got),
            executor,
            parallel,
            poll,
            self._cancel,
        )
        if self._cancel.is_set():
            raise BuildCancelled
        self.finish()

    @property
    def raw_claim(self) -> str:
        return f"{self.name}#raw"

    def raw_working_set(self, parallel: int) -> int:
        """Cache bytes for the raw data of `parallel` of its chunks tokenized at once."""
        block = self.storage.object_store.block_bytes
        return listing.raw_working_set(self.chunks, block, parallel)

    def plan(self) -> None:
        """List the sources and plan the chunks (in a worker thread)."""
        # Tar and Arrow shards are walked once, then their indexes kept in the token store.
        chunks = listing.list_chunks(
            self.name, self.dataset, self.storage, self.store.shard_indexes
        )
        self.adopt(chunks)
        if self.shared is not None:
            self.shared.check_dataset(self.dataset.name, self.inputs(chunks))
            self.shared.join()

    def inputs(self, chunks: list[Chunk]) -> dict:
        """What the chunks are made from, as a shared store records it (listing.inputs)."""
        return listing.inputs(chunks, self.tokenizer.chunk_digest, self.dataset.chunk_bytes)

    def adopt(self, chunks: list[Chunk]) -> None:
        """Take a planned chunk list (from `plan`, or from the process that planned it)."""
        self.keys = ChunkKeys([c.key(self.tokenizer.chunk_digest) for c in chunks])
        self.num_docs = np.full(len(chunks), -1, dtype=np.int64)
        self.num_tokens = np.full(len(chunks), -1, dtype=np.int64)
        self.body_bytes = np.zeros(len(chunks), dtype=np.int64)
        self.units_per_chunk = np.zeros(len(chunks), dtype=np.int64)
        order0 = epoch0_order(len(chunks), self.spec.seed, self.dataset.name)
        self.built = BuiltRows(self.spec.window_chunks, self.per_row, self.span, order0)
        self.fingerprint = self._fingerprint()
        self.chunks = chunks

    def sibling(self) -> DatasetIndex:
        """A new index of the same dataset over the same store, tokenizer and object storage
        (an offline build gives each of its threads its own)."""
        twin = DatasetIndex(
            self.spec,
            self.dataset,
            self.store,
            self._tokenizer,
            self.storage,
            self.shared,
            position=self.position,
            seq_len=self.seq_len,
        )
        twin.keep_bodies = self.keep_bodies
        return twin

    @property
    def keep_bodies(self) -> bool:
        """False in an offline build into a shared store: only manifests are kept here."""
        return self.maker.keep_bodies

    @keep_bodies.setter
    def keep_bodies(self, keep: bool) -> None:
        self.maker.keep_bodies = keep

    def index_or_defer(self, i: int, since: float) -> tuple[ChunkIndex, int] | None:
        """Runs in a worker thread: chunk i indexed (index_chunk), or None to come back to it
        later (another node's or the owner's, not there yet)."""
        if self.maker.find_or_defer(i, self.keys[i], self.chunks[i], since) is None:
            return None
        return self.index_chunk(i)

    def index_chunk(self, i: int) -> tuple[ChunkIndex, int]:
        """Runs in a worker thread: the chunk's entry and its units in the dataset's stream."""
        if self.spec.packing == "concat":
            entry = self.ensure_chunk(i)
            return entry, packing.concat_units(
                entry.num_tokens, entry.num_docs, self.tokenizer.add_bos
            )
        # best_fit needs every document's length, not just the totals: the body is opened
        entry, chunk = self.open_body(i)
        return entry, bestfit.bestfit_rows(chunk.doc_lengths, self.seq_len, self.tokenizer.add_bos)

    def open_body(self, i: int) -> tuple[ChunkIndex, TokenChunk]:
        """Runs in a worker thread: chunk i's tokens, rebuilt if evicted or corrupt."""
        return self.maker.open_body(i, self.keys[i], self.chunks[i])

    def ensure_chunk(self, i: int, body: bool = False) -> ChunkIndex:
        """Runs in a worker thread: chunk i's entry (and with `body`, its tokens in the cache)."""
        return self.maker.ensure(i, self.keys[i], self.chunks[i], body)

    def record(self, i: int, entry: ChunkIndex, units: int) -> None:
        """Count chunk i, built: its documents, tokens, units and bad records."""
        self.num_docs[i] = entry.num_docs
        self.num_tokens[i] = entry.num_tokens
        self.body_bytes[i] = entry.body_bytes
        self.units_per_chunk[i] = units
        self.bad_records.update(entry.bad)
        for reason, n in entry.bad.items():
            metrics.BAD_RECORDS.labels(self.spec.name, reason).inc(n)
        if self.built.advance(self.num_docs, self.units_per_chunk):
            for listener in self.listeners:
                listener()

    def finish(self) -> None:
        """Every chunk is counted: READY (or SourceError if the corpus yields no row)."""
        seq_len, total = self.seq_len, int(self.units_per_chunk.sum())
        if total < self.span:
            raise SourceError(
                f"job {self.name}: the corpus yields no row of seq_len {seq_len} "
                f"({int(self.num_tokens.sum())} tokens in {len(self.chunks)} chunks); "
                "lower seq_len, or add data"
            )
        self.units_per_epoch = total
        self.state, self.error = READY, ""
        for listener in self.listeners:
            listener()
        log.info(
            "job %s ready: %d chunks, %d documents, %d tokens, %d rows per epoch",
            self.name,
            len(self.chunks),
            int(self.num_docs.sum()),
            int(self.num_tokens.sum()),
            self.rows_per_epoch,
        )

    @property
    def tokenizer(self) -> TextTokenizer:
        """The job's tokenizer: set by the job once loaded, before the index is planned."""
        if self._tokenizer is None:
            raise NotReadyError(
                f"job {self.name}: dataset {self.dataset.name} has no tokenizer yet", 5.0
            )
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = self.maker.tokenizer = tokenizer

    @property
    def ready(self) -> bool:
        """Every chunk is built and counted: rows of every epoch are known."""
        return self.state == READY

    def not_built(self, job: str, step: int, need: int) -> tuple[str, float]:
        """Why `step` of `job`, which needs this dataset's first `need` rows, cannot be served
        yet, and a guess of the seconds until it can (from the build's rate so far)."""
        elapsed = max(time.monotonic() - self.started, 1e-3)
        rate = self.rows_built / elapsed  # rows per second built so far
        eta = (need - self.rows_built) / rate if rate > 0 else 5.0
        return (
            f"step {step} of job {job} needs {need} rows of dataset "
            f"{self.dataset.name}; {self.rows_built} rows are built so far "
            f"({self.built.positions}/{len(self.chunks)} chunks tokenized in sample order)",
            min(max(eta, 1.0), 600.0),
        )

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()

    def _fail(self, error: str) -> None:
        self.state, self.error = FAILED, error
        log.error("job %s failed: %s", self.name, error)
        for listener in self.listeners:
            listener()

    def _fingerprint(self) -> str:
        """The dataset's inputs, known before anything is tokenized: every chunk's key (which
        covers its source's URI, size and ETag, its range, the tokenizer's digest and the chunk
        format version), in chunk order. Tokenization is deterministic, so the inputs decide
        the tokens; a rebuilt chunk's digest is still checked against the one first indexed."""
        text = "\n".join([self.dataset.name, *self.keys])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
