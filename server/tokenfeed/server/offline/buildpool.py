"""The worker processes of `tokenfeed build` (build.py), startable before the parent imports what a
build needs: this module imports only the standard library (and a name from the tokenizer
package's bare `__init__`), so `tokenfeed build` starts its workers first thing, and each one's
start-up (a new Python, its imports, its tokenizer: about 0.8 s of a core) runs while the parent
does the same and lists and plans the sources. By the time chunks are handed out the workers are
up, or nearly.

How many: `most_processes` (up to `--workers`, one per CORES_PER_PROCESS cores); once the chunks
are planned, build.processes says how many of them the sources are worth, and the others are
never handed a chunk (they end with the build)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenfeed.server.tokenizer import ENGINE_PROCESSES_ENV

if TYPE_CHECKING:
    from tokenfeed.server.offline.chunkbuild import Done
    from tokenfeed.server.settings.config import Config
    from tokenfeed.server.source.chunks import Chunk

# Cores per process at least. Every process's tokenizer runs on all cores; another process pays
# off where one cannot keep them busy (its GIL: parsing, and tiktoken's per-document calls).
# On 2 cores a second process made a 47 MB build slower (tiktoken: 6.0-9.8 s against 4.9-8.4 s
# alone, 4 rounds) and HF's no faster, so 2 cores get one.
CORES_PER_PROCESS = 2


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def most_processes(workers: int, cores: int) -> int:
    """Processes a build on `cores` cores runs at most, this one included: `workers` at most,
    one per CORES_PER_PROCESS cores; at least one."""
    return max(1, min(workers, cores // CORES_PER_PROCESS))


@dataclass
class Workers:
    """A job's build worker processes, started (`start`); `ready`: one future per process asked
    for, done once a process is up (its tokenizer loaded)."""

    name: str  # the job they build
    pool: cf.ProcessPoolExecutor | None = None
    ready: list[cf.Future] = field(default_factory=list)
    shared_before: str | None = None  # ENGINE_PROCESSES_ENV before the build (shutdown)

    @classmethod
    def start(cls, config: Config, name: str, processes: int) -> Workers:
        """`processes` worker processes for job `name` (none for 0), starting now."""
        # This process and its workers share the machine's memory for the tiktoken threads'
        # own Encodings (tokenizer/fasttok.py) until the build ends; a worker reads it from
        # the environment it is spawned with.
        workers = cls(name, shared_before=os.environ.get(ENGINE_PROCESSES_ENV))
        os.environ[ENGINE_PROCESSES_ENV] = str(processes + 1)
        if processes > 0:
            workers.pool = cf.ProcessPoolExecutor(
                processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(config, name),
            )
            workers.ready = [workers.pool.submit(_ready) for _ in range(processes)]
        return workers

    def shutdown(self) -> None:
        """Chunks not yet taken are cancelled; the processes end once their chunk in hand is
        built (and once up, for any still starting). The environment's count of the build's
        processes is what it was before."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.shared_before is None:
            os.environ.pop(ENGINE_PROCESSES_ENV, None)
        else:
            os.environ[ENGINE_PROCESSES_ENV] = self.shared_before


def start_for(config: Config, name: str, workers: int) -> Workers:
    """The worker processes a build of job `name` may use on this machine's cores (beside this
    process), started now, before the job is planned."""
    return Workers.start(config, name, most_processes(workers, available_cores()) - 1)


_worker: Any = None  # in a worker process: the job that builds the chunks it is handed
# In a worker process: why its job could not be made. Kept, not raised, so that a config the
# parent refuses too (it plans after the workers start) is reported once, by the parent, and
# not also as a traceback per worker; `_ready` and `build_chunk` raise it to the parent.
_failed: BaseException | None = None


def _init_worker(config: Config, name: str) -> None:
    from tokenfeed.server.offline.chunkbuild import chunk_builder

    global _worker, _failed
    logging.disable(logging.CRITICAL)  # what goes wrong here, the parent reports
    try:
        _worker = chunk_builder(config, name)
    except Exception as e:  # noqa: BLE001 - raised where the parent asks (_ready, build_chunk)
        _failed = e
    finally:
        logging.disable(logging.NOTSET)


def build_chunk(d: int, i: int, chunk: Chunk) -> Done:
    """In a worker process: chunk i of dataset d built (chunkbuild.build_chunk)."""
    from tokenfeed.server.offline.chunkbuild import build_chunk as build_in_worker

    _ready()
    if _worker is None:
        raise RuntimeError("a build worker process was started without _init_worker")
    return build_in_worker(_worker, d, i, chunk)


def _ready() -> None:
    """In a worker process: its answer says the process is up (its initializer ran); raises
    why the worker could not make its job, if it could not."""
    if _failed is not None:
        raise _failed
