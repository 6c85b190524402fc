"""Prefetch: a job's chunks of the steps just past the furthest request kept in the cache
(rebuilding evicted ones), so trainers find them there; it follows the furthest request back
after a rollback."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from tokenfeed.server.errors import BadRecordError, NotBuiltError, SourceError
from tokenfeed.server.indexing.index import READY
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)


async def keep_ahead(job: Job, executor: Executor, steps: int) -> None:
    """Keep every chunk of the next `steps` steps past the furthest request in the cache
    (rebuilding evicted ones), until cancelled. Once the lead falls to half of `steps`, the
    steps up to the full lead are planned together: a stream advancing one step at a time
    costs one plan per `steps // 2` steps, not one per step."""
    await job.built()
    p = job.progress
    while steps and job.state == READY:
        first = max(p.prefetched, p.furthest) + 1
        end = max(p.furthest, 0) + steps + 1
        if first > max(p.furthest, 0) + (steps + 1) // 2:
            await p.changed()
            continue
        was = p.furthest
        try:
            await fetch_steps(job, executor, first, end)
        except (SourceError, BadRecordError) as e:
            job.fail(str(e))
            return
        except NotBuiltError:  # the steps' rows wait on a count (jobs/shapes.py): so does this
            await asyncio.sleep(1.0)
            continue
        except Exception as e:  # local (cache full, network): requests will say so
            log.warning("job %s: prefetch of steps %d..%d failed: %s", job.name, first, end - 1, e)
            await asyncio.sleep(1.0)
            continue
        if p.furthest >= was:  # else a rollback moved it back meanwhile: start again
            p.prefetched = end - 1
        metrics.PREFETCH_LEAD_STEPS.labels(job.name).set(max(p.lead_steps, 0))
        metrics.PREFETCH_LEAD_SECONDS.labels(job.name).set(p.lead_seconds)


async def fetch_steps(job: Job, executor: Executor, first: int, end: int) -> None:
    """Every chunk that the global batches of steps [first, end) read, in the cache."""
    needed = job.planner.chunks_of_steps(first, end)
    missing = [(d, c) for d, c in needed if not job.store.has_body(job.indexes[d].keys[c])]
    if missing:
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(
                loop.run_in_executor(executor, job.indexes[d].ensure_chunk, c, True)
                for d, c in missing
            )
        )
