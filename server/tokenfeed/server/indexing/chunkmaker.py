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
from dataclasses import dataclass

import numpy as np
from tokenfeed.server.errors import (
    BadRecordError,
    BuildCancelled,
    ChunkMissing,
    SourceChangedError,
    StoreCorruptError,
)
from tokenfeed.server.indexing.owner import ChunkOwner
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.source import pretokenized
from tokenfeed.server.source.chunks import Chunk
from tokenfeed.server.source.readers import BadRecord, ChunkDocuments, read_lines, read_pieces
from tokenfeed.server.store.chunkfiles import ChunkIndex, encode_chunk
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.store.tokstore import TokenChunk, TokenStore
from tokenfeed.server.telemetry import metrics
from tokenfeed.server.tokenizer.tokenize import TextTokenizer

log = logging.getLogger(__name__)

BAD_EXAMPLES_PER_CHUNK = 20
# A chunk is tokenized in pieces of one encode batch (TextTokenizer.batch_docs: 512 documents
# with HF's engine, 4096 with tiktoken's), PIECES_IN_FLIGHT at once with HF's engine while the
# next piece is parsed: see ChunkMaker._encode. Two are enough for one piece's GIL-bound part
# to hide behind the other's encoding.
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


@dataclass(frozen=True)
class MakerSetup:
    """What one dataset's chunks are made with: where they are kept and fetched from, and the
    job's policy. The dataset's index (index.py) holds the chunk list and says which chunk."""

    label: str  # "job" or "job/dataset": how messages name the dataset
    job: str  # the job's name (metrics labels, the owner's requests)
    position: int  # the dataset's place in its job (the owner's requests)
    strict: bool  # bad_records: strict
    store: TokenStore
    storage: ObjectStorage
    shared: SharedStore | None = None
    # In a serving worker: the process that owns the cache, plans and tokenizes (control.py).
    owner: ChunkOwner | None = None


