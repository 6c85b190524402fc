"""A job's batches from its plans: the chunks a plan reads are opened (disk work, in a worker
thread: `open_chunks`), then the pure packing functions assemble the rows from the stored
tokens, in the wire's dtype.

Under concat each (dataset, epoch, chunk) stream is laid out once in the epoch's order of the
chunk's documents, followed by the units its last row reads past the chunk's end: its row
buffer (`server.stream_cache_bytes`), so every row is one slice copy of the buffer of the
chunk it starts in. What is served is always copied from a chunk verified at the time of the
copy: damage to a body under a running server is found then, and the chunk rebuilt, never
served.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash
from tokenfeed.client import wire
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import BadRecordError, JobFailedError, SourceError, StoreCorruptError
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.server.pack.sharedrows import SharedRows
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.planner import RowPlan

if TYPE_CHECKING:
    from tokenfeed.server.settings.config import JobSpec
    from tokenfeed.server.store.chunkfiles import ChunkIndex
    from tokenfeed.server.store.tokstore import TokenChunk, TokenStore
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Keys(Protocol):
    """A dataset's chunk keys (indexing/chunkkeys.py): by chunk, and a chunk by its key."""

    def __getitem__(self, chunk: int) -> str: ...

    def get(self, key: str) -> int | None: ...


class DatasetChunks(Protocol):
    """What assembly reads of a dataset's index (indexing/index.py's DatasetIndex): its chunks'
    keys in the token store and counts, and a chunk's tokens, rebuilt when evicted."""

    @property
    def dataset(self) -> _Named: ...
    @property
    def keys(self) -> _Keys: ...
    @property
    def num_docs(self) -> np.ndarray: ...
    @property
    def num_tokens(self) -> np.ndarray: ...

    def open_body(self, i: int) -> tuple[ChunkIndex, TokenChunk]: ...


BUFFERS_MAX = 1 << 20  # row buffers kept at most, whatever their bytes: about 100 MB of keys


