"""The order a dataset's chunks are built in: several at once in epoch 0's order, and a chunk
that another node (or the cache's owner) is making deferred and looked for again, the earliest in
sample order first."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np

T = TypeVar("T")


async def build_in_order(
    todo: list[int],
    position0: np.ndarray,
    attempt: Callable[[int, float], T | None],
    record: Callable[[int, T], None],
    executor: Executor,
    parallel: int,
    poll: float,
    cancel: threading.Event,
) -> None:
    """Build the chunks of `todo` (in epoch-0 order) with `parallel` workers: `attempt(i,
    since)` runs in `executor` and gives chunk i built, or None to come back to it after `poll`
    seconds (deferred since `since`); `record(i, built)` runs on the loop. The first failure
    cancels the others and is raised; `cancel` stops the workers between chunks."""
    loop = asyncio.get_running_loop()
    todo = todo[::-1]  # popped from the end: epoch-0 order
    # With a shared store: chunks assigned to another live node wait here until it
    # publishes them (or takeover_seconds pass): chunk -> [first deferred, last checked].
    deferred: dict[int, list[float]] = {}

    def pick() -> int | None:
        now = time.monotonic()
        due = [i for i, (_, checked) in deferred.items() if now - checked >= poll]
        if due:  # the earliest in sample order first: a request may be waiting on it
            return min(due, key=lambda i: position0[i])
        return todo.pop() if todo else None

    async def worker() -> None:
        while (todo or deferred) and not cancel.is_set():
            i = pick()
            if i is None:
                await asyncio.sleep(poll / 4)
                continue
            since = deferred.get(i, [time.monotonic()])[0]
            got = await loop.run_in_executor(executor, attempt, i, since)
            if got is None:
                deferred[i] = [since, time.monotonic()]
                continue
            deferred.pop(i, None)
            record(i, got)

    try:
        async with asyncio.TaskGroup() as group:  # the first failure cancels the others
            for _ in range(max(1, parallel)):
                group.create_task(worker())
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