class ChunkMaker:
    """Makes the chunks of one dataset: each call names the chunk (its number i in the
    dataset, its key and its plan), so the maker holds no view of the index."""

    def __init__(self, setup: MakerSetup, cancelled: threading.Event):
        self.setup, self._cancelled = setup, cancelled
        self.store, self.shared, self.owner = setup.store, setup.shared, setup.owner
        self.tokenizer: TextTokenizer | None = None  # the job's, once it is loaded
        # An offline build into a shared store keeps only manifests here (the store has all).
        self.keep_bodies = True

    @property
    def loaded_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise RuntimeError(f"job {self.setup.label}: chunks made before the tokenizer loaded")
        return self.tokenizer

    def find_or_defer(self, i: int, key: str, chunk: Chunk, since: float) -> ChunkIndex | None:
        """Runs in a worker thread: chunk i's entry, or None to come back to it later (it is
        another live node's to tokenize and not published yet, or the owner has not committed
        it yet)."""
        shared = self.shared
        if self.owner is not None and self.store.get_index(key) is None:
            return None  # the supervisor has not committed it yet
        if shared is not None and self.store.get_index(key) is None:
            if shared.manifest(key) is None:
                if not shared.mine(key):
                    if time.monotonic() - since < shared.spec.takeover_seconds:
                        return None
                    log.info(
                        "job %s: taking over %s from node %s after %.0fs",
                        self.setup.label,
                        chunk.describe(),
                        shared.owner(key),
                        time.monotonic() - since,
                    )
                    metrics.STORE_CHUNKS.labels("taken_over").inc()
                    shared.counts.taken_over += 1
        return self.ensure(i, key, chunk)

    def open_body(self, i: int, key: str, chunk: Chunk) -> tuple[ChunkIndex, TokenChunk]:
        """Runs in a worker thread: the chunk's tokens, rebuilding them if evicted or corrupt."""
        with self.store.cache.pinned([("chunk", key)]):  # not evicted between build and open
            self.store.cache.lookup("chunk", key)  # a hit, or a miss that rebuilds the body
            for _ in range(3):
                entry = self.ensure(i, key, chunk, body=True)
                try:
                    return entry, self.store.open(key)
                except StoreCorruptError as e:
                    log.warning(
                        "job %s: %s; re-tokenizing %s", self.setup.label, e, chunk.describe()
                    )
                except ChunkMissing:
                    pass
        raise StoreCorruptError(
            f"token chunk {key} of {chunk.describe()} cannot be rebuilt in the cache"
        )

    def ensure(self, i: int, key: str, chunk: Chunk, body: bool = False) -> ChunkIndex:
        """Runs in a worker thread: the chunk's index entry, tokenizing the chunk if it was never
        stored (or, with `body`, if its tokens are not in the cache). Concurrent callers for
        one chunk tokenize it once."""
        store = self.store
        found = store.get_index(key)
        if self.owner is not None and (found is None or body and not store.has_body(key)):
            self.owner.ensure(self.setup.job, self.setup.position, i)  # the owner builds it
            found = store.get_index(key)
            if found is None:
                raise StoreCorruptError(
                    f"token chunk {key} is missing after the supervisor built it"
                )
        if found is not None and (not body or store.has_body(key)):
            # Possibly stored by a job with the skip policy: the manifest kept the locations.
            self._check_policy(found.bad_examples)
            return found
        built: list[ChunkIndex] = []
        store.cache.fill_once("chunk", key, lambda: built.append(self._fetch(key, chunk, body)))
        entry = built[0] if built else store.get_index(key)
        if entry is None:
            raise StoreCorruptError(f"token chunk {key} vanished while it was built")
        if not built:  # built by another job, whose policy may differ from ours
            self._check_policy(entry.bad_examples)
        if found is not None and entry.digest != found.digest:
            raise SourceChangedError(
                f"job {self.setup.label}: {chunk.describe()} tokenized to other bytes than "
                f"when it was indexed ({found.digest} -> {entry.digest}): the source or the "
                "tokenizer changed; restart the job on a stable corpus"
            )
        return entry

    def _fetch(self, key: str, chunk: Chunk, body: bool) -> ChunkIndex:
        """The chunk from the shared store (its manifest, and its body if `body`), or else
        tokenized here (and published)."""
        shared = self.shared
        if shared is not None:
            raw = shared.manifest(key)
            if raw is not None and not body:
                metrics.STORE_CHUNKS.labels("indexed").inc()
                shared.counts.fetched += 1
                return self.store.put_manifest(key, raw)
            encoded = shared.body(key, raw) if raw is not None else None
            if encoded is not None:
                return self.store.put_encoded(encoded)
        return self._tokenize(key, chunk)

    def _tokenize(self, key: str, chunk: Chunk) -> ChunkIndex:
        started = time.monotonic()
        tokenizer, label = self.loaded_tokenizer, self.setup.label
        source = self.setup.storage.for_uri(chunk.source.uri)
        docs: pretokenized.PretokenizedChunk | ChunkDocuments
        if chunk.kind in pretokenized.KINDS:  # token ids already: no tokenizer
            pre = pretokenized.read_chunk(source, chunk, tokenizer)
            self._check_policy([str(b) for b in pre.bad])
            docs, tokens, lengths = pre, pre.tokens, pre.lengths
        elif tokenizer.engine == "tiktoken" and (lines := read_lines(source, chunk)) is not None:
            # JSON Lines for tiktoken: its threads parse each line as they take it (the GIL a
            # few us at a time), where a parse before the encode left them idle (bench/,
            # tokenization); the chunk's records are settled once its lines are encoded.
            with _slot(tokenizer):
                tokens, lengths, good = tokenizer.encode_items(
                    lines.lines, lines.text, self._stop_point
                )
            docs = lines.documents(good)
            self._check_policy([str(b) for b in docs.bad[:1]])
        else:
            docs, pieces = read_pieces(source, chunk, tokenizer.batch_docs)  # I/O, no slot
            with _slot(tokenizer):
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
            fields = {"job": label, "reason": b.reason, "location": b.location}
            log.warning("job %s: skipped bad record %s", label, b, extra=fields)
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
        entry = self.store.put_encoded(encoded, body=self.keep_bodies)
        if self.shared is not None:
            self.shared.publish(encoded)
        job = self.setup.job
        metrics.TOKENIZED_DOCUMENTS.labels(job).inc(len(lengths))
        metrics.TOKENIZED_TOKENS.labels(job).inc(len(tokens))
        metrics.TOKENIZED_BYTES.labels(job).inc(chunk.raw_bytes)
        metrics.TOKENIZE_SECONDS.labels(job).inc(time.monotonic() - started)
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
        tokenizer, stop = self.loaded_tokenizer, self._stop_point
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
        if self._cancelled.is_set():
            raise BuildCancelled

    def _check_policy(self, bad: list[str]) -> None:
        if bad and self.setup.strict:
            raise BadRecordError(
                f"job {self.setup.label}: bad record at {bad[0]}; the job's policy is strict "
                f"(set bad_records: skip to skip, count and log such records)"
            )
