"""A job's step that depends on storage (fetching its tokenizer, opening its plan log), tried
until it works: a local failure (a disk, the network, a store out of reach) is retried with
backoff while requests hear why; anything else fails the job."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tokenfeed.server.errors import LocalError, TokenfeedError

log = logging.getLogger(__name__)


async def with_backoff(
    attempt: Callable[[], Awaitable[object]],
    *,
    job: str,
    what: str,
    retrying: str,
    retry: bool,
    note: Callable[[str], None],
    fail: Callable[[str], None],
    wake: Callable[[], None],
    stopped: Callable[[], bool],
) -> bool:
    """Await `attempt()` until it returns (True) or the job stops (False). A LocalError is
    noted as "`retrying`: why; retrying" and tried again after 1 s, doubling to 60 s, once
    `wake` has let waiting requests answer with the reason (without `retry` it fails the job);
    another TokenfeedError fails the job as "`what`: why"."""
    pause = 1.0
    while not stopped():
        try:
            await attempt()
            note("")
            return True
        except LocalError as e:
            error = f"{retrying}: {e}; retrying"
            note(error)
            log.warning("job %s: %s in %.0fs", job, error, pause)
            if not retry:
                fail(error)
                return False
            wake()
            await asyncio.sleep(pause)
            pause = min(pause * 2, 60.0)
        except TokenfeedError as e:
            fail(f"{what}: {e}")
    return False
