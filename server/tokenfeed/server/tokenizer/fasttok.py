"""tiktoken as an exact engine for the byte-level BPE tokenizer.json files it can reproduce
(bpeexact.py decides which, and builds the encoding): documents encoded on a thread pool, as HF's
ids. The load-time parity sample (`edge_sample`) is paritysample.py's, importable from here too.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any

import numpy as np
from tokenfeed.server.tokenizer.bpeexact import NotExact, exact_encoding
from tokenfeed.server.tokenizer.paritysample import edge_sample

__all__ = ["FastEngine", "NotExact", "edge_sample"]

# A thread task: up to this many documents, and no more characters than this (a longer
# document is a task of its own). Tasks go largest first, so a batch's long documents do not
# leave the other threads idle at its end: with documents of a few KB and a few of 100 KB or
# more, tasks of 32 documents left a build at 0.7 of bare tiktoken (bench/, tokenization).
_DOCS_PER_TASK = 32
_CHARS_PER_TASK = 64 * 1024


class FastEngine:
    """A tiktoken Encoding with the HF ids of its ranks, encoding documents on a thread pool
    (tiktoken releases the GIL while it encodes)."""

    def __init__(self, encoding, rank_to_id: np.ndarray | None, threads: int | None = None):
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self._luts: dict[np.dtype, np.ndarray] = {}
        self._allowed = frozenset(encoding.special_tokens_set)
        self._threads = threads or len(os.sched_getaffinity(0))
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
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
        return cls(*exact_encoding(config, encode_special_tokens))

    def _encode_group(self, texts: list[str]) -> list[np.ndarray]:
        enc = self.encoding.encode_to_numpy
        return [enc(t, allowed_special=self._allowed, disallowed_special=()) for t in texts]

    def encode(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """All documents' HF ids concatenated in `dtype`, and each document's length (int32)."""
        with self._pool_lock:
            # A forked child inherits the pool object but none of its threads.
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = cf.ThreadPoolExecutor(self._threads, thread_name_prefix="tiktoken")
                self._pool_pid = os.getpid()
        groups = _tasks(texts)
        pool = self._pool
        by_size = sorted(range(len(groups)), key=lambda g: -sum(map(len, groups[g])))
        futures = {g: pool.submit(self._encode_group, groups[g]) for g in by_size}
        arrays = [a for g in range(len(groups)) for a in futures[g].result()]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int32, count=len(arrays))
        ranks = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)
        if self.rank_to_id is None:
            return ranks.astype(dtype), lengths
        lut = self._luts.get(dtype)
        if lut is None:
            lut = self._luts[dtype] = self.rank_to_id.astype(dtype)
        return lut[ranks], lengths


def _tasks(texts: list[str]) -> list[list[str]]:
    """The texts cut, in order, into runs of at most _DOCS_PER_TASK documents and (but for a
    longer document alone) _CHARS_PER_TASK characters."""
    out: list[list[str]] = []
    run: list[str] = []
    chars = 0
    for t in texts:
        if run and (len(run) == _DOCS_PER_TASK or chars + len(t) > _CHARS_PER_TASK):
            out.append(run)
            run, chars = [], 0
        run.append(t)
        chars += len(t)
    if run:
        out.append(run)
    return out
