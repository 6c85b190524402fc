"""How long the trainer waited for data, measured where it waits and reported to the servers.

Each `get_batch` call and each `next` of a batch iterator blocks the trainer for some time: a
microsecond when the batch was already prefetched, seconds when the servers fall behind. A
`WaitMeter` per (job, rank) counts those waits in fixed buckets, and the wall-clock time they
fall in. The client hands what it has not reported yet to the server with its next GetBatch
or StreamBatches request, as one request-metadata entry (no extra RPC); the server adds it to
its per-job histogram and counters, so `waited seconds / reported seconds` is the share of
time the trainers waited (docs/operations.md). Reports are deltas: whichever server gets one
counts it once, and Prometheus sums the fleet.

Shared with the server (serve/waits.py decodes what this module encodes). Pure: no gRPC, no
clocks of its own (callers pass `now`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# The metadata key of a report; its version is in the name, so a later format is a new key.
METADATA_KEY = "tokenfeed-wait-v1"
# Upper bounds of the wait buckets, in seconds (the last bucket is +Inf): from "already
# prefetched" (well under a millisecond) to "the fleet is far behind".
BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# A report covers at most this much time: a larger one is taken as corrupt, not as a trainer
# that reported nothing for a week.
MAX_REPORT_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class WaitReport:
    """Waits not yet reported: the seconds they cover, their sum, and their count per bucket
    (len(BUCKETS) + 1 counts, not cumulative; the last one is over the largest bound)."""

    elapsed: float
    waited: float
    counts: tuple[int, ...]

    @property
    def waits(self) -> int:
        return sum(self.counts)

    def encode(self) -> str:
        counts = ",".join(map(str, self.counts))
        return f"e={self.elapsed:.6f};w={self.waited:.6f};c={counts}"

    @classmethod
    def decode(cls, text: str) -> WaitReport:
        """A report from its metadata value; ValueError naming what is wrong."""
        fields = dict(part.partition("=")[::2] for part in text.split(";"))
        if set(fields) != {"e", "w", "c"}:
            raise ValueError(f"wait report {text[:80]!r}: expected fields e, w and c")
        try:
            elapsed, waited = float(fields["e"]), float(fields["w"])
            counts = tuple(int(c) for c in fields["c"].split(","))
        except ValueError as e:
            raise ValueError(f"wait report {text[:80]!r}: {e}") from None
        if len(counts) != len(BUCKETS) + 1 or min(counts) < 0:
            raise ValueError(
                f"wait report {text[:80]!r}: {len(BUCKETS) + 1} non-negative counts expected"
            )
        for name, value in (("elapsed", elapsed), ("waited", waited)):
            if not (math.isfinite(value) and 0 <= value <= MAX_REPORT_SECONDS):
                raise ValueError(f"wait report {text[:80]!r}: {name} {value} out of range")
        return cls(elapsed, waited, counts)


def bucket_of(seconds: float, bounds: Sequence[float] = BUCKETS) -> int:
    """The index of the first bucket whose bound holds `seconds` (Prometheus' `le`)."""
    return bisect.bisect_left(bounds, seconds)  # bounds ascend: the first >= seconds


class WaitMeter:
    """One (job, rank)'s waits since its last report. Thread-safe: waits are recorded by the
    trainer's thread, reports taken by whichever thread opens the next request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # start of the time not reported yet
        self._waited = 0.0
        self._counts = [0] * (len(BUCKETS) + 1)

    def record(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        with self._lock:
            self._waited += seconds
            self._counts[bucket_of(seconds)] += 1

    def take(self, now: float) -> WaitReport | None:
        """What is not reported yet, up to `now`, and the meter starts again from `now`. The
        first call only starts the clock (None): time before the first request is the
        trainer's setup, not training."""
        with self._lock:
            since, self._since = self._since, now
            if since is None:
                return None
            report = WaitReport(max(now - since, 0.0), self._waited, tuple(self._counts))
            self._waited, self._counts = 0.0, [0] * (len(BUCKETS) + 1)
            return report

    def give_back(self, report: WaitReport) -> None:
        """A report whose request failed before the server counted it: kept for the next."""
        with self._lock:
            if self._since is not None:
                self._since -= report.elapsed
            self._waited += report.waited
            self._counts = [a + b for a, b in zip(self._counts, report.counts, strict=True)]


class WaitMeters:
    """The meters of one client, by (job, rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meters: dict[tuple[str, int], WaitMeter] = {}

    def __call__(self, job: str, rank: int) -> WaitMeter:
        with self._lock:
            meter = self._meters.get((job, rank))
            if meter is None:
                meter = self._meters[(job, rank)] = WaitMeter()
            return meter
