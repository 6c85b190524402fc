"""What a phase that changes the packing reads of a dataset's documents (sampling's
ChunkShapes): per chunk, its units in the concat stream (from the index's totals), its best-fit
rows at another seq_len (every chunk's document lengths: counted in the background, the steps
that need them wait meanwhile), and where a best-fit row's pieces lie in the concat stream.

Counting best-fit rows at a new seq_len opens every chunk of the dataset once (a chunk evicted
from the cache is fetched again, or rebuilt): it starts when the plan gains the phase, which is
at least `plan_freeze_steps` before the phase's first step, and is kept for the life of the
process (a restarted server counts again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import NotBuiltError
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.server.sampling import order

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class DatasetDocs(Protocol):
    """What this reads of a dataset's index (indexing/index.py's DatasetIndex)."""

    @property
    def dataset(self) -> _Named: ...
    @property
    def num_docs(self) -> np.ndarray: ...
    @property
    def num_tokens(self) -> np.ndarray: ...


class ChunkShapes:
    def __init__(
        self,
        job: str,
        seed: int,
        indexes: Sequence[DatasetDocs],
        doc_lengths: Callable[[int, int], np.ndarray],
        add_bos: Callable[[], bool],
        counted: Callable[[], None],
    ):
        """`doc_lengths(d, c)` opens chunk c of dataset d (blocking: called in a thread),
        `add_bos()` is the job's tokenizer's, `counted()` is told (from that thread) when a
        count is done."""
        self.job, self.seed, self.indexes = job, seed, indexes
        self._doc_lengths, self._add_bos, self._counted = doc_lengths, add_bos, counted
        self._units: dict[tuple[int, int], np.ndarray] = {}
        self._lengths: LRU[tuple[int, int], np.ndarray] = LRU(4096)
        self._layouts: LRU[tuple[int, int, int], bestfit.BestFitLayout] = LRU(1024)
        self._counting: dict[tuple[int, int], tuple[int, str]] = {}  # key -> (chunks done, error)
        self._reading: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def concat_units(self, d: int) -> np.ndarray:
        idx = self.indexes[d]
        tokens, docs = (np.asarray(a, dtype=np.int64) for a in (idx.num_tokens, idx.num_docs))
        return packing.concat_units(tokens, docs, self._add_bos())

    def bestfit_units(self, d: int, seq_len: int) -> np.ndarray:
        key = (d, seq_len)
        found = self._units.get(key)
        if found is not None:
            return found
        self.count(d, seq_len)
        with self._lock:
            done, error = self._counting.get(key, (0, ""))
        name, n = self.indexes[d].dataset.name, len(self.indexes[d].num_docs)
        why = f" (last try: {error})" if error else ""
        raise NotBuiltError(
            (
                f"job {self.job}: the best-fit rows of dataset {name} at seq_len {seq_len} are "
                f"being counted for a phase that changes the packing ({done} of {n} chunks)"
                f"{why}",
                RETRY_SECONDS,
            )
        )

    def count(self, d: int, seq_len: int) -> None:
        """Start counting dataset d's best-fit rows at `seq_len` (once; in the background)."""
        key = (d, seq_len)
        with self._lock:
            if key in self._units or (key in self._counting and not self._counting[key][1]):
                return
            self._counting[key] = (0, "")
        threading.Thread(
            target=self._count, args=(d, seq_len), name=f"shapes-{self.job}-{d}", daemon=True
        ).start()

    def _count(self, d: int, seq_len: int) -> None:
        key, n = (d, seq_len), len(self.indexes[d].num_docs)
        rows = np.zeros(n, dtype=np.int64)
        try:
            bos = self._add_bos()
            for c in range(n):
                rows[c] = bestfit.bestfit_rows(self.lengths(d, c), seq_len, bos)
                with self._lock:
                    self._counting[key] = (c + 1, "")
        except Exception as e:  # retried by the next step that needs it
            log.warning("job %s: counting best-fit rows failed: %s", self.job, e)
            with self._lock:
                self._counting[key] = (0, str(e) or type(e).__name__)
            return
        self._units[key] = rows
        with self._lock:
            self._counting.pop(key, None)
        self._counted()

    def _read(self, d: int, chunks: list[int]) -> None:
        """Open `chunks` of dataset d in the background (their document lengths kept)."""
        with self._lock:
            todo = [c for c in chunks if (d, c) not in self._reading]
            self._reading.update((d, c) for c in todo)
        if not todo:
            return

        def read() -> None:
            try:
                for c in todo:
                    self.lengths(d, c)
            except Exception as e:  # retried by the next step that needs them
                log.warning("job %s: reading chunks for a packing change failed: %s", self.job, e)
            finally:
                with self._lock:
                    self._reading.difference_update((d, c) for c in todo)
            self._counted()

        threading.Thread(target=read, name=f"shapes-{self.job}-{d}", daemon=True).start()

    def lengths(self, d: int, c: int) -> np.ndarray:
        return self._lengths.get_or_make((d, c), lambda: self._doc_lengths(d, c))

    def bestfit_stretches(
        self, d: int, seq_len: int, epoch: int, chunks: np.ndarray, rows: np.ndarray
    ) -> list[list[tuple[int, int]]]:
        """For best-fit row rows[i] (at `seq_len`) of chunk chunks[i], the stretches of the
        chunk's concat stream in `epoch` its pieces are (offsets within that stream)."""
        missing = {c for c in np.asarray(chunks).tolist() if not self._lengths.contains((d, c))}
        if missing:
            self._read(d, sorted(missing))
            raise NotBuiltError(
                (
                    f"job {self.job}: reading the documents of {len(missing)} chunks of dataset "
                    f"{self.indexes[d].dataset.name} for a phase that changes the packing",
                    RETRY_SECONDS,
                )
            )
        bos = self._add_bos()
        out = []
        for c, r in zip(np.asarray(chunks).tolist(), np.asarray(rows).tolist(), strict=True):
            lengths = self.lengths(d, c)
            layout = self._layouts.get_or_make(
                (d, c, seq_len), partial(bestfit.bestfit_layout, lengths, seq_len, bos)
            )
            name = self.indexes[d].dataset.name
            doc_order = order.document_order(len(lengths), self.seed, name, epoch, c)
            out.append(bestfit.row_stretches(layout, doc_order, r))
        return out
