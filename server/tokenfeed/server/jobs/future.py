"""The cache's eviction policy: Belady's rule, which is usable here because the future is known.

Every job's order of chunks is a pure function of its spec and the step, so for a token chunk
in the cache we can compute when it will next be needed: from the furthest step any rank of a
job has asked for, how many steps until a row of that chunk is served (within the current
epoch, or else in the next one). The cache evicts the entry needed furthest in the future
first. Raw blocks are read once, when their chunk is tokenized, so they rank as never needed
again. The distance is in steps of each job; jobs that advance at similar rates compare fairly.

Pure arithmetic over the jobs' layouts: no I/O, called with the cache's lock held.
"""

from __future__ import annotations

import math

import numpy as np
from tokenfeed.server.diskcache.ledger import EntryKey
from tokenfeed.server.indexing.index import FAILED, READY
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.sampling import bijection, order


class FutureUse:
    """The disk cache's eviction policy (cache.Policy) over a set of jobs: for each candidate
    entry, the steps until some job next reads it."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __call__(self, candidates: list[EntryKey]) -> list[float]:
        keys = [key for kind, key in candidates if kind == "chunk"]
        nearest: dict[str, float] = {}
        for job in self.jobs:
            for key, steps in next_use(job, keys).items():
                nearest[key] = min(steps, nearest.get(key, math.inf))
        return [
            nearest.get(key, math.inf) if kind == "chunk" else math.inf for kind, key in candidates
        ]


def next_use(job: Job, keys: list[str]) -> dict[str, float]:
    """For the chunks among `keys` that this job reads: steps from its furthest request
    until it next needs them (eviction.py). Pure arithmetic over the epoch layouts."""
    if job.state == FAILED:
        return {}
    step = max(job.progress.furthest, 0)
    consumed, per_step = job.schedule.consumed(step), job.schedule.counts(step)
    out: dict[str, float] = {}
    for d, idx in enumerate(job.indexes):
        found = (idx.keys.get(k) for k in keys)
        ids = np.array([c for c in found if c is not None], dtype=np.int64)
        if not ids.size:
            continue
        if idx.state != READY:
            # Rows per chunk are not all known yet: rank by place in epoch 0's chunk order
            # (the order of the build and of the first steps).
            order_keys = bijection.round_keys("chunks", job.spec.seed, idx.dataset.name, 0)
            places = bijection.permute(ids, len(idx.chunks), order_keys, inverse=True)
            out.update(zip((idx.keys[c] for c in ids.tolist()), places.tolist(), strict=True))
            continue
        rows = _rows_until(job, d, ids, int(consumed[d]))
        rows[idx.units_per_chunk[ids] == 0] = np.inf  # holds no unit: never read
        steps = rows / per_step[d] if per_step[d] else np.full(len(ids), np.inf)
        out.update(zip((idx.keys[c] for c in ids.tolist()), steps.tolist(), strict=True))
    return out


def _rows_until(job: Job, d: int, ids: np.ndarray, position: int) -> np.ndarray:
    """Rows of dataset d from row `position` until the window that first reads each chunk
    starts (0 if it is being read), in this epoch or else the next. A chunk is first read
    by the row holding its first unit, or by an earlier row reading on into it, which may
    be served in an earlier window (or epoch)."""
    idx, window = job.indexes[d], job.spec.window_chunks
    q, span, total = idx.per_row, idx.span, idx.units_per_epoch
    epoch = int(order.epoch_of_row(position, total, q))
    dist = np.full(len(ids), np.inf)
    for e in (epoch, epoch + 1):
        layout = job.layout(d, e)
        keys = bijection.round_keys("chunks", job.spec.seed, idx.dataset.name, e)
        p = bijection.permute(ids, len(idx.chunks), keys, inverse=True)
        end = layout.window_rows[p // window + 1]  # its own window's rows end here
        first_unit = e * total + layout.units_cum[p]
        reader = np.maximum(-((span - 1 - first_unit) // q), 0)  # ceil((u - span + 1) / q)
        start = _window_start(job, d, reader)
        todo = np.isinf(dist) & (end > position)
        dist[todo] = np.maximum(start[todo] - position, 0)
    return dist


def _window_start(job: Job, d: int, rows: np.ndarray) -> np.ndarray:
    """The first row of the window in which each row is served."""
    idx = job.indexes[d]
    epochs = order.epoch_of_row(rows, idx.units_per_epoch, idx.per_row)
    out = np.empty_like(rows)
    for e in dict.fromkeys(epochs.tolist()):
        sel = epochs == e
        starts = job.layout(d, e).window_rows
        out[sel] = starts[np.searchsorted(starts, rows[sel], side="right") - 1]
    return out
