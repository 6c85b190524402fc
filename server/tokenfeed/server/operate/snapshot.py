"""What the status page shows, as one snapshot (also served as `/status.json`): which server
it is (host, node name, version, uptime), each job's state, build progress, furthest step, each
rank's latest step, prefetch lead, data plan, cache use, throughput over the last minute and the
most recent warnings and errors.

A snapshot costs the same whatever the corpus: the server's identity is found once, at start,
and every other figure is a running total (jobs, datasets, ranks and cache kinds are few). It
reads job state without locks (counters and snapshots of dicts: a page may be a moment stale,
never inconsistent enough to matter).
"""

from __future__ import annotations

import collections
import importlib.metadata
import logging
import socket
import time
from typing import Any

from tokenfeed.server.jobs.job import Job

RECENT_EVENTS = 50
SAMPLE_SECONDS, _WINDOW_SECONDS = 5.0, 60.0


class RecentEvents(logging.Handler):
    """The last warnings and errors, for the status page."""

    def __init__(self, size: int = RECENT_EVENTS):
        super().__init__(logging.WARNING)
        self.events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=size)

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.created, record.levelname.lower(), record.getMessage()))


class Throughput:
    """Tokens served per second over the last minute, sampled in the background."""

    def __init__(self, jobs: dict[str, Job]):
        self.jobs = jobs
        self.samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=int(_WINDOW_SECONDS / SAMPLE_SECONDS) + 1
        )
        self.sample()

    def sample(self) -> None:
        totals: dict[str, float] = {n: job.progress.tokens_served for n, job in self.jobs.items()}
        self.samples.append((time.monotonic(), totals))

    def rate(self, job: str) -> float:
        """From the oldest sample kept (up to a minute ago) to now."""
        t0, first = self.samples[0]
        elapsed = time.monotonic() - t0
        served = self.jobs[job].progress.tokens_served - first[job]
        return served / elapsed if elapsed > 0 else 0.0


def version() -> str:
    """The installed package's version, as `tokenfeed --version` prints it."""
    try:
        return importlib.metadata.version("tokenfeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


class Identity:
    """Which server a page comes from: found once, when the port opens (moments after the
    process starts, so its uptime is the server's)."""

    def __init__(self, jobs: dict[str, Job]):
        self.host = socket.gethostname()
        self.node = _shared_store_node(jobs) or self.host
        self.version = version()
        self.started = time.time()
        self._started = time.monotonic()

    def as_dict(self) -> dict:
        return {
            "host": self.host,
            "node": self.node,
            "version": self.version,
            "started": self.started,
            "uptime_seconds": round(time.monotonic() - self._started, 1),
        }


def _shared_store_node(jobs: dict[str, Job]) -> str:
    """The name this node heartbeats under in the shared store (`store.node`: the fleet's
    rendezvous hashing assigns chunks to it), or empty without a shared store."""
    for job in jobs.values():
        for index in job.indexes:
            if index.shared is not None:
                return index.shared.node
    return ""


def status(
    jobs: dict[str, Job], events: RecentEvents, throughput: Throughput, identity: Identity
) -> dict:
    """The snapshot, as plain values (what `/status.json` sends)."""
    cache = next(iter(jobs.values())).store.cache if jobs else None
    out: dict[str, Any] = {
        "time": time.time(),
        "server": identity.as_dict(),
        "jobs": [],
        "cache": None,
        "events": [],
    }
    for name, job in sorted(jobs.items()):
        p = job.progress
        ranks = sorted(dict(p.ranks).items())
        out["jobs"].append(
            {
                "name": name,
                "state": job.state,
                "error": job.error,
                "fingerprint": job.fingerprint,
                "chunks": job.num_chunks,
                "chunks_built": job.chunks_indexed,
                "furthest_step": p.furthest,
                "prefetched_step": p.prefetched,
                "lead_steps": p.lead_steps,
                "lead_seconds": round(p.lead_seconds, 3),
                "step_rate": round(p.step_rate, 3),
                "tokens_per_second": round(throughput.rate(name), 1),
                "ranks": [
                    {"rank": r, "world_size": w, "step": s, "seen": t} for (r, w), (s, t) in ranks
                ],
                "plan": _plan(job),
            }
        )
    if cache is not None:
        out["cache"] = {
            "budget_bytes": cache.budget,
            "used_bytes": cache.used,
            "evictions": cache.evictions,
            "kinds": {k: {"entries": n, "bytes": b} for k, (n, b) in cache.usage().items()},
        }
    out["events"] = [{"time": t, "level": lvl, "message": m} for t, lvl, m in events.events]
    return out


def _plan(job: Job) -> dict:
    """The data plan in force and what each dataset gave the steps before the furthest one
    asked for (jobs/jobplan.py)."""
    plans = job.plans
    plan, chain = plans.plan, job.chain()
    step = max(job.progress.furthest + 1, 0)
    used = plans.consumed(step)
    keeper = plans.keeper
    return {
        "version": plans.version,
        "horizon": plans.horizon,
        "served": plans.served,
        "log": keeper.where if keeper is not None else "",
        "phase": used.phase,
        "phases": [
            {
                "start_step": p.start_step,
                "global_batch_size": p.global_batch_size,
                "seq_len": p.seq_len,
                "weights": {n: str(w) for n, w in zip(plan.names, p.weights, strict=False)},
                "fingerprint": chain[k][1] if chain else "",
            }
            for k, p in enumerate(plan.phases)
        ],
        "consumed_before_step": step,
        "consumed": [
            {"dataset": n, "rows": r, "tokens": t}
            for n, r, t in zip(plan.names, used.rows, used.tokens, strict=True)
        ],
    }
