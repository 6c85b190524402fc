"""A job at run time: its sources, its token index, and the batches it serves.

The job lists and plans its chunks on construction, then `build_index` makes sure every chunk is
tokenized into the token store (in the epoch-0 chunk order, so the first steps become servable
first, several chunks at once in worker threads). `batch` is the pure order and packing
functions applied to the stored tokens: it reads only the chunks its rows live in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np
from tokenfeed.server import order, packing
from tokenfeed.server.chunks import CHUNK_FORMAT_VERSION, Chunk, plan_chunks
from tokenfeed.server.config import JobSpec, SourceSpec
from tokenfeed.server.errors import (
    BadRecordError,
    JobFailedError,
    NotReadyError,
    RequestError,
    SourceError,
    StoreCorruptError,
    TokenfeedError,
)
from tokenfeed.server.readers import BadRecord, read_documents
from tokenfeed.server.storage import ObjectInfo, store_for
from tokenfeed.server.tokenize import TextTokenizer
from tokenfeed.server.tokstore import ChunkIndex, TokenChunk, TokenStore

log = logging.getLogger(__name__)

INDEXING, READY, FAILED = "indexing", "ready", "failed"
MAX_STEP = 2**62
BAD_EXAMPLES_PER_CHUNK = 20


class _LRU:
    """A small thread-safe LRU; `make` runs outside the lock (two threads may both make a
    value on a miss: every value here is a pure function of its key, so either is right)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key, make: Callable):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        with self._lock:
            self._items[key] = value
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value


