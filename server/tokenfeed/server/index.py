"""A dataset's token index: list its sources, plan its chunks, make sure each is tokenized.

A job has one index per dataset (one for a plain job). `DatasetIndex.build` runs listing and
tokenization in worker threads, several chunks at once, in the epoch-0 chunk order. Outcomes:
- READY: every chunk is stored; documents and tokens per chunk are known (`num_docs`,
  `num_tokens`), and the job fingerprint covers the content of every chunk.
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
from concurrent.futures import Executor

import numpy as np
from tokenfeed.server import bestfit, metrics, order, packing
from tokenfeed.server.chunks import Chunk, plan_chunks
from tokenfeed.server.config import DatasetSpec, JobSpec, SourceSpec
from tokenfeed.server.errors import (
    BadRecordError,
    LocalError,
    SourceChangedError,
    SourceError,
    StoreCorruptError,
    TokenfeedError,
)
from tokenfeed.server.readers import BadRecord, read_documents
from tokenfeed.server.storage import ObjectInfo, Storage
from tokenfeed.server.tokenize import TextTokenizer
from tokenfeed.server.tokstore import ChunkIndex, ChunkMissing, TokenChunk, TokenStore

log = logging.getLogger(__name__)

INDEXING, READY, FAILED = "indexing", "ready", "failed"
BAD_EXAMPLES_PER_CHUNK = 20
RETRY_SECONDS = (1.0, 60.0)  # first and longest pause between builds after a local failure


class BuildCancelled(Exception):
    """The server is shutting down; the chunk being tokenized is abandoned (nothing stored)."""


class DatasetIndex:
    def __init__(self, spec: JobSpec, dataset: DatasetSpec, store: TokenStore,
                 tokenizer: TextTokenizer, storage: Storage):  # fmt: skip
        self.spec, self.dataset, self.store, self.tokenizer = spec, dataset, store, tokenizer
        self.storage = storage
        self.name = spec.name if len(spec.datasets) == 1 else f"{spec.name}/{dataset.name}"
        self.chunks: list[Chunk] = []
        self.keys: list[str] = []
        self.num_docs = np.zeros(0, dtype=np.int64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.digests: list[str] = []
        self.body_bytes = np.zeros(0, dtype=np.int64)
        self.chunk_of: dict[str, int] = {}  # key -> chunk id
        self.bad_records: Counter[str] = Counter()
        self.state, self.error, self.fingerprint = INDEXING, "", ""
        self.rows_per_chunk = np.zeros(0, dtype=np.int64)
        self.rows_per_epoch = 0
        self._cancel = threading.Event()

    @property
    def chunks_indexed(self) -> int:
        return int((self.num_docs >= 0).sum())

    def cancel(self) -> None:
        self._cancel.set()

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
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_SECONDS[1])
            except TokenfeedError as e:
                self._fail(str(e))
                return
            except BuildCancelled:
                return
            except Exception as e:  # local: disk, memory, a bug; another server may do better
                if not retry:
                    self._fail(f"index build failed: {type(e).__name__}: {e}")
                    return
                log.exception("job %s: index build failed here; retrying in %.0fs",
                              self.name, pause)  # fmt: skip
                self.error = f"index build failed on this server: {type(e).__name__}: {e}"
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_SECONDS[1])

    async def _build_once(self, executor: Executor, parallel: int) -> None:
        loop = asyncio.get_running_loop()
        if not self.chunks:
            await loop.run_in_executor(executor, self._plan)
            self.store.cache.claim(self.raw_claim, self.raw_working_set(parallel),
                                   f"job {self.name} (the raw data of {parallel} chunks "
                                   "tokenized at once)")  # fmt: skip
        n = len(self.chunks)
        keys = order.round_keys("chunks", self.spec.seed, self.dataset.name, 0)
        todo = [int(i) for i in order.permute(np.arange(n), n, keys) if self.num_docs[i] < 0]
        todo.reverse()  # popped from the end: epoch-0 order

        async def worker() -> None:
            while todo and not self._cancel.is_set():
                i = todo.pop()
                self._record(i, *await loop.run_in_executor(executor, self._index_chunk, i))

        try:
            async with asyncio.TaskGroup() as group:  # the first failure cancels the others
                for _ in range(max(1, parallel)):
                    group.create_task(worker())
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        if self._cancel.is_set():
            raise BuildCancelled
        self._finish()

    @property
    def raw_claim(self) -> str:
        return f"{self.name}#raw"

    def raw_working_set(self, parallel: int) -> int:
        """Cache bytes for the raw data of `parallel` chunks tokenized at once: their source
        bytes rounded out to blocks (only for objects that are fetched into the cache)."""
        remote = [c.raw_bytes for c in self.chunks if c.source.uri.startswith("s3://")]
        if not remote:
            return 0
        return min(parallel, len(remote)) * (
            max(remote) + 2 * self.storage.object_store.block_bytes
        )

    def _plan(self) -> None:
        objects: dict[str, tuple[ObjectInfo, SourceSpec]] = {}
        for source in self.dataset.sources:
            found = self.storage.for_uri(source.pattern).list(source.pattern)
            if not found:
                raise SourceError(f"job {self.name}: source {source.pattern!r} matched no objects")
            for obj in found:  # an object matched by two patterns is read once, as the first says
                objects.setdefault(obj.uri, (obj, source))
        chunks = plan_chunks(list(objects.values()), self.dataset.chunk_bytes, self.storage)
        if not chunks:
            raise SourceError(f"job {self.name}: every source object is empty")
        self.keys = [c.key(self.tokenizer.digest) for c in chunks]
        self.num_docs = np.full(len(chunks), -1, dtype=np.int64)
        self.num_tokens = np.full(len(chunks), -1, dtype=np.int64)
        self.digests = [""] * len(chunks)
        self.body_bytes = np.zeros(len(chunks), dtype=np.int64)
        self.chunk_of = {key: i for i, key in enumerate(self.keys)}
        self.rows_per_chunk = np.zeros(len(chunks), dtype=np.int64)
        self.chunks = chunks

    def _index_chunk(self, i: int) -> tuple[ChunkIndex, int]:
        """Runs in a worker thread: the chunk's entry and the rows it packs into."""
        if self.spec.packing == "concat":
            entry = self.ensure_chunk(i)
            rows = packing.concat_rows(entry.num_tokens, entry.num_docs, self.spec.seq_len,
                                       self.tokenizer.add_bos)  # fmt: skip
            return entry, rows
        # best_fit needs every document's length, not just the totals: the body is opened
        entry, chunk = self.open_body(i)
        return entry, bestfit.bestfit_rows(chunk.doc_lengths, self.spec.seq_len,
                                           self.tokenizer.add_bos)  # fmt: skip

    def open_body(self, i: int) -> tuple[ChunkIndex, TokenChunk]:
        """Runs in a worker thread: the chunk's tokens, rebuilding them if evicted or corrupt."""
        key = self.keys[i]
        with self.store.cache.pinned([("chunk", key)]):  # not evicted between build and open
            self.store.cache.lookup("chunk", key)  # a hit, or a miss that rebuilds the body
            for _ in range(3):
                entry = self.ensure_chunk(i, body=True)
                try:
                    return entry, self.store.open(key)
                except StoreCorruptError as e:
                    log.warning("job %s: %s; re-tokenizing %s", self.name, e,
                                self.chunks[i].describe())  # fmt: skip
                except ChunkMissing:
                    pass
        raise StoreCorruptError(f"token chunk {key} of {self.chunks[i].describe()} cannot be "
                                "rebuilt in the cache")  # fmt: skip

    def ensure_chunk(self, i: int, body: bool = False) -> ChunkIndex:
        """Runs in a worker thread: the chunk's index entry, tokenizing the chunk if it was never
        stored (or, with `body`, if its tokens are not in the cache). Concurrent callers for
        one chunk tokenize it once."""
        key = self.keys[i]
        found = self.store.get_index(key)
        if found is not None and (not body or self.store.has_body(key)):
            # Possibly stored by a job with the skip policy: the manifest kept the locations.
            self._check_policy(found.bad_examples)
            return found
        built: list[ChunkIndex] = []
        self.store.cache.fill_once("chunk", key, lambda: built.append(self._tokenize(i)))
        entry = built[0] if built else self.store.get_index(key)
        if entry is None:
            raise StoreCorruptError(f"token chunk {key} vanished while it was built")
        if not built:  # built by another job, whose policy may differ from ours
            self._check_policy(entry.bad_examples)
        if found is not None and entry.digest != found.digest:
            raise SourceChangedError(
                f"job {self.name}: {self.chunks[i].describe()} tokenized to other bytes than "
                f"when it was indexed ({found.digest} -> {entry.digest}): the source or the "
                "tokenizer changed; restart the job on a stable corpus"
            )
        return entry

    def _tokenize(self, i: int) -> ChunkIndex:
        key, chunk = self.keys[i], self.chunks[i]
        started = time.monotonic()
        docs = read_documents(self.storage.for_uri(chunk.source.uri), chunk)
        self._check_policy([str(b) for b in docs.bad])
        tokens, lengths = self.tokenizer.encode(docs.texts, between_batches=self._stop_point)
        bad, record_ids = list(docs.bad), np.asarray(docs.record_ids, dtype=np.int64)
        if (lengths == 0).any():
            empty = np.nonzero(lengths == 0)[0]
            bad += [BadRecord("no_tokens", f"{chunk.describe()} record {record_ids[d]}")
                    for d in empty]  # fmt: skip
            self._check_policy([str(b) for b in bad])
            record_ids = record_ids[lengths > 0]
            lengths = lengths[lengths > 0]
        for b in bad:
            fields = {"job": self.name, "reason": b.reason, "location": b.location}
            log.warning("job %s: skipped bad record %s", self.name, b, extra=fields)
        counts = dict(Counter(b.reason for b in bad))
        examples = [str(b) for b in bad[:BAD_EXAMPLES_PER_CHUNK]]
        entry = self.store.put(key, tokens, lengths, docs.records, counts, examples,
                               chunk.describe(), record_ids, docs.data_start)  # fmt: skip
        metrics.TOKENIZED_DOCUMENTS.labels(self.spec.name).inc(len(lengths))
        metrics.TOKENIZED_TOKENS.labels(self.spec.name).inc(len(tokens))
        metrics.TOKENIZED_BYTES.labels(self.spec.name).inc(chunk.raw_bytes)
        metrics.TOKENIZE_SECONDS.labels(self.spec.name).inc(time.monotonic() - started)
        return entry

    def _stop_point(self) -> None:
        if self._cancel.is_set():
            raise BuildCancelled

    def _check_policy(self, bad: list[str]) -> None:
        if bad and self.spec.bad_records == "strict":
            raise BadRecordError(
                f"job {self.name}: bad record at {bad[0]}; the job's policy is strict "
                f"(set bad_records: skip to skip, count and log such records)"
            )

    def _record(self, i: int, entry: ChunkIndex, rows: int) -> None:
        self.num_docs[i] = entry.num_docs
        self.num_tokens[i] = entry.num_tokens
        self.digests[i] = entry.digest
        self.body_bytes[i] = entry.body_bytes
        self.rows_per_chunk[i] = rows
        self.bad_records.update(entry.bad)
        for reason, n in entry.bad.items():
            metrics.BAD_RECORDS.labels(self.spec.name, reason).inc(n)

    def _finish(self) -> None:
        seq_len, rows = self.spec.seq_len, self.rows_per_chunk
        total = int(rows.sum())
        if total == 0:
            raise SourceError(
                f"job {self.name}: the corpus yields no row of seq_len {seq_len} "
                f"({int(self.num_tokens.sum())} tokens in {len(self.chunks)} chunks); "
                "lower seq_len or chunk_bytes, or add data"
            )
        self.rows_per_epoch = total
        self.fingerprint = self._fingerprint()
        self.state, self.error = READY, ""
        log.info("job %s ready: %d chunks, %d documents, %d tokens, %d rows per epoch",
                 self.name, len(self.chunks), int(self.num_docs.sum()),
                 int(self.num_tokens.sum()), total)  # fmt: skip

    def _fail(self, error: str) -> None:
        self.state, self.error = FAILED, error
        log.error("job %s failed: %s", self.name, error)

    def _fingerprint(self) -> str:
        """The dataset's content: every chunk's digest, in chunk order."""
        text = "\n".join([self.dataset.name, *self.digests])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