class Assembler:
    def __init__(
        self,
        spec: JobSpec,
        indexes: Sequence[DatasetChunks],
        store: TokenStore,
        fail: Callable[[str], None],
        stream_cache_bytes: int,
        tail: Callable[[int, int, int, int], order.Pieces],
        carry: Callable[[int, int, int], tuple[order.Pieces, list[int]]],
        shared: SharedRows | None = None,
        identity: Callable[[], str] = str,
    ):
        self.spec, self.indexes, self.store, self._fail = spec, indexes, store, fail
        # In a serving worker: row buffers laid out once for every process of the node, named
        # by `identity` (what decides their bytes; empty: not shared yet), sharedrows.py.
        self.shared, self._identity = shared, identity
        # (dataset, epoch, position, segment) -> what a row buffer holds past its chunk
        self._tail = tail
        # (dataset, segment, block) -> the pieces of a segment's carry block, and its joins
        self._carry = carry
        self.tokenizer: TextTokenizer | None = None  # set once the job's tokenizer is loaded
        # A job packs one way: concat streams per (dataset, epoch, chunk), or best-fit layouts
        # per (dataset, chunk).
        self._streams: LRU[tuple[int, int, int], packing.ChunkStream] = LRU(512)
        self._layouts: LRU[tuple[int, int, int], bestfit.BestFitLayout] = LRU(512)
        self._open: LRU[tuple[int, int], TokenChunk] = LRU(256)
        # Row buffers per (dataset, epoch, chunk), or best_fit's verified tokens per (dataset,
        # chunk), in this much memory: a row is then one slice copy (bench/, wire section).
        # Bounded by bytes, not by count: a corpus of 20,000 chunks of 1 KB has as many small
        # buffers an epoch, and a cap of 4096 laid them out again on every read (bench/, scale).
        self.buffers: LRU[tuple[Any, int, int], packing.RowBuffer] = LRU(
            BUFFERS_MAX, stream_cache_bytes
        )
        self.tokens: LRU[tuple[int, int], np.ndarray] = LRU(BUFFERS_MAX, stream_cache_bytes)
        # xxh3-128 of each chunk's tokens as mapped when its digests were last checked
        # (`_verified`): 16 bytes a chunk.
        self._sums: dict[str, bytes] = {}
        # Row buffers being laid out, by key: a buffer is laid out once for every stream and
        # rank that needs it (the others wait for it), never once per thread that missed it.
        self._making: dict[tuple[Any, int, int], threading.Event] = {}
        self._making_lock = threading.Lock()
        store.cache.on_evict(self._forget)

    @property
    def wire_dtype(self) -> np.dtype:
        return wire.token_dtype(self.loaded_tokenizer.vocab_size)

    @property
    def loaded_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("the job's tokenizer is not loaded")
        return self.tokenizer

    # ---------------------------------------------------------------- chunks of a plan

    def chunk_keys(self, plan: RowPlan) -> list[tuple[str, str]]:
        """The cache entries of the chunks a plan's rows start in, to pin while it is served
        (the chunks of a row buffer's tail are pinned while the buffer is made)."""
        needed = {(_dataset(key), c) for key, e, c, _ in plan.buffers if e >= 0}
        return [("chunk", self.indexes[d].keys[c]) for d, c in needed]

    def pinned(self, plan: RowPlan):
        return self.store.cache.pinned(self.chunk_keys(plan))

    async def open_chunks(self, plan: RowPlan, executor: Executor) -> None:
        """Open (verify, or rebuild) in a worker thread the chunks a plan needs. Row buffers
        are laid out in one task, from the last position of an epoch to the first: a buffer's
        tail is then cut from the next buffer, laid out just before (bench/, wire section)."""
        missing: list[Callable[[], object]] = []
        # Row buffers (concat rows and carry rows) are laid out in the epoch's order, with
        # their tails; best_fit rows read their chunks' tokens.
        keys = sorted(
            {k for k in _buffers(plan, bestfit=False) if not self.buffers.contains(k[:3])},
            key=lambda k: (_dataset(k[0]), _segment(k[0]), k[1], k[3]),
            reverse=True,
        )
        if keys:
            missing.append(partial(self._row_buffers, keys))
        chunks = {
            (_dataset(key), c)
            for key, _, c, _ in _buffers(plan, bestfit=True)
            if not self.tokens.contains((_dataset(key), c))
        }
        missing += [partial(self.bestfit_tokens, d, c) for d, c in chunks]
        if missing:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.gather(*(loop.run_in_executor(executor, make) for make in missing))
            except (SourceError, BadRecordError) as e:
                self._fail(str(e))
                raise JobFailedError(str(e)) from e

    def _row_buffers(self, keys: list[tuple[Any, int, int, int]]) -> None:
        for key in keys:
            self.row_buffer(*key)

    # ---------------------------------------------------------------- batches

    def assemble(self, plan: RowPlan) -> tuple[int, wire.Compact]:
        """(epoch of the first row, the compact batch) of a plan: token ids in the wire's
        dtype and document starts (docs/batch-format.md)."""
        first_epoch = 0
        for part in plan.parts:
            hit = np.nonzero(part.slots == 0)[0]
            if hit.size:
                first_epoch = int(part.epochs[hit[0]])
        kinds = {p.packing for p in plan.parts}
        if kinds == {"best_fit"}:
            return first_epoch, wire.compact_from_tensors(
                self._assemble_bestfit(plan), self.wire_dtype
            )
        if kinds == {"concat"}:
            ids, starts, splits = packing.assemble_rows(
                plan.rows,
                plan.seq_len,
                [(p.key, p.slots, p.starts) for p in plan.parts],
                self.row_buffer,
                self.wire_dtype,
            )
            pdtype = wire.position_dtype(plan.seq_len)
            return first_epoch, wire.Compact(ids, starts.astype(pdtype), splits, None)
        # A phase that changed the packing: padded carry rows beside concat or best_fit rows.
        return first_epoch, wire.compact_from_tensors(self._assemble_mixed(plan), self.wire_dtype)

    def _assemble_mixed(self, plan: RowPlan) -> dict[str, np.ndarray]:
        L, eos = plan.seq_len, self.loaded_tokenizer.eos_id
        out = {name: np.empty((plan.rows, L), dtype=np.int32) for name in packing.TENSOR_NAMES}
        bestfit_parts = [p for p in plan.parts if p.packing == "best_fit"]
        if bestfit_parts:
            self._bestfit_into(out, bestfit_parts, L)
        for part in plan.parts:
            if part.packing == "best_fit":
                continue
            n = len(part.slots)
            if part.packing == "concat":
                ids, starts, splits = packing.assemble_rows(
                    n, L, [(part.key, np.arange(n), part.starts)], self.row_buffer, np.int32
                )
                mask = np.zeros(ids.shape, dtype=bool)
                mask[np.repeat(np.arange(n), np.diff(splits)), starts] = True
                rows = packing.concat_tensors(ids, mask, L)
            else:  # padded: slices of carry blocks, the last one ending early
                s = part.starts
                buffers = [
                    self.row_buffer(part.key, int(e), int(c), int(q))
                    for e, c, q in zip(s.epoch, s.chunk, s.position, strict=True)
                ]
                rows = packing.padded_rows(buffers, s.lo, L, eos)
            for name, arr in rows.items():
                out[name][part.slots] = arr
        return out

    def assemble_steps(self, plan: RowPlan, steps: int) -> list[tuple[int, wire.Compact]]:
        """`assemble` of a plan of several steps (Planner.plan_steps): the whole assembled in
        one pass, then cut into the steps' batches, each with the epoch of its first row."""
        epoch, whole = self.assemble(plan)
        if steps == 1:
            return [(epoch, whole)]
        per_step = plan.rows // steps
        epochs = np.zeros(steps, dtype=np.int64)
        for part in plan.parts:
            first = part.slots % per_step == 0
            epochs[part.slots[first] // per_step] = part.epochs[first]
        return [
            (int(epochs[i]), wire.slice_rows(whole, i * per_step, (i + 1) * per_step))
            for i in range(steps)
        ]

    def _assemble_bestfit(self, plan: RowPlan) -> dict[str, np.ndarray]:
        out = {
            name: np.empty((plan.rows, plan.seq_len), dtype=np.int32)
            for name in packing.TENSOR_NAMES
        }
        self._bestfit_into(out, plan.parts, plan.seq_len)
        return out

    def _bestfit_into(self, out: dict[str, np.ndarray], parts: Sequence[Any], L: int) -> None:
        """Best-fit rows of `parts` (at seq_len L) into their slots of `out`."""
        t = self.loaded_tokenizer
        for part in parts:
            pc = part.starts  # a best_fit unit is a row: `lo` is the row within its chunk
            for c in dict.fromkeys(pc.chunk.tolist()):
                sel = pc.chunk == c
                chunk, layout = self.chunk(part.dataset, c), self.bestfit_layout(part.dataset, c, L)
                tokens = self.bestfit_tokens(part.dataset, c)
                rows = bestfit.bestfit_rows_at(
                    layout,
                    chunk.doc_offsets,
                    tokens,
                    pc.lo[sel],
                    L,
                    t.bos_id,
                    t.eos_id,
                    t.eos_id,
                )
                for name, arr in rows.items():  # padding slots hold EOS, masked by loss_mask
                    out[name][part.slots[sel]] = arr

    # ---------------------------------------------------------------- opened chunks

    def chunk(self, d: int, c: int) -> TokenChunk:
        return self._open.get_or_make((d, c), lambda: self._load(d, c))

    def _load(self, d: int, c: int) -> TokenChunk:
        # An evicted or corrupt body is rebuilt: tokenization is deterministic, so the rebuilt
        # chunk has the same bytes (its digest is checked against the index).
        idx = self.indexes[d]
        return self._checked(idx, c, idx.open_body(c)[1])

    def forget_gone(self) -> int:
        """In a serving worker: drop the mappings of bodies the supervisor has evicted since
        (so their disk space is freed); the number dropped."""
        gone = [(d, c) for d, c in self._open.keys() if self.store.gone(self.indexes[d].keys[c])]
        for key in gone:
            self._open.discard(key)
        return len(gone)

    def _forget(self, entry: tuple[str, str]) -> None:
        """An evicted body is no longer mapped here (called with the cache's lock held)."""
        kind, key = entry
        self._sums.pop(key, None)
        for d, idx in enumerate(self.indexes):
            c = idx.keys.get(key) if kind == "chunk" else None
            if c is not None:
                self._open.discard((d, c))

    @staticmethod
    def _checked(idx: DatasetChunks, c: int, chunk: TokenChunk) -> TokenChunk:
        if len(chunk.doc_lengths) != idx.num_docs[c] or chunk.tokens.size != idx.num_tokens[c]:
            raise StoreCorruptError(
                f"token chunk {idx.keys[c]} holds {len(chunk.doc_lengths)} documents and "
                f"{chunk.tokens.size} tokens, the index says {idx.num_docs[c]} and "
                f"{idx.num_tokens[c]}"
            )
        return chunk

    def stream(self, d: int, epoch: int, c: int) -> packing.ChunkStream:
        def make() -> packing.ChunkStream:
            chunk, s, name = self.chunk(d, c), self.spec, self.indexes[d].dataset.name
            doc_order = order.document_order(len(chunk.doc_lengths), s.seed, name, epoch, c)
            return packing.concat_stream(
                chunk.doc_offsets, chunk.doc_lengths, doc_order, self.loaded_tokenizer.add_bos
            )

        return self._streams.get_or_make((d, epoch, c), make)

    def row_buffer(
        self, key: int | tuple[int, int], epoch: int, c: int, position: int
    ) -> packing.RowBuffer:
        """Chunk c's row buffer in `epoch` (it is at `position` of the epoch's order): its
        concat stream and its tail, in the wire's dtype. `key` is the dataset, or (dataset,
        segment) for a later segment's rows (another tail); epoch -1 names a carry block. Laid
        out by one thread at a time: another that needs it meanwhile waits for it."""
        if epoch < 0:
            return self._once((key, -1, c), partial(self._lay_carry, key, c))
        return self._once((key, epoch, c), partial(self._lay_out, key, epoch, c, position))

    def _once(
        self, key: tuple[Any, int, int], make: Callable[[], packing.RowBuffer]
    ) -> packing.RowBuffer:
        """The row buffer `key`, made by `make` in this thread unless another thread is making
        it (then this one waits for it, and makes it itself if that one failed); in a serving
        worker, mapped from another process's layout where there is one."""
        shared = self.shared
        if shared is not None and (identity := self._identity()):
            dkey, epoch, c = key
            name = f"{identity}/{_dataset(dkey)}-{_segment(dkey)}-{epoch}-{c}"
            laid_out = make

            def make() -> packing.RowBuffer:
                return shared.get_or_make(name, laid_out, self.wire_dtype)

        while True:
            found = self.buffers.get(key)
            if found is not None:
                return found
            with self._making_lock:
                making = self._making.get(key)
                if making is None:
                    making = self._making[key] = threading.Event()
                    break
            making.wait()
        try:
            return self.buffers.get_or_make(key, make)
        finally:
            with self._making_lock:
                del self._making[key]
            making.set()

    def _lay_out(
        self, key: int | tuple[int, int], epoch: int, c: int, position: int
    ) -> packing.RowBuffer:
        d, segment = (key, 0) if isinstance(key, int) else key
        t = self.loaded_tokenizer
        tail = self._laid(d, self._tail(d, epoch, position, segment))
        return packing.row_buffer(
            self.stream(d, epoch, c),
            self._verified(d, c).tokens,
            tail,
            t.bos_id,
            t.eos_id,
            self.wire_dtype,
        )

    def _lay_carry(self, key: int | tuple[int, int], block: int) -> packing.RowBuffer:
        """A carry block of a segment (planner.carry_block) laid out: its pieces copied from
        verified chunks, one after another, a document segment starting at each join."""
        if isinstance(key, int):
            raise ValueError("a dataset's first segment has no carry")
        d, segment = key
        pc, joins = self._carry(d, segment, block)
        laid = self._laid(d, pc)
        ids = np.concatenate([b.ids for b in laid]) if laid else np.zeros(0, self.wire_dtype)
        at = np.cumsum([0] + [len(b.ids) for b in laid[:-1]])
        found = [b.starts + a for b, a in zip(laid, at.tolist(), strict=True)]
        starts = np.union1d(np.concatenate([*found, np.array(joins, dtype=np.int64)]), [])
        return packing.RowBuffer(ids, starts.astype(np.int64))

    def _laid(self, d: int, pc: order.Pieces) -> list[packing.RowBuffer]:
        """Pieces of dataset d's chunks laid out, in order (their chunks pinned meanwhile)."""
        keys = [("chunk", self.indexes[d].keys[k]) for k in set(pc.chunk.tolist())]
        cols = (pc.epoch.tolist(), pc.chunk.tolist(), pc.lo.tolist(), pc.hi.tolist())
        with self.store.cache.pinned(keys):
            return [self._tail_piece(d, e, k, lo, hi) for e, k, lo, hi in zip(*cols, strict=True)]

    def _tail_piece(self, d: int, epoch: int, c: int, lo: int, hi: int) -> packing.RowBuffer:
        """Stream positions [lo, hi) of chunk c in `epoch`: cut from its row buffer when that
        is laid out (copied from a verified chunk then), else copied from the chunk verified
        now. Both are the same bytes."""
        laid_out = self.buffers.peek((d, epoch, c))
        if laid_out is not None:
            return laid_out.cut(lo, hi)
        t = self.loaded_tokenizer
        tokens = self._verified(d, c).tokens
        return packing.stream_slice(
            self.stream(d, epoch, c), tokens, lo, hi, t.bos_id, t.eos_id, self.wire_dtype
        )

    def _verified(self, d: int, c: int) -> TokenChunk:
        """Chunk c opened with its tokens checked now, whatever was checked before: what is
        served is copied from it (a stream laid out, best_fit's tokens), so damage to a body
        while the server runs is found at the next copy, and the chunk rebuilt, never served.
        The first copy in this process checks the body's digests (the store's BLAKE2b, on
        open) and keeps an xxh3-128 of the tokens as mapped; a later copy from the same
        mapping compares the tokens with that at memory speed (BLAKE2b on every epoch's
        layout cost about 3 ns a token, more than the rest of serving: bench/, wire section),
        and on a mismatch checks the digests again, which drops and rebuilds a damaged body."""
        key = self.indexes[d].keys[c]
        opened, want = self._open.peek((d, c)), self._sums.get(key)
        if opened is not None and want is not None and not self.store.gone(key):
            if _tokens_sum(opened) == want:
                return opened
        self.store.forget_verified(key)
        self._open.discard((d, c))
        chunk = self.chunk(d, c)
        self._sums[key] = _tokens_sum(chunk)
        return chunk

    def bestfit_tokens(self, d: int, c: int) -> np.ndarray:
        """Chunk c's tokens, verified and copied (best_fit reads rows from them)."""
        return self.tokens.get_or_make((d, c), lambda: np.array(self._verified(d, c).tokens))

    def bestfit_layout(self, d: int, c: int, seq_len: int | None = None) -> bestfit.BestFitLayout:
        """Chunk c's best-fit layout at `seq_len` (the job's by default; a phase may change
        it). Best-fit rows do not depend on the epoch's document order (the rows are
        permuted)."""
        L = self.spec.seq_len if seq_len is None else seq_len

        def make() -> bestfit.BestFitLayout:
            lengths = self.chunk(d, c).doc_lengths
            return bestfit.bestfit_layout(lengths, L, self.loaded_tokenizer.add_bos)

        return self._layouts.get_or_make((d, c, L), make)


def _buffers(plan: RowPlan, bestfit: bool) -> set[tuple[Any, int, int, int]]:
    """(dataset key, epoch, chunk, position) of the chunks (or carry blocks) a plan's rows start
    in: those of its best_fit rows, or those of the others (row buffers)."""
    if all((p.packing == "best_fit") == bestfit for p in plan.parts):
        return set(plan.buffers)
    out: set[tuple[Any, int, int, int]] = set()
    for p in plan.parts:
        if (p.packing == "best_fit") == bestfit:
            s = p.starts
            cols = (s.epoch.tolist(), s.chunk.tolist(), s.position.tolist())
            out.update((p.key, e, c, q) for e, c, q in zip(*cols, strict=True))
    return out


def _dataset(key: int | tuple[int, int]) -> int:
    """The dataset of a row buffer's key (the dataset, or (dataset, segment))."""
    return key if isinstance(key, int) else key[0]


def _segment(key: int | tuple[int, int]) -> int:
    return 0 if isinstance(key, int) else key[1]


def _tokens_sum(chunk: TokenChunk) -> bytes:
    return xxhash.xxh3_128_digest(np.ascontiguousarray(chunk.tokens).data)
