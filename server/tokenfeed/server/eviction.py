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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfeed.server.cache import EntryKey
    from tokenfeed.server.job import Job


class FutureUse:
    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __call__(self, candidates: list[EntryKey]) -> list[float]:
        keys = [key for kind, key in candidates if kind == "chunk"]
        nearest: dict[str, float] = {}
        for job in self.jobs:
            for key, steps in job.next_use(keys).items():
                nearest[key] = min(steps, nearest.get(key, math.inf))
        return [nearest.get(key, math.inf) if kind == "chunk" else math.inf
                for kind, key in candidates]  # fmt: skip
