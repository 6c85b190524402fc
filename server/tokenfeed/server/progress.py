"""What the trainers of one job have asked for, and how far prefetch is ahead of them.

Bookkeeping on the event loop only: the furthest step requested (which prefetch and eviction
plan from), each rank's latest step (for the status page; a rank is `(rank, world_size)`, and
the table is bounded), and the job's step rate, which turns a lead in steps into seconds.
"""

from __future__ import annotations

import asyncio
import time

MAX_RANKS = 4096  # the status page shows the most recent ranks of very wide jobs
_RATE_WEIGHT = 0.2  # of the newest interval in the moving average of the step rate


class Progress:
    def __init__(self) -> None:
        self.furthest = -1
        self.prefetched = -1  # every step up to this one has its chunks in the cache
        self.ranks: dict[tuple[int, int], tuple[int, float]] = {}
        self.step_rate = 0.0  # steps per second, a moving average
        self.tokens_served = 0
        self._last: tuple[int, float] | None = None
        self._changed = asyncio.Event()

    def note(self, step: int, rank: int, world_size: int) -> None:
        now = time.time()
        self.ranks.pop((rank, world_size), None)
        self.ranks[(rank, world_size)] = (step, now)
        if len(self.ranks) > MAX_RANKS:
            del self.ranks[next(iter(self.ranks))]  # the least recently heard from
        if step <= self.furthest:
            return
        if self._last is not None and now > self._last[1]:
            rate = (step - self._last[0]) / (now - self._last[1])
            self.step_rate = rate if not self.step_rate else (
                _RATE_WEIGHT * rate + (1 - _RATE_WEIGHT) * self.step_rate)  # fmt: skip
        self._last = (step, now)
        self.furthest = step
        self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    @property
    def lead_steps(self) -> int:
        """Steps past the furthest request whose chunks are cached (-1 before any request)."""
        return self.prefetched - max(self.furthest, 0) if self.furthest >= 0 else -1

    @property
    def lead_seconds(self) -> float:
        return max(self.lead_steps, 0) / self.step_rate if self.step_rate > 0 else 0.0
