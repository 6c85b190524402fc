"""Prefetch: a job's chunks of the steps just past the furthest request kept in the cache
(rebuilding evicted ones), so trainers find them there; it follows the furthest request back
after a rollback.

Which chunks steps read is first answered by windows: every row of a window starts in one of
the window's chunks and reads on at most into that chunk's row-buffer tail, so the chunks of
the windows the steps' rows fall in (and their tails), known once per window, hold every chunk
the steps read. While those are all in the cache, as they are in steady training, nothing is
missing and no row is planned; otherwise the steps' rows are planned exactly
(Planner.chunks_of_steps) and only what they read is fetched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from tokenfeed.server.errors import BadRecordError, NotBuiltError, SourceError
from tokenfeed.server.indexing.index import READY
from tokenfeed.server.jobs import layahead
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.epochlayouts import DatasetUnits
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

# Windows whose chunks a job's prefetch keeps known (a few epochs' worth of the windows just
# ahead; each entry is a window's dozen keys).
WINDOWS_KEPT = 4096
# Passes over the same steps, after the first, while a pass ends with some of their chunks not
# in the cache (`fetch_steps`), before the lead counts them anyway: in a cache that holds the
# steps' chunks but not twice over, one fetched for a later step may evict one of an earlier
# step (the cache ranks a window's chunks alike), and the next pass fetches it back.
REFETCHES = 2


async def keep_ahead(job: Job, executor: Executor, steps: int, rows_budget: int = 0) -> None:
    """Keep every chunk of the next `steps` steps past the furthest request in the cache
    (rebuilding evicted ones), until cancelled. Once the lead falls to half of `steps`, the
    steps up to the full lead are looked at together: a stream advancing one step at a time
    costs one look per `steps // 2` steps, not one per step. With `rows_budget` (the row
    buffers' memory), the row buffers of the window the furthest request is in and of the
    next few are laid out too (layahead.py)."""
    await job.built()
    p = job.progress
    windows = WindowChunks(job)
    ahead = layahead.WindowLayouts(job, rows_budget) if rows_budget else None
    passes = 0  # over the same steps, while their chunks do not all stay
    while steps and job.state == READY:
        first = max(p.prefetched, p.furthest) + 1
        end = max(p.furthest, 0) + steps + 1
        if first > max(p.furthest, 0) + (steps + 1) // 2:
            await p.reaches(first - (steps + 1) // 2)
            continue
        was = p.furthest
        try:
            held = await fetch_steps(job, executor, first, end, windows)
        except (SourceError, BadRecordError) as e:
            job.fail(str(e))
            return
        except NotBuiltError:  # the steps' rows wait on a count (jobs/shapes.py): so does this
            await asyncio.sleep(1.0)
            continue
        except Exception as e:  # local (cache full, network): requests will say so
            log.warning("job %s: prefetch of steps %d..%d failed: %s", job.name, first, end - 1, e)
            await asyncio.sleep(1.0)
            continue
        if not held and passes < REFETCHES:
            passes += 1
            continue  # the lead counts steps whose chunks are all cached: fetch again first
        passes = 0
        if p.furthest >= was:  # else a rollback moved it back meanwhile: start again
            p.prefetched = end - 1
        if ahead is not None:
            try:
                keys = ahead.keys_ahead(max(p.furthest, 0))
            except Exception as e:  # noqa: BLE001 - the streams lay their rows out themselves
                log.debug("job %s: no row buffers ahead: %s", job.name, e)
                keys = []
            if keys:
                await layahead.lay_out_soon(job, keys, executor)
        metrics.PREFETCH_LEAD_STEPS.labels(job.name).set(max(p.lead_steps, 0))
        metrics.PREFETCH_LEAD_SECONDS.labels(job.name).set(p.lead_seconds)


async def fetch_steps(
    job: Job, executor: Executor, first: int, end: int, windows: WindowChunks | None = None
) -> bool:
    """Every chunk that the global batches of steps [first, end) read, in the cache; whether
    they all are once it returns (in a tight cache one fetched here may have evicted another
    of them: the steps' chunks are pinned while they are fetched only where they fill at most
    half the cache)."""
    if windows is not None:
        around = windows.of_steps(first, end)
        if around is not None and job.store.has_bodies(around):
            return True  # every chunk the steps could read is there
    needed = job.planner.chunks_of_steps(first, end)
    missing = [(d, c) for d, c in needed if not job.store.has_body(job.indexes[d].keys[c])]
    if missing:
        # The steps' chunks are held while the missing ones are made, so that one made for
        # them neither evicts another of them nor is turned away to keep one (the cache ranks
        # a window's chunks alike); not where they would fill more than half the cache.
        cache = job.store.cache
        size = sum(int(job.indexes[d].body_bytes[c]) for d, c in needed)
        held = [("chunk", job.indexes[d].keys[c]) for d, c in needed]
        loop = asyncio.get_running_loop()
        with cache.pinned(held) if 2 * size <= cache.budget else contextlib.nullcontext():
            await asyncio.gather(
                *(
                    loop.run_in_executor(executor, job.indexes[d].ensure_chunk, c, True)
                    for d, c in missing
                )
            )
        return job.store.has_bodies([job.indexes[d].keys[c] for d, c in needed])
    return True


class WindowChunks:
    """The keys of the chunks that rows starting in a window read: the window's chunks and
    the chunks their row buffers' tails read into, made once per window (no row planned). A
    call whose rows start and end in the windows of the last call's rows (prefetch's next look,
    most often) takes its keys again without a lookup. Only for rows of a dataset's first
    segment, of a built index."""

    def __init__(self, job: Job):
        self.job = job
        self._known: dict[tuple[int, int, int], tuple[order.EpochLayout, frozenset[str]]] = {}
        self._last: _LastLook | None = None  # the last call's windows and keys

    def of_steps(self, first: int, end: int) -> frozenset[str] | None:
        """The keys of every chunk of the windows that the rows of the global batches of steps
        [first, end) start in (so of every chunk those rows read); None where this cannot
        tell (an index still building, rows of a later segment): then plan the rows."""
        planner = self.job.planner
        schedule = planner.schedule
        lo, hi = schedule.row_spans(first, end)
        last = self._last
        if last is not None and last.holds(schedule, lo, hi, planner.indexes):
            return last.keys
        out: set[str] = set()
        spans: list[tuple[int, int, int, int] | None] = []
        for d, (a_row, after) in enumerate(zip(lo, hi, strict=True)):
            if a_row == after:  # no row of d in these steps
                spans.append(None)
                continue
            b_row, a_span, b_span = after - 1, [0, 0], [0, 0]
            idx = planner.indexes[d]
            if not idx.ready:  # first: segments made while it builds would be remembered
                return None
            segs = planner.segments(d)
            if len(segs) > 1 and b_row >= segs[1].first_row:
                return None
            per_row, units = idx.per_row, idx.units_per_epoch  # order.epoch_of_row, in ints
            first_epoch, last_epoch = a_row * per_row // units, b_row * per_row // units
            for e in range(first_epoch, last_epoch + 1):
                lay = planner.layout(d, e)
                a, b = max(a_row, lay.first_row), min(b_row, lay.end_row - 1)
                if a > b:
                    continue
                found = lay.window_rows.searchsorted((a, b), side="right").tolist()
                for w in range(found[0] - 1, found[1]):
                    out |= self._window(d, e, w, lay)
                # The windows that a_row and b_row are in: any rows of those two windows find
                # the same ones (the windows between them are fixed by those two).
                if e == first_epoch:
                    a_span = lay.window_rows[found[0] - 1 : found[0] + 1].tolist()
                if e == last_epoch:
                    b_span = lay.window_rows[found[1] - 1 : found[1] + 1].tolist()
            if len(segs) > 1:
                b_span[1] = min(b_span[1], segs[1].first_row)
            spans.append((a_span[0], a_span[1], b_span[0], b_span[1]))
        keys = frozenset(out)
        self._last = _LastLook(schedule, spans, keys)
        return keys

    def _window(self, d: int, e: int, w: int, lay: order.EpochLayout) -> frozenset[str]:
        known = self._known.get((d, e, w))
        if known is not None and known[0] is lay:
            return known[1]
        planner, keys = self.job.planner, self.job.indexes[d].keys
        n = len(lay.chunk_order)
        positions = range(w * lay.window_chunks, min((w + 1) * lay.window_chunks, n))
        chunks = {int(lay.chunk_order[p]) for p in positions}
        for p in positions:
            chunks.update(planner.tail_chunks(d, e, p))
        found = frozenset(keys[c] for c in chunks)
        if len(self._known) >= WINDOWS_KEPT:
            self._known.clear()
        self._known[(d, e, w)] = (lay, found)
        return found


@dataclass(frozen=True)
class _LastLook:
    """The keys found for steps whose rows of each dataset d start in rows [a0, a1) and end in
    rows [b0, b1) (spans[d]; None: no row of d), under one schedule."""

    schedule: object
    spans: list[tuple[int, int, int, int] | None]
    keys: frozenset[str]

    def holds(
        self, schedule: object, lo: list[int], hi: list[int], indexes: Sequence[DatasetUnits]
    ) -> bool:
        """Whether steps of these row spans find the same keys: the same windows (their keys
        are fixed while the schedule is: the layouts of a built index never change)."""
        if schedule is not self.schedule or len(lo) != len(self.spans):
            return False
        for d, span in enumerate(self.spans):
            if span is None:
                if lo[d] != hi[d]:
                    return False
            elif not (
                span[0] <= lo[d] < span[1] and span[2] < hi[d] <= span[3] and indexes[d].ready
            ):
                return False
        return True
