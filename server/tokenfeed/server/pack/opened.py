"""A job's chunks opened for assembly: mapped from the token store (rebuilt when evicted or
corrupt), checked against the index, and what is derived from a chunk alone and cached (its
concat stream in an epoch's document order, its best-fit layout at a seq_len, best_fit's copy of
its tokens). What is served is copied from a chunk verified at the time of the copy: damage to a
body under a running server is found then, and the chunk rebuilt, never served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import StoreCorruptError
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.server.sampling import order

if TYPE_CHECKING:
    from tokenfeed.server.settings.config import JobSpec
    from tokenfeed.server.store.chunkfiles import ChunkIndex
    from tokenfeed.server.store.tokstore import TokenChunk, TokenStore
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer


class NotMapped(Exception):
    """A chunk that `verified(..., here=True)` would have to open (map, check or rebuild):
    the caller, on the event loop, leaves its work to a thread."""


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


class OpenedChunks:
    def __init__(
        self,
        spec: JobSpec,
        indexes: Sequence[DatasetChunks],
        store: TokenStore,
        tokenizer: Callable[[], TextTokenizer],
        tokens_bytes: int,
        tokens_max: int,
    ):
        self.spec, self.indexes, self.store, self._tokenizer = spec, indexes, store, tokenizer
        # A job packs one way: concat streams per (dataset, epoch, chunk), or best-fit layouts
        # per (dataset, chunk, seq_len).
        self._streams: LRU[tuple[int, int, int], packing.ChunkStream] = LRU(512)
        self._layouts: LRU[tuple[int, int, int], bestfit.BestFitLayout] = LRU(512)
        self._open: LRU[tuple[int, int], TokenChunk] = LRU(256)
        # best_fit's verified tokens per (dataset, chunk), in this much memory.
        self.tokens: LRU[tuple[int, int], np.ndarray] = LRU(tokens_max, tokens_bytes)
        # xxh3-128 of each chunk's tokens as mapped when its digests were last checked
        # (`verified`): 16 bytes a chunk.
        self._sums: dict[str, bytes] = {}
        store.cache.on_evict(self._forget)

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
                chunk.doc_offsets, chunk.doc_lengths, doc_order, self._tokenizer().add_bos
            )

        return self._streams.get_or_make((d, epoch, c), make)

    def mapped(self, d: int, c: int) -> bool:
        """Chunk c is open here, its tokens' sum known and its body still stored: `verified`
        then reads memory only (unless the body was damaged since)."""
        key = self.indexes[d].keys[c]
        return (
            self._open.peek((d, c)) is not None and key in self._sums and not self.store.gone(key)
        )

    def verified(self, d: int, c: int, here: bool = False) -> TokenChunk:
        """Chunk c opened with its tokens checked now, whatever was checked before: what is
        served is copied from it (a stream laid out, best_fit's tokens), so damage to a body
        while the server runs is found at the next copy, and the chunk rebuilt, never served.
        The first copy in this process checks the body's digests (the store's BLAKE2b, on
        open) and keeps an xxh3-128 of the tokens as mapped; a later copy from the same
        mapping compares the tokens with that at memory speed (BLAKE2b on every epoch's
        layout cost about 3 ns a token, more than the rest of serving: bench/, wire section),
        and on a mismatch checks the digests again, which drops and rebuilds a damaged body.
        `here` (the event loop): NotMapped instead of opening the chunk (disk reads, digests,
        perhaps a rebuild), which the caller leaves to a thread."""
        key = self.indexes[d].keys[c]
        opened, want = self._open.peek((d, c)), self._sums.get(key)
        if opened is not None and want is not None and not self.store.gone(key):
            if _tokens_sum(opened) == want:
                return opened
        if here:
            raise NotMapped(key)
        self.store.forget_verified(key)
        self._open.discard((d, c))
        chunk = self.chunk(d, c)
        self._sums[key] = _tokens_sum(chunk)
        return chunk

    def bestfit_tokens(self, d: int, c: int) -> np.ndarray:
        """Chunk c's tokens, verified and copied (best_fit reads rows from them)."""
        return self.tokens.get_or_make((d, c), lambda: np.array(self.verified(d, c).tokens))

    def bestfit_layout(self, d: int, c: int, seq_len: int | None = None) -> bestfit.BestFitLayout:
        """Chunk c's best-fit layout at `seq_len` (the job's by default; a phase may change
        it). Best-fit rows do not depend on the epoch's document order (the rows are
        permuted)."""
        L = self.spec.seq_len if seq_len is None else seq_len

        def make() -> bestfit.BestFitLayout:
            lengths = self.chunk(d, c).doc_lengths
            return bestfit.bestfit_layout(lengths, L, self._tokenizer().add_bos)

        return self._layouts.get_or_make((d, c, L), make)


def _tokens_sum(chunk: TokenChunk) -> bytes:
    return xxhash.xxh3_128_digest(np.ascontiguousarray(chunk.tokens).data)
