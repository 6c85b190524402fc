"""One chunk of a dataset's token store made: found in this node's store, fetched from the
fleet's shared store when published there, or else read and tokenized here (and published),
with the job's bad-record policy applied (every bad record counted and located). Runs in
worker threads; concurrent callers for one chunk make it once (the cache's single flight).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import numpy as np
from tokenfeed.server.errors import (
    BadRecordError,
    BuildCancelled,
    ChunkMissing,
    SourceChangedError,
    StoreCorruptError,
)
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.server.source import pretokenized
from tokenfeed.server.source.readers import BadRecord, ChunkDocuments, read_pieces
from tokenfeed.server.store.chunkfiles import ChunkIndex, encode_chunk
from tokenfeed.server.store.tokstore import TokenChunk
from tokenfeed.server.telemetry import metrics
from tokenfeed.server.tokenizer.tokenize import ENCODE_BATCH_DOCS, TextTokenizer

if TYPE_CHECKING:
    from tokenfeed.server.indexing.index import DatasetIndex

log = logging.getLogger(__name__)

BAD_EXAMPLES_PER_CHUNK = 20
# A chunk is tokenized in pieces of this many documents (one encode batch), PIECES_IN_FLIGHT
# at once with HF's engine while the next piece is parsed: see ChunkMaker._encode. Two are
# enough for one piece's GIL-bound part to hide behind the other's encoding.
PIECE_DOCS = ENCODE_BATCH_DOCS
PIECES_IN_FLIGHT = 2


# One chunk at a time per tiktoken engine parses and encodes in a process; see _slot.
_TIKTOKEN_SLOTS: weakref.WeakKeyDictionary[TextTokenizer, threading.Lock] = (
    weakref.WeakKeyDictionary()
)
_SLOTS_LOCK = threading.Lock()


def _slot(tokenizer: TextTokenizer) -> AbstractContextManager:
    """What a chunk holds while its lines are parsed and its documents encoded. tiktoken takes
    the GIL around every document, so a second chunk parsing in the same process (a server's
    `tokenize` pool) starves its threads: with it, chunks take turns, and only their reads and
    writes (which release the GIL) overlap. HF's threads encode without the GIL: its chunks
    overlap freely."""
    if tokenizer.engine == "hf":
        return contextlib.nullcontext()
    with _SLOTS_LOCK:
        return _TIKTOKEN_SLOTS.setdefault(tokenizer, threading.Lock())


class ChunkMaker:
    """Makes the chunks of one dataset's index (`ix`: its chunks, keys, store and tokenizer)."""

    def __init__(self, ix: DatasetIndex):
        self.ix = ix

    def index_or_defer(self, i: int, since: float) -> tuple[ChunkIndex, int] | None:
        """Runs in a worker thread: index chunk i, or None to come back to it later (it is
        another live node's to tokenize and not published yet)."""
        key, shared = self.ix.keys[i], self.ix.shared
        if self.ix.supervisor is not None and self.ix.store.get_index(key) is None:
            return None  # the supervisor has not committed it yet
        if shared is not None and self.ix.store.get_index(key) is None:
            if shared.manifest(key) is None:
                if not shared.mine(key):
                    if time.monotonic() - since < shared.spec.takeover_seconds:
                        return None
                    log.info(
                        "job %s: taking over %s from node %s after %.0fs",
                        self.ix.name,
                        self.ix.chunks[i].describe(),
                        shared.owner(key),
                        time.monotonic() - since,
                    )
                    metrics.STORE_CHUNKS.labels("taken_over").inc()
                    shared.counts.taken_over += 1
        return self.index_chunk(i)

    def index_chunk(self, i: int) -> tuple[ChunkIndex, int]:
        """Runs in a worker thread: the chunk's entry and its units in the dataset's stream."""
        if self.ix.spec.packing == "concat":
            entry = self.ensure_chunk(i)
            return entry, packing.concat_units(
                entry.num_tokens, entry.num_docs, self.ix.tokenizer.add_bos
            )
        # best_fit needs every document's length, not just the totals: the body is opened
        entry, chunk = self.open_body(i)
        return entry, bestfit.bestfit_rows(
            chunk.doc_lengths, self.ix.spec.seq_len, self.ix.tokenizer.add_bos
        )

    def open_body(self, i: int) -> tuple[ChunkIndex, TokenChunk]:
        """Runs in a worker thread: the chunk's tokens, rebuilding them if evicted or corrupt."""
        key = self.ix.keys[i]
        with self.ix.store.cache.pinned([("chunk", key)]):  # not evicted between build and open
            self.ix.store.cache.lookup("chunk", key)  # a hit, or a miss that rebuilds the body
            for _ in range(3):
                entry = self.ensure_chunk(i, body=True)
                try:
                    return entry, self.ix.store.open(key)
                except StoreCorruptError as e:
                    log.warning(
                        "job %s: %s; re-tokenizing %s",
                        self.ix.name,
                        e,
                        self.ix.chunks[i].describe(),
                    )
                except ChunkMissing:
                    pass
        raise StoreCorruptError(
            f"token chunk {key} of {self.ix.chunks[i].describe()} cannot be rebuilt in the cache"
        )

    def ensure_chunk(self, i: int, body: bool = False) -> ChunkIndex:
        """Runs in a worker thread: the chunk's index entry, tokenizing the chunk if it was never
        stored (or, with `body`, if its tokens are not in the cache). Concurrent callers for
        one chunk tokenize it once."""
        key = self.ix.keys[i]
        found = self.ix.store.get_index(key)
        if self.ix.supervisor is not None and (
            found is None or body and not self.ix.store.has_body(key)
        ):
            self.ix.supervisor.ensure(self.ix.spec.name, self.ix.position, i)  # the owner builds it
            found = self.ix.store.get_index(key)
            if found is None:
                raise StoreCorruptError(
                    f"token chunk {key} is missing after the supervisor built it"
                )
        if found is not None and (not body or self.ix.store.has_body(key)):
            # Possibly stored by a job with the skip policy: the manifest kept the locations.
            self._check_policy(found.bad_examples)
            return found
        built: list[ChunkIndex] = []
        self.ix.store.cache.fill_once("chunk", key, lambda: built.append(self._fetch(i, body)))
        entry = built[0] if built else self.ix.store.get_index(key)
        if entry is None:
            raise StoreCorruptError(f"token chunk {key} vanished while it was built")
        if not built:  # built by another job, whose policy may differ from ours
            self._check_policy(entry.bad_examples)
        if found is not None and entry.digest != found.digest:
            raise SourceChangedError(
                f"job {self.ix.name}: {self.ix.chunks[i].describe()} tokenized to other bytes than "
                f"when it was indexed ({found.digest} -> {entry.digest}): the source or the "
                "tokenizer changed; restart the job on a stable corpus"
            )
        return entry

    def _fetch(self, i: int, body: bool) -> ChunkIndex:
        """The chunk from the shared store (its manifest, and its body if `body`), or else
        tokenized here (and published)."""
        key, shared = self.ix.keys[i], self.ix.shared
        if shared is not None:
            raw = shared.manifest(key)
            if raw is not None and not body:
                metrics.STORE_CHUNKS.labels("indexed").inc()
                shared.counts.fetched += 1
                return self.ix.store.put_manifest(key, raw)
            encoded = shared.body(key, raw) if raw is not None else None
            if encoded is not None:
                return self.ix.store.put_encoded(encoded)
        return self._tokenize(i)

    def _tokenize(self, i: int) -> ChunkIndex:
        key, chunk = self.ix.keys[i], self.ix.chunks[i]
        started = time.monotonic()
        source = self.ix.storage.for_uri(chunk.source.uri)
        docs: pretokenized.PretokenizedChunk | ChunkDocuments
        if chunk.kind in pretokenized.KINDS:  # token ids already: no tokenizer
            pre = pretokenized.read_chunk(source, chunk, self.ix.tokenizer)
            self._check_policy([str(b) for b in pre.bad])
            docs, tokens, lengths = pre, pre.tokens, pre.lengths
        else:
            docs, pieces = read_pieces(source, chunk, PIECE_DOCS)  # read: I/O, no slot
            with _slot(self.ix.tokenizer):
                tokens, lengths = self._encode(pieces, docs.bad)
        bad, record_ids = list(docs.bad), np.asarray(docs.record_ids, dtype=np.int64)
        if (lengths == 0).any():
            empty = np.nonzero(lengths == 0)[0]
            bad += [
                BadRecord("no_tokens", f"{chunk.describe()} record {record_ids[d]}") for d in empty
            ]
            self._check_policy([str(b) for b in bad])
            record_ids = record_ids[lengths > 0]
            lengths = lengths[lengths > 0]
        for b in bad:
            fields = {"job": self.ix.name, "reason": b.reason, "location": b.location}
            log.warning("job %s: skipped bad record %s", self.ix.name, b, extra=fields)
        counts = dict(Counter(b.reason for b in bad))
        examples = [str(b) for b in bad[:BAD_EXAMPLES_PER_CHUNK]]
        encoded = encode_chunk(
            key,
            tokens,
            lengths,
            docs.records,
            counts,
            examples,
            chunk.describe(),
            record_ids,
            docs.data_start,
        )
        entry = self.ix.store.put_encoded(encoded, body=self.ix.keep_bodies)
        if self.ix.shared is not None:
            self.ix.shared.publish(encoded)
        metrics.TOKENIZED_DOCUMENTS.labels(self.ix.spec.name).inc(len(lengths))
        metrics.TOKENIZED_TOKENS.labels(self.ix.spec.name).inc(len(tokens))
        metrics.TOKENIZED_BYTES.labels(self.ix.spec.name).inc(chunk.raw_bytes)
        metrics.TOKENIZE_SECONDS.labels(self.ix.spec.name).inc(time.monotonic() - started)
        return entry

    def _encode(
        self, pieces: Iterator[list[str]], bad: list[BadRecord]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pieces' tokens and document lengths, in order; `bad` fills in as the pieces are
        parsed, and under `strict` the first bad record stops the chunk.

        With HF's engine, PIECES_IN_FLIGHT pieces are encoded at once while this thread parses
        the next: its threads need no GIL while they encode, so they stay busy through what
        holds it (parsing lines, one piece's ids made into numpy arrays). tiktoken takes the
        GIL around every document, and a thread parsing beside it would starve its threads:
        its pieces go one after another."""
        tokenizer, stop = self.ix.tokenizer, self._stop_point
        in_flight = PIECES_IN_FLIGHT if tokenizer.engine == "hf" else 1
        tokens: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        encoding: deque[Future] = deque()
        with ThreadPoolExecutor(in_flight, thread_name_prefix="encode") as pool:
            try:
                for texts in pieces:
                    self._check_policy([str(b) for b in bad[:1]])
                    encoding.append(pool.submit(tokenizer.encode, texts, stop))
                    while len(encoding) >= in_flight:
                        t, n = encoding.popleft().result()
                        tokens.append(t)
                        lengths.append(n)
                self._check_policy([str(b) for b in bad[:1]])
                while encoding:
                    t, n = encoding.popleft().result()
                    tokens.append(t)
                    lengths.append(n)
            except BaseException:
                for f in encoding:  # what has not started is not encoded
                    f.cancel()
                raise
        if not tokens:
            return np.zeros(0, dtype=tokenizer.dtype), np.zeros(0, dtype=np.int32)
        return np.concatenate(tokens), np.concatenate(lengths)

    def _stop_point(self) -> None:
        if self.ix.cancelled:
            raise BuildCancelled

    def _check_policy(self, bad: list[str]) -> None:
        if bad and self.ix.spec.bad_records == "strict":
            raise BadRecordError(
                f"job {self.ix.name}: bad record at {bad[0]}; the job's policy is strict "
                f"(set bad_records: skip to skip, count and log such records)"
            )
