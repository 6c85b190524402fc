"""What the trainers of one job have asked for, and how far prefetch is ahead of them.

Bookkeeping on the event loop only: each active rank's latest step (a rank is
`(rank, world_size)`; the table is bounded, and a rank not heard from for RANK_EXPIRY_SECONDS is
no longer active), the furthest step of the active ranks (which prefetch and eviction plan
from: a run rolled back to an earlier checkpoint moves it back, and prefetch follows), and the
job's step rate, which turns a lead in steps into seconds. A run restarted at another world size
moves it within RESIZE_SECONDS: once the new size has asked for that long, ranks of other sizes
silent for as long stop holding it (they stay in the table until they expire); a size that
goes on asking beside another (an evaluation beside the training) keeps holding it, and so does
a training run in a pause when a tool asks once at another size. O(1) per request: the furthest
step is recomputed over the ranks only when every rank that held it has moved back, when a new
size has asked for RESIZE_SECONDS, or when expired ranks are swept (at most every
SWEEP_SECONDS).
"""

from __future__ import annotations

import asyncio
import time

MAX_RANKS = 4096  # the status page shows the most recent ranks of very wide jobs
# A rank silent this long has stopped (a finished run, or a world size that changed): its step
# no longer holds prefetch and eviction. Longer than any checkpoint save or evaluation pause.
RANK_EXPIRY_SECONDS = 600.0
SWEEP_SECONDS = 10.0
# Once requests of a new world size have come for this long, ranks of other sizes silent for as
# long stop holding prefetch: a run restarted at a new size (elastic training, a resumed
# checkpoint), whose old ranks stopped before its new ones started.
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
        self._world_since = 0.0  # when (`now`) requests of that size began
        self._resize_at: float | None = None  # when to look at the other sizes' ranks again

    def note(self, step: int, rank: int, world_size: int, now: float | None = None) -> None:
        """A training request of (rank, world_size) for `step`."""
        now = time.time() if now is None else now
        if world_size != self._world:  # a run restarted at a new size, or two sizes in turn
            if self._world:
                self._resize_at = now + RESIZE_SECONDS
            self._world, self._world_since = world_size, now
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
        resized = self._resize_at is not None and now >= self._resize_at
        if resized:  # the new size has asked for RESIZE_SECONDS: the others may have stopped
            self._resize_at = None
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
        """Drop expired ranks and find the furthest step of the ranks that hold it: O(ranks),
        only when the furthest step's last holder moved back, when a new world size has asked
        for RESIZE_SECONDS, or once per SWEEP_SECONDS."""
        self._swept = time.monotonic()
        for key in [k for k, (_, t) in self.ranks.items() if now - t > RANK_EXPIRY_SECONDS]:
            del self.ranks[key]
        world, since = self._world, self._world_since
        steps = [
            s
            for (_, size), (s, t) in self.ranks.items()
            if size == world or now - max(t, since) < RESIZE_SECONDS  # another size: still asking
        ]
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
