"""A serving process freezes its start-up's objects, and each job's index once built, out of the
garbage collector's full collections; garbage cycles are collected first, never frozen."""

from __future__ import annotations

import asyncio
import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import job_spec, write_config
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.serve.background import settle_heap
from tokenfeed.server.settings import config as configmod


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen():
    """No collection but settle_heap's own (so a cycle it leaves is seen), nothing frozen."""
    gc.unfreeze()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()  # the other tests run with a collector as they found it


def _tracked(obj) -> bool:
    """Whether a full collection still walks `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_start_up_and_built_indexes_are_frozen_and_cycles_collected(tmp_path, corpus, unfrozen):
    spec = job_spec([corpus / "part-0.jsonl"], chunk_bytes="1KiB")
    cfg = configmod.load(write_config(tmp_path / "tf.yaml", {"main": spec}, tmp_path / "cache"))
    jobs = build_jobs(cfg)
    before = _Node()
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle no one holds: garbage, not to be frozen
    gone = weakref.ref(a)
    del a, b
    seen: dict[str, object] = {}

    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            build = asyncio.create_task(jobs["main"].build_index(pool, 1))
            settle = asyncio.create_task(settle_heap(jobs))
            await asyncio.sleep(0)  # its first freeze: before the index is built
            seen["first"] = gc.get_freeze_count()
            seen["during"] = _Node()
            seen["tracked during"] = _tracked(seen["during"])
            await build
            await asyncio.wait_for(settle, 5)  # ends once every job's build has ended

    asyncio.run(run())
    assert gone() is None  # collected, not frozen
    assert seen["first"] > 1000 and not _tracked(before)
    assert seen["tracked during"] is True  # made after the first freeze: walked until...
    assert not _tracked(seen["during"])  # ...the freeze once the job is built
    assert gc.get_freeze_count() > seen["first"]
    index = jobs["main"].indexes[0]
    assert index.chunks and not _tracked(index)
