"""The trainers' data-wait reports, read from a batch request's metadata into the job's metrics.

The client measures how long each `get_batch` / iterator `next` blocked its trainer and sends
what it has not reported yet with its next GetBatch or StreamBatches request
(tokenfeed.client.waits). A report is counted once its call delivers (the unary reply, or a
stream's first batch): the client keeps the report of a call that failed before that for its
next attempt, so a failover neither loses nor doubles it.

A malformed report is telemetry gone wrong, not a bad request: the batch is served, the report
ignored, counted (`tokenfeed_wait_reports_total{outcome="malformed"}`) and logged at most once
a minute.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenfeed.client.waits import METADATA_KEY, WaitReport
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)
LOG_EVERY_SECONDS = 60.0
_last_logged = -float("inf")


def report_of(context: Any) -> WaitReport | None:
    """The wait report a call carries, if any (None too when it is malformed)."""
    global _last_logged
    for key, value in context.invocation_metadata() or ():
        if key != METADATA_KEY:
            continue
        try:
            return WaitReport.decode(value)
        except ValueError as e:
            metrics.WAIT_REPORTS.labels("malformed").inc()
            now = time.monotonic()
            if now - _last_logged >= LOG_EVERY_SECONDS:
                _last_logged = now
                log.warning("ignored a malformed wait report from %s: %s", context.peer(), e)
            return None
    return None


def count(job: str, report: WaitReport | None) -> None:
    """Add a delivered call's report to its job's wait histogram and reported seconds."""
    if report is None:
        return
    metrics.TRAINER_WAIT.labels(job).add(report.counts, report.waited)
    metrics.TRAINER_SECONDS.labels(job).inc(report.elapsed)
    metrics.WAIT_REPORTS.labels("counted").inc()
