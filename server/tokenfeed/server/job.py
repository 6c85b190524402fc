"""A job at run time: its token index (index.py) and the batches it serves.

`batch` applies the pure order and packing functions to the stored tokens and reads only the
chunks its rows live in. Opening a chunk (and its first-open verification, or its rebuild when
it is corrupt) is disk work: `prepare` does it in a worker thread before `batch` runs on the
event loop, so a slow or corrupt chunk never stalls other calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np
from tokenfeed.server import order, packing
from tokenfeed.server.config import JobSpec
from tokenfeed.server.errors import JobFailedError, NotReadyError, RequestError, StoreCorruptError
from tokenfeed.server.index import FAILED, INDEXING, READY, JobIndex
from tokenfeed.server.tokstore import TokenChunk, TokenStore

log = logging.getLogger(__name__)

MAX_STEP = 2**62
__all__ = ["FAILED", "INDEXING", "MAX_STEP", "READY", "Job"]


class _LRU:
    """A small thread-safe LRU; `make` runs outside the lock (two threads may both make a
    value on a miss: every value here is a pure function of its key, so either is right)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, key) -> bool:
        with self._lock:
            return key in self._items

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
        self.spec, self.name, self.store = spec, spec.name, store
        self.index = JobIndex(spec, store)
        self.tokenizer = self.index.tokenizer
        self._ready = asyncio.Event()
        self._layouts = _LRU(4)
        self._streams = _LRU(512)
        self._windows = _LRU(16)
        self._open = _LRU(256)

    @property
    def state(self) -> str:
        return self.index.state

    @property
    def error(self) -> str:
        return self.index.error

    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint

    async def build_index(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        await self.index.build(executor, parallel, retry)
        self._ready.set()

    def cancel(self) -> None:
        self.index.cancel()

    async def wait_ready(self, timeout: float) -> None:
        if not self._ready.is_set() and self.index.error:
            # The build failed here and waits to retry: another server can serve sooner.
            raise NotReadyError(f"job {self.name} cannot be indexed on this server right now "
                                f"({self.index.error}); retry on another server")  # fmt: skip
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(self._ready.wait()), timeout)
            except TimeoutError:
                idx = self.index
                why = f"; last error: {idx.error}" if idx.error else ""
                raise NotReadyError(
                    f"job {self.name} is indexing on this server ({idx.chunks_indexed}/"
                    f"{len(idx.chunks)} chunks tokenized{why}); retry shortly or elsewhere"
                ) from None
        if self.state == FAILED:
            raise JobFailedError(self.error)

    # ---------------------------------------------------------------- batches

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return packing.TENSOR_NAMES

    @property
    def steps_per_epoch(self) -> int:
        return self.index.rows_per_epoch // self.spec.global_batch_size

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

    def plan(self, step: int, rank: int, world_size: int):
        """(epochs, [(epoch, slots, chunk ids, rows in chunk)]) for one rank's rows."""
        self.check_request(step, rank, world_size)
        if self.state != READY:
            raise NotReadyError(f"job {self.name} is not ready ({self.state})")
        per_rank = self.spec.global_batch_size // world_size
        first = step * self.spec.global_batch_size + rank * per_rank
        epochs, within = np.divmod(np.arange(first, first + per_rank), self.index.rows_per_epoch)
        parts = []
        for epoch in dict.fromkeys(epochs.tolist()):  # distinct, in order; cheap when small
            layout = self._layouts.get_or_make(epoch, lambda e=epoch: self._layout(e))
            slots = np.nonzero(epochs == epoch)[0]
            chunk_ids, chunk_rows = order.locate_rows(
                layout, within[slots], lambda w, e=epoch: self._window_perm(e, w)
            )
            parts.append((epoch, slots, chunk_ids, chunk_rows))
        return epochs, parts

    async def open_chunks(self, plan, executor: Executor) -> None:
        """Open (verify, or rebuild) in a worker thread the chunks a plan needs."""
        needed = {c for _, _, chunk_ids, _ in plan[1] for c in chunk_ids.tolist()}
        missing = [c for c in needed if not self._open.contains(c)]
        if missing:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(executor, self._chunk, c)
                                   for c in missing))  # fmt: skip

    def batch(self, step: int, rank: int, world_size: int) -> tuple[int, dict[str, np.ndarray]]:
        """(epoch of the first row, arrays of shape [rows, seq_len]) of one rank's slice."""
        return self.assemble(self.plan(step, rank, world_size))

    def assemble(self, plan) -> tuple[int, dict[str, np.ndarray]]:
        epochs, parts = plan
        shape = (len(epochs), self.spec.seq_len)
        out = {name: np.empty(shape, dtype=np.int32) for name in packing.TENSOR_NAMES}
        for epoch, slots, chunk_ids, chunk_rows in parts:
            for c in dict.fromkeys(chunk_ids.tolist()):
                mine = chunk_ids == c
                for name, arr in self._rows(epoch, c, chunk_rows[mine]).items():
                    out[name][slots[mine]] = arr
        return int(epochs[0]), out

    def _layout(self, epoch: int) -> order.EpochLayout:
        s = self.spec
        rows = self.index.rows_per_chunk
        return order.epoch_layout(rows, s.seed, s.dataset, epoch, s.window_chunks)

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        layout = self._layouts.get_or_make(epoch, lambda: self._layout(epoch))
        return self._windows.get_or_make((epoch, w), lambda: order.window_order(layout, w))

    def _chunk(self, c: int) -> TokenChunk:
        return self._open.get_or_make(c, lambda: self._load(c))

    def _load(self, c: int) -> TokenChunk:
        idx, key = self.index, self.index.keys[c]
        try:
            return self._checked(c, self.store.open(key))
        except StoreCorruptError as e:
            # Losing a cache entry loses no data: tokenization is deterministic, so the rebuilt
            # chunk has the same bytes (checked against the index below).
            log.warning("job %s: %s; re-tokenizing %s", self.name, e, idx.chunks[c].describe())
            self.store.drop(key, "rebuilding")
            idx.ensure_chunk(c)
            return self._checked(c, self.store.open(key))

    def _checked(self, c: int, chunk: TokenChunk) -> TokenChunk:
        if len(chunk.doc_lengths) != self.index.num_docs[c] or (
            chunk.tokens.size != self.index.num_tokens[c]
        ):
            raise StoreCorruptError(
                f"token chunk {self.index.keys[c]} holds {len(chunk.doc_lengths)} documents and "
                f"{chunk.tokens.size} tokens, the index says {self.index.num_docs[c]} and "
                f"{self.index.num_tokens[c]}"
            )
        return chunk

    def _rows(self, epoch: int, c: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        chunk = self._chunk(c)
        s, t = self.spec, self.tokenizer

        def make() -> packing.ChunkStream:
            doc_order = order.document_order(len(chunk.doc_lengths), s.seed, s.dataset, epoch, c)
            return packing.concat_stream(chunk.doc_offsets, chunk.doc_lengths, doc_order, t.add_bos)

        stream = self._streams.get_or_make((epoch, c), make)
        return packing.concat_rows_at(stream, chunk.tokens, rows, s.seq_len, t.bos_id, t.eos_id)
