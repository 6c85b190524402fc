"""The serving workers' counters on the supervisor's /metrics (serve/workers.py): each worker
sends a snapshot of its WORKER_METRICS every METRICS_SECONDS, and the supervisor serves their
sums, with what exited workers had counted and its own counts of the same families added."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from tokenfeed.server.telemetry import metrics

METRICS_SECONDS = 1.0  # how often a worker sends its counters to the supervisor
# What the workers count: summed over workers (and over workers that have exited) on /metrics.
WORKER_METRICS = (
    metrics.REQUESTS,
    metrics.REQUEST_SECONDS,
    metrics.SERVED_TOKENS,
    metrics.SERVED_BYTES,
    metrics.ROW_BUFFERS,
    metrics.STREAMS_MOVED,
    metrics.TRAINER_WAIT,
    metrics.TRAINER_SECONDS,
    metrics.WAIT_REPORTS,
)


def snapshot() -> list[tuple[str, str, str, list[tuple[str, dict, float]]]]:
    """This process's worker metrics: (family, help, type, samples)."""
    return [
        (f.name, f.documentation, f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for m in WORKER_METRICS
        for f in m.collect()
    ]


class WorkerMetrics:
    """The workers' latest snapshots, and what exited workers had counted (counters never go
    back when a worker is replaced). `collect` makes it a registry for generate_latest: the
    supervisor's own families, with the workers' sums added to its own in the worker metrics."""

    def __init__(self):
        self.live: dict[int, list] = {}
        self.retired: dict[tuple[str, str, tuple], float] = {}
        self._names = {f.name for m in WORKER_METRICS for f in m.collect()}

    def update(self, pid: int, snap: list) -> None:
        self.live[pid] = snap

    def retire(self, pid: int) -> None:
        for family, _, _, samples in self.live.pop(pid, []):
            for name, labels, value in samples:
                if not name.endswith("_created"):
                    key = (family, name, tuple(sorted(labels.items())))
                    self.retired[key] = self.retired.get(key, 0.0) + value

    def collect(self) -> Iterator[Metric]:
        sums: dict[str, dict[tuple[str, tuple], float]] = {}
        for key, value in self.retired.items():
            family, name, labels = key
            sums.setdefault(family, {})[(name, labels)] = value
        for snap in list(self.live.values()):
            for family, _, _, samples in snap:
                into = sums.setdefault(family, {})
                for name, labels, value in samples:
                    k = (name, tuple(sorted(labels.items())))
                    if name.endswith("_created"):
                        into[k] = min(into.get(k, value), value)
                    else:
                        into[k] = into.get(k, 0.0) + value
        for metric in metrics.REGISTRY.collect():
            if metric.name not in self._names:
                yield metric
                continue
            # The supervisor counts some of these itself (the row buffers it lays out ahead
            # for the workers, jobs/layahead.py): added to the workers' sums.
            into = sums.setdefault(metric.name, {})
            for sample in metric.samples:
                k = (sample.name, tuple(sorted(sample.labels.items())))
                if sample.name.endswith("_created"):
                    into[k] = min(into.get(k, sample.value), sample.value)
                else:
                    into[k] = into.get(k, 0.0) + sample.value
            merged = Metric(metric.name, metric.documentation, metric.type)
            for (name, labels), value in sorted(into.items()):
                merged.add_sample(name, dict(labels), value)
            yield merged
