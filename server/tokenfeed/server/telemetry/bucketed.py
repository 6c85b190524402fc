"""A Prometheus histogram whose observations arrive already counted in buckets.

The trainers' data waits are measured and bucketed by the client (tokenfeed.client.waits) and
reported as counts per bucket with their exact sum; prometheus_client's Histogram takes one
value per `observe`, which would mean re-observing a stand-in value per wait and a wrong
`_sum`. This collector adds the reported counts and sums as they are, per label value, and
exports them as an ordinary histogram family (`_bucket`, `_count`, `_sum`), so dashboards,
rules and the supervisor's sum over workers (serve/workermetrics.py) treat it like any other.

A child also takes one value observed several times at once (`observe(value, times)`): a
stream's group of batches made in one pass is that many observations of the group's time per
batch, counted with one lock instead of one prometheus_client `observe` a batch (about 2 us
each, a few percent of a lone server's CPU with eight ranks of small batches: bench/, wire
section).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString


class BucketedChild:
    """One label value's buckets (not cumulative), sum and lock."""

    def __init__(self, bounds: tuple[float, ...]):
        self._lock = threading.Lock()
        self.bounds = bounds  # finite upper bounds; the last bucket is +Inf
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`value` observed `times` times: in the first bucket whose bound it does not pass."""
        if times < 0:
            raise ValueError(f"times must be >= 0, got {times}")
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += times
            self.total += value * times

    def add(self, counts: Sequence[int], total: float) -> None:
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts for {len(self.counts)} buckets")
        with self._lock:
            self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
            self.total += total

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self.counts), self.total


class BucketedHistogram:
    """`name` with one label, upper bounds `bounds` (+Inf added), registered on `registry`."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        bounds: Sequence[float],
        registry: CollectorRegistry,
    ):
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"{name}: bounds must be finite and increasing, got {bounds}")
        self._lock = threading.Lock()
        self._children: dict[str, BucketedChild] = {}
        registry.register(self)

    def labels(self, value: str) -> BucketedChild:
        with self._lock:
            child = self._children.get(value)
            if child is None:
                child = self._children[value] = BucketedChild(self.bounds)
            return child

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        with self._lock:
            children = sorted(self._children.items())
        edges = [*map(floatToGoString, self.bounds), "+Inf"]  # as prometheus_client writes `le`
        for value, child in children:
            counts, total = child.snapshot()
            running, buckets = 0, []
            for edge, count in zip(edges, counts, strict=True):
                running += count
                buckets.append((edge, running))
            family.add_metric([value], buckets, total)
        yield family
