"""Row buffers laid out a window ahead of the trainers, by the process that owns the cache.

Rows are shuffled within a window of chunks, so a stream entering a window reads from most of
its chunks within a few steps, and each of their row buffers (the chunk's documents in the
epoch's order, rowlayout.row_buffer) must be laid out first: an epoch's first read of a chunk.
Streams lay out what their next steps read themselves, just before they read it; this lays out
every buffer of the window the job's furthest request is in, and of the next few windows, once
per window, as prefetch follows the trainers (prefetch.keep_ahead). A lone server lays them out
before its streams need them, on its event loop where they are small and their chunks mapped
(`lay_out_soon`), else in its prefetch thread; a supervisor of serving workers lays them
out in its own process and writes them to the node's shared row buffers (pack/sharedrows.py),
which its workers map: the layout of an epoch is paid once for all ranks and off every serving
process (bench/, wire section).

Only what fits: windows past the one being read are laid out only while the row-buffer budget
(`server.stream_cache_bytes`; with workers, half the node's arena) holds them beside it and one
more window; else only the current one, as the docs size the budget. Only
for concat rows of a dataset's first segment (the windows prefetch knows); a later segment's
rows are laid out by the streams that read them, as before. Nothing here changes a byte: a
buffer's bytes are decided by its key, whoever lays it out. Nothing is fetched either: a
buffer whose chunks (its own or its tail's) are not in the cache is left to the streams, since
what the cache holds is prefetch's to choose.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from tokenfeed.server.jobs.job import Job
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.segments import CONCAT

log = logging.getLogger(__name__)

WINDOWS_DONE = 4096  # windows remembered as laid out (then forgotten: a look costs little)
# Windows laid out past the one being read, where the budget holds them: enough that a stream
# whose windows pass in a few dozen steps ([32, 4096] batches of small chunks) never catches up
# with the layouts. With serving workers the supervisor learns the trainers' progress every
# 50 ms (serve/control.py's FLUSH_SECONDS), about two such windows: with 3 ahead the workers
# laid out about half of the buffers themselves, with 8 about 5% (CHANGELOG, Serving).
WINDOWS_AHEAD = 8

Key = tuple[int, int, int, int]  # (dataset, epoch, chunk, position): RowBuffers.row_buffer's


class WindowLayouts:
    """The row buffers of the windows a job's trainers reach next, not yet laid out."""

    def __init__(self, job: Job, budget: int):
        # In a supervisor, the node's arena holds what is laid out ahead: at most half of it,
        # so that what the workers hold in place beside it leaves the ring a segment to write
        # (pack/sharedrows.py) and no buffer is written over before a worker reads it.
        shared = job.assembler.rows.shared
        if shared is not None:
            budget = min(budget, shared.budget // 2)
        self.job, self.budget = job, budget
        self._done: set[tuple[int, int, int]] = set()
        # Per dataset, the windows found for the rows of its last look's window: the same for
        # every row of that window while the schedule is the same (the layouts and the budget
        # are fixed), so a look within it finds them again without a walk.
        self._found: dict[int, _Found] = {}

    def keys_ahead(self, step: int) -> list[Key]:
        """Row-buffer keys of the window that step's rows start in and of up to WINDOWS_AHEAD
        windows after it (as many as the budget holds beside the current one), for windows not
        handed out before: nearest window first, each one last position first (a tail is cut
        from the buffer after it)."""
        first, end = self.job.planner.schedule.row_spans(step, step + 1)
        out: list[Key] = []
        for d, (row, after) in enumerate(zip(first, end, strict=True)):
            if row == after:
                continue  # no row of d in this step
            for key, lay in self._windows(d, row):
                if key in self._done:
                    continue
                if len(self._done) >= WINDOWS_DONE:
                    self._done.clear()
                self._done.add(key)
                out += _keys(lay, *key)
        return out

    def _windows(self, d: int, row: int) -> list[tuple[tuple[int, int, int], order.EpochLayout]]:
        """((d, epoch, window), layout) of the window `row` starts in and of the windows after
        it that the budget holds; none for rows the streams lay out themselves."""
        planner = self.job.planner
        idx, schedule = planner.indexes[d], planner.schedule
        found = self._found.get(d)
        if found is not None and found.lo <= row < found.hi and found.schedule is schedule:
            return found.windows if idx.ready else []
        if not idx.ready:  # first: segments made while it builds would be remembered
            return []
        segs = planner.segments(d)
        if segs[0].packing != CONCAT:
            return []
        if len(segs) > 1 and row >= segs[1].first_row:
            return []  # a later segment: its streams lay its rows out
        e = row * idx.per_row // idx.units_per_epoch
        lay = planner.layout(d, e)
        w = int(lay.window_rows.searchsorted(row, side="right")) - 1
        windows = [(e, w, lay)]
        held = self._bytes(d, lay, w)
        while len(windows) <= WINDOWS_AHEAD:
            after = self._after(d, *windows[-1])
            size = self._bytes(d, after[2], after[1])
            if held + 2 * size > self.budget:  # the one read, and a stream's own next one
                break
            windows.append(after)
            held += size
        lo, hi = int(lay.window_rows[w]), int(lay.window_rows[w + 1])
        if len(segs) > 1:
            hi = min(hi, segs[1].first_row)
        out = [((d, e, w), lay) for e, w, lay in windows]
        self._found[d] = _Found(schedule, lo, hi, out)
        return out

    def _after(self, d: int, e: int, w: int, lay: order.EpochLayout):
        """(epoch, window, layout) of the window after window w of epoch e."""
        if w + 1 < len(lay.window_rows) - 1:
            return e, w + 1, lay
        return e + 1, 0, self.job.planner.layout(d, e + 1)

    def _bytes(self, d: int, lay: order.EpochLayout, w: int) -> int:
        """The row buffers of a window, in bytes (their tails left out: at most a row each)."""
        units = self.job.planner.indexes[d].units_per_chunk
        a = w * lay.window_chunks
        chunks = lay.chunk_order[a : a + lay.window_chunks]
        return int(units[chunks].sum()) * self.job.assembler.wire_dtype.itemsize


@dataclass(frozen=True)
class _Found:
    """The windows found for rows [lo, hi) of a dataset under one schedule."""

    schedule: object
    lo: int
    hi: int
    windows: list[tuple[tuple[int, int, int], order.EpochLayout]]


def _keys(lay: order.EpochLayout, d: int, e: int, w: int) -> list[Key]:
    """The row-buffer keys of window w, last position first."""
    a = w * lay.window_chunks
    chunks = lay.chunk_order[a : a + lay.window_chunks].tolist()
    return [(d, e, chunks[i], a + i) for i in reversed(range(len(chunks)))]


async def lay_out_soon(job: Job, keys: list[Key], executor: Executor) -> None:
    """Lay out the row buffers `keys`, in order (their chunks pinned meanwhile): on the event
    loop while each can be (Assembler.lay_out_here), the rest in one call of `lay_out` on
    `executor`. A failure is left to the streams that read them."""
    rows = job.assembler.rows
    todo = [k for k in keys if not rows.buffers.contains((k[0], k[1], k[2]))]
    try:
        with job.store.cache.pinned([("chunk", job.indexes[d].keys[c]) for d, _, c, _ in todo]):
            rest = await job.assembler.lay_out_here(todo)
    except Exception as exc:  # noqa: BLE001 - the streams meet it again and report it
        log.debug("job %s: row buffers not laid out ahead: %s", job.name, exc)
        return
    if rest:
        await asyncio.get_running_loop().run_in_executor(executor, lay_out, job, rest)


def lay_out(job: Job, keys: list[Key]) -> int:
    """Lay out the row buffers `keys` whose chunks (their own and their tails') are in the
    cache, those chunks pinned meanwhile; how many were laid out here. Nothing is fetched:
    what the cache holds is prefetch's to choose, and a chunk fetched for a window ahead would
    evict one that the next steps read (the streams lay the others out as they read them). A
    failure is left to the streams that read them: they lay out and report."""
    rows = job.assembler.rows
    todo = [k for k in keys if not rows.buffers.contains((k[0], k[1], k[2]))]
    if not todo:
        return 0
    tails = job.planner.tail_chunks
    read = {k: [job.indexes[k[0]].keys[c] for c in {k[2], *tails(k[0], k[1], k[3])}] for k in todo}
    chunks = [("chunk", key) for keys_read in read.values() for key in keys_read]
    try:
        with job.store.cache.pinned(chunks):
            todo = [k for k in todo if job.store.has_bodies(read[k])]
            rows.lay_out_all(todo)
    except Exception as e:  # noqa: BLE001 - the streams meet it again and report it
        log.debug("job %s: row buffers not laid out ahead: %s", job.name, e)
        return 0
    return len(todo)
