"""A server's startup index build says how far it is, line by line, until every job is built."""

from __future__ import annotations

import asyncio
import logging
import re
from concurrent.futures import ThreadPoolExecutor

from support import job_spec, write_config
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.serve.background import report_builds
from tokenfeed.server.settings import config as configmod


def test_indexing_jobs_report_progress_until_built(tmp_path, corpus, caplog):
    # 1 KiB chunks of the corpus, tokenized one at a time: a build of many steps.
    spec = job_spec([corpus / "part-0.jsonl"], chunk_bytes="1KiB")
    cfg = configmod.load(write_config(tmp_path / "tf.yaml", {"main": spec}, tmp_path / "cache"))
    jobs = build_jobs(cfg)

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            build = asyncio.create_task(jobs["main"].build_index(pool, 1))
            reporter = asyncio.create_task(report_builds(jobs, every=0.05))
            await build
            await asyncio.wait_for(reporter, 5)  # ends once no job is indexing

    with caplog.at_level(logging.INFO, logger="tokenfeed.server.serve.background"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if "indexing" in r.getMessage()]
    found = [re.search(r"job main: indexing, (\d+)/(\d+) chunks", line) for line in lines]
    counts = [(int(m[1]), int(m[2])) for m in found if m]
    assert len(counts) >= 2, lines
    total = jobs["main"].num_chunks
    assert all(n == total for _, n in counts) and total > 20
    assert counts[0][0] < total  # said while it was still building
    assert [d for d, _ in counts] == sorted(d for d, _ in counts)  # and it moves forward