class Job:
    def __init__(self, spec: JobSpec, store: TokenStore):
        self.spec = spec
        self.name = spec.name
        self.store = store
        self.tokenizer = TextTokenizer(spec.tokenizer)
        objects: dict[str, tuple[ObjectInfo, SourceSpec]] = {}
        for source in spec.sources:
            found = store_for(source.pattern).list(source.pattern)
            if not found:
                raise SourceError(f"job {self.name}: source {source.pattern!r} matched no objects")
            for obj in found:  # an object matched by two patterns is read once, as the first says
                objects.setdefault(obj.uri, (obj, source))
        self.chunks: list[Chunk] = plan_chunks(list(objects.values()), spec.chunk_bytes)
        if not self.chunks:
            raise SourceError(f"job {self.name}: every source object is empty")
        self.keys = [c.key(self.tokenizer.digest) for c in self.chunks]
        n = len(self.chunks)
        self.num_docs = np.full(n, -1, dtype=np.int64)
        self.num_tokens = np.full(n, -1, dtype=np.int64)
        self.bad_records: Counter[str] = Counter()
        self.state, self.error = INDEXING, ""
        self.rows_per_chunk: np.ndarray | None = None
        self.rows_per_epoch = 0
        self.fingerprint = self._fingerprint()
        self._ready = asyncio.Event()
        self._layouts = _LRU(4)
        self._streams = _LRU(512)
        self._windows = _LRU(16)
        self._open = _LRU(256)

    def _fingerprint(self) -> str:
        s, t = self.spec, self.tokenizer
        parts = [
            f"format={CHUNK_FORMAT_VERSION}", f"seq_len={s.seq_len}",
            f"batch={s.global_batch_size}", f"seed={s.seed}", f"packing={s.packing}",
            f"dataset={s.dataset}", f"window={s.window_chunks}", f"chunk_bytes={s.chunk_bytes}",
            f"tokenizer={t.digest}",
            f"eos={t.eos_id}", f"bos={t.bos_id}", f"add_bos={t.add_bos}",
        ]  # fmt: skip
        parts += [f"chunk={c.source.uri}|{c.source.size}|{c.kind}|{c.text_field}|{c.start}|{c.end}"
                  for c in self.chunks]  # fmt: skip
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()

    # ---------------------------------------------------------------- index

    @property
    def chunks_indexed(self) -> int:
        return int((self.num_docs >= 0).sum())

    async def build_index(self, executor: Executor, parallel: int) -> None:
        """Tokenize every chunk not yet in the store; the job is READY or FAILED afterwards."""
        loop = asyncio.get_running_loop()
        n = len(self.chunks)
        first_epoch = order.permute(
            np.arange(n), n, order.round_keys("chunks", self.spec.seed, self.spec.dataset, 0)
        )
        todo = asyncio.Queue()
        for i in first_epoch:
            todo.put_nowait(int(i))

        async def worker() -> None:
            while not todo.empty():
                i = todo.get_nowait()
                self._record(i, await loop.run_in_executor(executor, self._ensure_chunk, i))

        try:
            await asyncio.gather(*(worker() for _ in range(max(1, parallel))))
            self._finish()
        except TokenfeedError as e:
            self._fail(str(e))
        except Exception as e:  # a bug must fail the job loudly, not the server
            log.exception("job %s: index build crashed", self.name)
            self._fail(f"internal error while indexing: {type(e).__name__}: {e}")

    def _ensure_chunk(self, i: int) -> ChunkIndex:
        """Runs in a worker thread: the chunk's index entry, tokenizing it if it is not stored."""
        key, chunk = self.keys[i], self.chunks[i]
        found = self.store.get_index(key)
        if found is not None:
            # Possibly stored by a job with the skip policy: the manifest kept the locations.
            self._check_policy(found.bad_examples)
            return found
        docs = read_documents(store_for(chunk.source.uri), chunk)
        self._check_policy([str(b) for b in docs.bad])
        tokens, lengths = self.tokenizer.encode(docs.texts)
        bad = list(docs.bad)
        if (lengths == 0).any():
            empty = np.nonzero(lengths == 0)[0]
            bad += [BadRecord("no_tokens", f"{chunk.describe()} document {d}") for d in empty]
            self._check_policy([str(b) for b in bad])
            lengths = lengths[lengths > 0]
        for b in bad:
            log.warning(
                "job %s: skipped bad record %s",
                self.name,
                b,
                extra={"job": self.name, "reason": b.reason, "location": b.location},
            )
        counts = dict(Counter(b.reason for b in bad))
        examples = [str(b) for b in bad[:BAD_EXAMPLES_PER_CHUNK]]
        return self.store.put(
            key, tokens, lengths, docs.records, counts, examples, chunk.describe()
        )

    def _check_policy(self, bad: list[str]) -> None:
        if bad and self.spec.bad_records == "strict":
            raise BadRecordError(
                f"job {self.name}: bad record at {bad[0]}; the job's policy is strict "
                f"(set bad_records: skip to skip, count and log such records)"
            )

    def _record(self, i: int, entry: ChunkIndex) -> None:
        self.num_docs[i] = entry.num_docs
        self.num_tokens[i] = entry.num_tokens
        self.bad_records.update(entry.bad)

    def _finish(self) -> None:
        add_bos = self.tokenizer.add_bos
        rows = np.array(
            [packing.concat_rows(int(t), int(d), self.spec.seq_len, add_bos)
             for t, d in zip(self.num_tokens, self.num_docs, strict=True)],
            dtype=np.int64,
        )  # fmt: skip
        total = int(rows.sum())
        if total == 0:
            self._fail(
                f"job {self.name}: the corpus yields no row of seq_len {self.spec.seq_len} "
                f"({int(self.num_tokens.sum())} tokens in {len(self.chunks)} chunks); "
                "lower seq_len or chunk_bytes, or add data"
            )
            return
        self.rows_per_chunk, self.rows_per_epoch = rows, total
        self.state = READY
        self._ready.set()
        log.info("job %s ready: %d chunks, %d documents, %d tokens, %d rows per epoch",
                 self.name, len(self.chunks), int(self.num_docs.sum()),
                 int(self.num_tokens.sum()), total)  # fmt: skip

    def _fail(self, error: str) -> None:
        self.state, self.error = FAILED, error
        self._ready.set()
        log.error("job %s failed: %s", self.name, error)

    async def wait_ready(self, timeout: float) -> None:
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                raise NotReadyError(
                    f"job {self.name} is indexing ({self.chunks_indexed}/{len(self.chunks)} "
                    "chunks tokenized); retry shortly"
                ) from None
        if self.state == FAILED:
            raise JobFailedError(self.error)

    # ---------------------------------------------------------------- batches

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return packing.TENSOR_NAMES

    @property
    def steps_per_epoch(self) -> int:
        return self.rows_per_epoch // self.spec.global_batch_size

    def check_request(self, step: int, rank: int, world_size: int) -> None:
        b = self.spec.global_batch_size
        if step < 0 or step >= MAX_STEP // b:
            raise RequestError(f"step must be in [0, {MAX_STEP // b}), got {step}")
        if world_size < 1:
            raise RequestError(f"world_size must be >= 1, got {world_size}")
        if b % world_size:
            divisors = [w for w in range(1, b + 1) if b % w == 0]
            raise RequestError(
                f"world_size {world_size} does not divide global_batch_size {b} of job "
                f"{self.name}; valid world sizes: {divisors}"
            )
        if not 0 <= rank < world_size:
            raise RequestError(f"rank must be in [0, {world_size}), got {rank}")

    def batch(self, step: int, rank: int, world_size: int) -> tuple[int, dict[str, np.ndarray]]:
        """(epoch of the first row, arrays of shape [rows, seq_len]) of one rank's slice."""
        self.check_request(step, rank, world_size)
        if self.state != READY:
            raise NotReadyError(f"job {self.name} is not ready ({self.state})")
        per_rank = self.spec.global_batch_size // world_size
        first = step * self.spec.global_batch_size + rank * per_rank
        epochs, within = np.divmod(np.arange(first, first + per_rank), self.rows_per_epoch)
        shape = (per_rank, self.spec.seq_len)
        out = {name: np.empty(shape, dtype=np.int32) for name in packing.TENSOR_NAMES}
        for epoch in dict.fromkeys(epochs.tolist()):  # distinct, in order; cheap when small
            layout = self._layouts.get_or_make(epoch, lambda e=epoch: self._layout(e))
            slots = np.nonzero(epochs == epoch)[0]
            chunk_ids, chunk_rows = order.locate_rows(
                layout, within[slots], lambda w, e=epoch: self._window_perm(e, w)
            )
            for c in dict.fromkeys(chunk_ids.tolist()):
                mine = chunk_ids == c
                for name, arr in self._rows(epoch, c, chunk_rows[mine]).items():
                    out[name][slots[mine]] = arr
        return int(epochs[0]), out

    def _layout(self, epoch: int) -> order.EpochLayout:
        s = self.spec
        return order.epoch_layout(self.rows_per_chunk, s.seed, s.dataset, epoch, s.window_chunks)

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        layout = self._layouts.get_or_make(epoch, lambda: self._layout(epoch))
        return self._windows.get_or_make((epoch, w), lambda: order.window_order(layout, w))

    def _chunk(self, c: int) -> TokenChunk:
        def load() -> TokenChunk:
            try:
                return self.store.open(self.keys[c])
            except StoreCorruptError as e:
                # Losing a cache entry loses no data: tokenization is deterministic, so the
                # rebuilt chunk has the same bytes. Rare enough to do inline.
                log.warning("job %s: %s; re-tokenizing %s", self.name, e, self.chunks[c].describe())
                self._ensure_chunk(c)
                return self.store.open(self.keys[c])

        return self._open.get_or_make(c, load)

    def _rows(self, epoch: int, c: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        chunk = self._chunk(c)
        s, t = self.spec, self.tokenizer

        def make() -> packing.ChunkStream:
            doc_order = order.document_order(len(chunk.doc_lengths), s.seed, s.dataset, epoch, c)
            return packing.concat_stream(chunk.doc_offsets, chunk.doc_lengths, doc_order, t.add_bos)

        stream = self._streams.get_or_make((epoch, c), make)
        return packing.concat_rows_at(stream, chunk.tokens, rows, s.seq_len, t.bos_id, t.eos_id)
