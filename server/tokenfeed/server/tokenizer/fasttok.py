"""tiktoken as an exact engine for the byte-level BPE tokenizer.json files it can reproduce
(bpeexact.py decides which, and builds the encoding): documents encoded on a thread pool, as HF's
ids. The load-time parity sample (`edge_sample`) is paritysample.py's, importable from here too.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from tokenfeed.server.tokenizer import ENGINE_PROCESSES_ENV
from tokenfeed.server.tokenizer.bpeexact import NotExact, exact_encoder
from tokenfeed.server.tokenizer.paritysample import edge_sample

__all__ = ["FastEngine", "NotExact", "edge_sample"]


# Memory the engines' pool threads may take in all on a machine for Encodings of their own
# (`FastEngine._own`), and what one takes a rank: tiktoken's Rust maps of the ranks, measured
# at 33 MB for 128 K ranks (about 260 bytes a rank; bench/, tokenization). 512 MiB gives 16
# threads their own at 128 K ranks, 10 at 200 K; the threads past it share their engine's
# settled Encoding. The processes of one build share it (ENGINE_PROCESSES_ENV: `own_bytes`);
# a process's engines share its part (`_LEDGER`).
OWN_ENCODINGS_BYTES = 512 * 2**20
ENCODING_BYTES_PER_RANK = 260


def own_bytes() -> int:
    """This process's part of OWN_ENCODINGS_BYTES: an equal share among the processes of a
    build on this machine (ENGINE_PROCESSES_ENV), all of it elsewhere."""
    try:
        processes = int(os.environ.get(ENGINE_PROCESSES_ENV, "1"))
    except ValueError:
        processes = 1
    return OWN_ENCODINGS_BYTES // max(processes, 1)


class _Ledger:
    """What the threads of this process's engines (a server has one a job) hold in Encodings
    of their own, against `own_bytes`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    def take(self, size: int) -> bool:
        with self._lock:
            if self.held + size > own_bytes():
                return False
            self.held += size
            return True

    def give_back(self, held: list[int]) -> None:
        """An engine's Encodings let go (`held`: its count, zeroed)."""
        with self._lock:
            self.held -= held[0]
            held[0] = 0


_LEDGER = _Ledger()
# What an item that is a bad record encodes to (`FastEngine.encode_items`).
_BAD = np.zeros(0, dtype=np.int32)


def held_bytes() -> int:
    """The bytes this process's engines' threads hold in Encodings of their own (estimated:
    ENCODING_BYTES_PER_RANK a rank)."""
    return _LEDGER.held


