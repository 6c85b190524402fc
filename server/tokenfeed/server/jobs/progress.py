"""What the trainers of one job have asked for, and how far prefetch is ahead of them.

Bookkeeping on the event loop only: each active rank's latest step (a rank is
`(rank, world_size)`; the table is bounded; a rank not heard from for RANK_EXPIRY_SECONDS is no
longer active, nor is one of another world size than the latest request's that has been silent
for RESIZE_SECONDS: a run restarted at a new size moves prefetch to its new ranks at once), the
furthest step of the active ranks (which prefetch and eviction plan from: a run rolled back to
an earlier checkpoint moves it back, and prefetch follows), and the job's step rate, which
turns a lead in steps into seconds. O(1) per request: the furthest step is recomputed over the
ranks only when every rank that held it has moved back, when the world size changes (at most
once per RESIZE_SECONDS), or when expired ranks are swept (at most every SWEEP_SECONDS).
"""

from __future__ import annotations

import asyncio
import time

MAX_RANKS = 4096  # the status page shows the most recent ranks of very wide jobs
# A rank silent this long has stopped (a finished run, or a world size that changed): its step
# no longer holds prefetch and eviction. Longer than any checkpoint save or evaluation pause.
RANK_EXPIRY_SECONDS = 600.0
SWEEP_SECONDS = 10.0
# A rank of another world size than the latest request's, silent this long, has stopped: a run
# restarted at a new size (elastic training, a resumed checkpoint), whose old ranks stopped
# before its new ones started; a restart takes longer than this. Ranks of other sizes that go on
# asking (an evaluation beside the training) stay active.
RESIZE_SECONDS = 2.0
_RATE_WEIGHT = 0.2  # of the newest interval in the moving average of the step rate


class Progress:
    def __init__(self) -> None:
        self.furthest = -1
        self.prefetched = -1  # every step up to this one has its chunks in the cache
        self.ranks: dict[tuple[int, int], tuple[int, float]] = {}
        self.step_rate = 0.0  # steps per second, a moving average
        self.tokens_served = 0
        self._at_furthest = 0  # active ranks whose latest step is `furthest`
        self._swept = time.monotonic()
        self._last: tuple[int, float] | None = None
        self._changed = asyncio.Event()
        self._wake_at = 0  # the furthest step that wakes a waiter of `reaches`
        self._world = 0  # the world size of the latest request
        self._resized = -RESIZE_SECONDS  # when (`now`) a new world size last walked the ranks

    def note(self, step: int, rank: int, world_size: int, now: float | None = None) -> None:
        """A training request of (rank, world_size) for `step`."""
        now = time.time() if now is None else now
        key = (rank, world_size)
        before = self.ranks.pop(key, None)
        self.ranks[key] = (step, now)
        if before is not None and before[0] == self.furthest and step != self.furthest:
            self._at_furthest -= 1
        if len(self.ranks) > MAX_RANKS:
            gone = next(iter(self.ranks))  # the least recently heard from
            if self.ranks.pop(gone)[0] == self.furthest:
                self._at_furthest -= 1
        if step > self.furthest:
            self._advance(step, now)
        elif step == self.furthest and (before is None or before[0] != step):
            self._at_furthest += 1
        resized = False
        if world_size != self._world:  # a run restarted at a new size, or two sizes asking
            self._world = world_size
            # At most once per RESIZE_SECONDS: two sizes asking in turn walk the ranks rarely.
            resized = now - self._resized > RESIZE_SECONDS
            self._resized = now if resized else self._resized
        if self._at_furthest <= 0 or resized or time.monotonic() - self._swept > SWEEP_SECONDS:
            self._recompute(now)

    def _advance(self, step: int, now: float) -> None:
        if self._last is not None and now > self._last[1] and step > self._last[0]:
            rate = (step - self._last[0]) / (now - self._last[1])
            self.step_rate = (
                rate
                if not self.step_rate
                else (_RATE_WEIGHT * rate + (1 - _RATE_WEIGHT) * self.step_rate)
            )
        self._last = (step, now)
        self.furthest, self._at_furthest = step, 1
        if step >= self._wake_at:
            self._changed.set()

    def _recompute(self, now: float) -> None:
        """Drop expired ranks and find the active ranks' furthest step: O(ranks), only when
        the furthest step's last holder moved back, when the world size changes, or once per
        SWEEP_SECONDS."""
        self._swept = time.monotonic()
        world = self._world
        for key in [
            k
            for k, (_, t) in self.ranks.items()
            if now - t > (RANK_EXPIRY_SECONDS if k[1] == world else RESIZE_SECONDS)
        ]:
            del self.ranks[key]
        steps = [s for s, _ in self.ranks.values()]
        furthest = max(steps, default=-1)
        self._at_furthest = steps.count(furthest) if steps else 0
        if furthest < self.furthest:  # a rollback (or the leaders stopped): prefetch from here
            self.furthest = furthest
            self.prefetched = min(self.prefetched, furthest)
            self._last = None
            self._changed.set()

    async def reaches(self, step: int) -> None:
        """Until the furthest step reaches `step` or moves back (a rollback); maybe sooner.
        One waiter: a job's prefetch, which waits for the step its next look is due at rather
        than waking on every step (each wake-up is time of the loop that serves)."""
        self._wake_at = step
        await self._changed.wait()
        self._changed.clear()

    @property
    def lead_steps(self) -> int:
        """Steps past the furthest request whose chunks are cached (-1 before any request)."""
        return self.prefetched - max(self.furthest, 0) if self.furthest >= 0 else -1

    @property
    def lead_seconds(self) -> float:
        return max(self.lead_steps, 0) / self.step_rate if self.step_rate > 0 else 0.0