class FastEngine:
    """A tiktoken Encoding with the HF ids of its ranks, encoding documents on a thread pool
    (tiktoken releases the GIL while it encodes). Given `make` (a maker of independent
    Encodings of the same ranks: bpeexact.exact_encoder), each pool thread encodes with an
    Encoding of its own while the process's engines hold less than `own_bytes` of them
    (`_own`)."""

    def __init__(
        self,
        encoding,
        rank_to_id: np.ndarray | None,
        threads: int | None = None,
        make: Callable[[], Any] | None = None,
    ):
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self._luts: dict[np.dtype, np.ndarray] = {}
        self._allowed = frozenset(encoding.special_tokens_set)
        self._threads = threads or len(os.sched_getaffinity(0))
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._make = make
        self._copies: dict[int, Any] = {}  # each pool thread's Encoding, by thread ident
        # What one Encoding of its own takes, and what this engine's threads hold (given back
        # to the process's ledger on `release`, or when the engine goes).
        self._each = ENCODING_BYTES_PER_RANK * max(encoding.n_vocab, 1) if make else 0
        self._held = [0]
        weakref.finalize(self, _LEDGER.give_back, self._held)
        self._settle()

    def _settle(self) -> None:
        """Encode a sample once on a thread of its own that then ends, before any pool thread
        encodes. The threads that encode first in a process stay slower for as long as they
        encode beside others: two threads spent 25-40% more CPU on the same documents (bench/,
        tokenization). Most likely the split pattern's regex engines, whose match caches sit in
        pools with a fast path for their first user: its bookkeeping writes a word that every
        other thread's search reads. A first user that has ended writes nothing.
        The sample's ids are the ones the load-time check compares with HF's; a failure here
        is left to that check."""

        def encode() -> None:
            try:
                self._encode_group(edge_sample())
            except Exception:  # noqa: BLE001 - the parity check encodes it again and reports
                pass

        thread = threading.Thread(target=encode, name="tiktoken-settle", daemon=True)
        thread.start()
        thread.join()

    @classmethod
    def from_config(cls, config: dict[str, Any], encode_special_tokens: bool = False):
        """From a tokenizer.json's parsed content; `NotExact` when it cannot be exact."""
        make, rank_to_id = exact_encoder(config, encode_special_tokens)
        return cls(make(), rank_to_id, make=make)

    def _own(self):
        """The Encoding this pool thread encodes with: one of its own, made at its first
        encode while the budget allows, else the engine's. tiktoken's clones of one Encoding
        share its split pattern's regex engines, whose match caches sit in pools with a lock
        (or, for their first user, a fast path whose bookkeeping every other thread reads):
        threads sharing one spent 25% more CPU on the same documents than threads with an
        Encoding each (2 threads, bench/, tokenization). An Encoding made and only used by
        one thread takes its fast path alone."""
        me = threading.get_ident()
        found = self._copies.get(me)
        if found is None:
            found = self.encoding
            if self._make is not None and _LEDGER.take(self._each):
                found = self._make()
                with self._pool_lock:
                    self._held[0] += self._each
            self._copies[me] = found
        return found

    def release(self) -> None:
        """Let go of the pool threads' own Encodings (a server whose jobs are built keeps no
        memory for them): a thread that encodes again makes its own again (a few ms to 0.1 s
        each, by the size of the vocabulary). A call encoding meanwhile keeps the ones it
        took until it ends."""
        with self._pool_lock:
            self._drop_copies()

    def _drop_copies(self) -> None:
        """The threads' own Encodings forgotten and given back to the ledger (`_pool_lock`
        held)."""
        self._copies = {}
        _LEDGER.give_back(self._held)

    def _encode_group(self, texts: list[str]) -> list[np.ndarray]:
        enc = self.encoding.encode_to_numpy
        return [enc(t, allowed_special=self._allowed, disallowed_special=()) for t in texts]

    def _drain(
        self,
        items: Sequence[Any],
        text: Callable[[Any], str | None] | None,
        order: Iterator[int],
        out: list,
        lut: np.ndarray | None,
        dtype,
    ) -> None:
        """On a pool thread: encodes the next document of `order` into HF ids in `dtype` until
        none is left. The threads share `order`: a list iterator's next is atomic under the
        GIL. Each document's ids are mapped here, not the call's at its end, where the other
        threads would wait (2 ms of each 512-document call; bench/, tokenization). With `text`,
        each item's text is found here too (a bad record: `_BAD`)."""
        enc, allowed = self._own().encode_to_numpy, self._allowed
        for d in order:
            t = items[d] if text is None else text(items[d])
            if t is None:
                out[d] = _BAD
                continue
            ranks = enc(t, allowed_special=allowed, disallowed_special=())
            out[d] = ranks.astype(dtype) if lut is None else lut.take(ranks)

    def _lut(self, dtype: np.dtype) -> np.ndarray | None:
        """HF's id of each rank in `dtype`; None where they are the ranks."""
        if self.rank_to_id is None:
            return None
        lut = self._luts.get(dtype)
        if lut is None:
            lut = self._luts[dtype] = self.rank_to_id.astype(dtype)
        return lut

    def encode(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """All documents' HF ids concatenated in `dtype`, and each document's length (int32)."""
        ids, lengths, _ = self.encode_items(texts, dtype)
        return ids, lengths

    def encode_items(
        self,
        items: Sequence[Any],
        dtype: np.dtype,
        text: Callable[[Any], str | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(HF ids of the items' documents concatenated in `dtype`, each document's length
        (int32), which items are documents). Without `text` the items are the texts, each one a
        document, and the third is None. With it, the pool thread that encodes an item finds
        its text first (None: a bad record, left out): a JSON line's parse then
        runs between other documents' encodes, a few us of the GIL at a time, where a whole
        chunk's lines parsed before the call held the GIL for milliseconds while the pool's
        threads waited (bench/, tokenization)."""
        with self._pool_lock:
            # A forked child inherits the pool object but none of its threads.
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = cf.ThreadPoolExecutor(self._threads, thread_name_prefix="tiktoken")
                self._pool_pid = os.getpid()
                self._drop_copies()  # a forked child's threads have none yet
        pool = self._pool
        arrays: list[np.ndarray | None] = [None] * len(items)
        # Longest first, each thread taking the next document as it is free: the call's last
        # moments are its shortest documents, so no thread waits long for another at its end
        # (tasks of up to 32 documents, largest first, left about 1 ms of each 512-document
        # call to one thread alone; bench/, tokenization). An item's size stands for its
        # text's (a JSON line's is its text's and a few bytes).
        order = iter(sorted(range(len(items)), key=lambda d: -len(items[d])))
        args = (items, text, order, arrays, self._lut(np.dtype(dtype)), dtype)
        for f in [pool.submit(self._drain, *args) for _ in range(self._threads)]:
            f.result()
        encoded = [a for a in arrays if a is not None]
        if len(encoded) != len(items):  # every thread ended without error: cannot be
            raise RuntimeError(f"{len(items) - len(encoded)} of {len(items)} documents not encoded")
        good = None
        if text is not None:
            good = np.fromiter((a is not _BAD for a in encoded), dtype=bool, count=len(encoded))
        done = [a for a in encoded if a is not _BAD]
        lengths = np.fromiter((a.size for a in done), dtype=np.int32, count=len(done))
        ids = np.concatenate(done) if done else np.zeros(0, dtype=dtype)
        return ids, lengths, good
