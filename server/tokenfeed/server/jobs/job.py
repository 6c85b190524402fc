"""A job at run time: its datasets' token indexes (index.py), its schedule (mixture.py) and
the batches it serves.

A batch is planned (which dataset row fills each position, then where each row lives: pure
order arithmetic), its chunks are opened (disk work: `open_chunks` runs it in a worker thread,
so a slow or corrupt chunk never stalls other calls), and it is assembled by the pure packing
functions from the stored tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import Executor
from typing import Protocol

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server.errors import (
    CacheTooSmallError,
    JobFailedError,
    LocalError,
    NotBuiltError,
    NotReadyError,
    ObjectStoreError,
    RequestError,
    SourceError,
    TokenfeedError,
)
from tokenfeed.server.indexing.index import FAILED, INDEXING, READY, DatasetIndex, JobState
from tokenfeed.server.indexing.owner import ChunkOwner
from tokenfeed.server.jobs.progress import Progress
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.pack import packing
from tokenfeed.server.pack.assembly import Assembler
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.sampling.planner import MAX_STEP, Planner, RowPlan
from tokenfeed.server.settings.config import JobSpec
from tokenfeed.server.source.chunks import CHUNK_FORMAT_VERSION
from tokenfeed.server.store.sharedstore import SharedStore
from tokenfeed.server.store.tokstore import TokenStore
from tokenfeed.server.telemetry import metrics
from tokenfeed.server.tokenizer.tokenize import TextTokenizer

log = logging.getLogger(__name__)

__all__ = ["FAILED", "INDEXING", "MAX_STEP", "READY", "Job", "JobState", "Upstream"]


class Upstream(ChunkOwner, Protocol):
    """In a serving worker, the process that owns the cache (control.py's SupervisorLink): it
    plans and tokenizes chunks (ChunkOwner), and hears the trainers' progress, which its
    prefetch and eviction follow, and the tokens served, which its status page counts."""

    def note(self, job: str, step: int, rank: int, world_size: int) -> None: ...

    def served(self, job: str, tokens: int) -> None: ...


class Job:
    def __init__(
        self,
        spec: JobSpec,
        store: TokenStore,
        storage: ObjectStorage,
        shared: SharedStore | None = None,
        supervisor: Upstream | None = None,
        stream_cache_bytes: int = 512 * 2**20,
    ):
        self.spec, self.name, self.store = spec, spec.name, store
        self.storage = storage
        self.supervisor = supervisor  # in a serving worker: the process that owns the cache
        # No tokenizer yet: load_tokenizer gives each index the job's, once it is loaded
        # (DatasetIndex's annotation says the tokenizer is always there).
        self.indexes = [
            DatasetIndex(spec, d, store, None, storage, shared, supervisor) for d in spec.datasets
        ]
        phases = [Phase(p.start_step, p.global_batch_size, p.weights) for p in spec.phases]
        self.schedule = Schedule(phases, spec.seed)
        self.planner = Planner(spec, self.indexes, self.schedule)
        self.assembler = Assembler(
            spec, self.indexes, store, self.fail, stream_cache_bytes, self.planner.chunk_tail
        )
        self._ready = asyncio.Event()
        self._fingerprint = ""
        self.progress = Progress()
        self._built_more = asyncio.Event()  # set (and replaced) whenever more rows are built
        for idx in self.indexes:
            idx.listeners.append(self._on_built)
        # The tokenizer may live in object storage: a fetch that fails is this job's problem
        # only (retried by build_index like any storage failure), a file that is not a
        # tokenizer fails the job; the server and its other jobs serve on.
        self.tokenizer: TextTokenizer | None = None
        self._tokenizer_error = ""
        self._failure = ""  # a job-level refusal (the cache cannot hold its working set)
        try:
            self.load_tokenizer()
        except LocalError as e:
            self._tokenizer_error = f"tokenizer {spec.tokenizer.path}: {e}; retrying"
            log.warning("job %s: %s", self.name, self._tokenizer_error)
        except TokenfeedError as e:
            self.fail(f"tokenizer: {e}")

    @property
    def index(self) -> DatasetIndex:
        """The first dataset's index (the only one of a plain job)."""
        return self.indexes[0]

    @property
    def state(self) -> JobState:
        states = {i.state for i in self.indexes}
        if FAILED in states or self._failure:
            return FAILED
        return READY if states == {READY} else INDEXING

    @property
    def error(self) -> str:
        own = [e for e in (self._failure, self._tokenizer_error) if e]
        return "; ".join([i.error for i in self.indexes if i.error] + own)

    def load_tokenizer(self) -> TextTokenizer:
        """Fetch and load the tokenizer (once): LocalError if it cannot be fetched now,
        ConfigError or SourceError if it is not there or not a tokenizer."""
        if self.tokenizer is None:
            path = self.spec.tokenizer.path
            try:
                raw = self.storage.read_object(path)[1]
            except OSError as e:  # a local disk or network failure: worth another try
                raise ObjectStoreError(f"cannot read {path}: {e}") from e
            except SourceError as e:  # not there: say which key names it, not "a source"
                why = getattr(e.__cause__, "strerror", None) or str(e)
                raise SourceError(
                    f"jobs.{self.name}.tokenizer.path: no tokenizer file at {path} ({why}); "
                    "set it to the path or object-store URI of a tokenizer.json"
                ) from e
            self.tokenizer = self.assembler.tokenizer = TextTokenizer(self.spec.tokenizer, raw)
            for idx in self.indexes:
                idx.tokenizer = self.tokenizer
            self._tokenizer_error = ""
        return self.tokenizer

    @property
    def fingerprint(self) -> str:
        """Everything that decides the bytes of a batch; known once every dataset's chunks are
        planned (before they are tokenized), empty until then."""
        t = self.tokenizer
        if not self._fingerprint and t is not None and all(i.fingerprint for i in self.indexes):
            s = self.spec
            parts = [
                f"format={CHUNK_FORMAT_VERSION}",
                f"packing_version={packing.PACKING_VERSION}",
                f"seq_len={s.seq_len}",
                f"seed={s.seed}",
                f"packing={s.packing}",
                f"window={s.window_chunks}",
                f"eos={t.eos_id}",
                f"bos={t.bos_id}",
                f"add_bos={t.add_bos}",
            ]
            parts += [
                f"phase={p.start_step}|{p.global_batch_size}|" + ",".join(map(str, p.weights))
                for p in s.phases
            ]
            parts += [f"dataset={i.fingerprint}" for i in self.indexes]
            digest = hashlib.blake2b("\n".join(parts).encode(), digest_size=16)
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    async def _fetch_tokenizer(self, executor: Executor, retry: bool) -> bool:
        """Load the tokenizer, retrying fetch failures with backoff (1 s doubling to 60 s)
        until it loads, or the job fails (the file is not a tokenizer) or is cancelled."""
        loop, pause = asyncio.get_running_loop(), 1.0
        while self.tokenizer is None and not self._failure:
            try:
                await loop.run_in_executor(executor, self.load_tokenizer)
            except LocalError as e:
                self._tokenizer_error = f"tokenizer {self.spec.tokenizer.path}: {e}; retrying"
                log.warning("job %s: %s in %.0fs", self.name, self._tokenizer_error, pause)
                if not retry:
                    self.fail(self._tokenizer_error)
                    break
                self._on_built()  # waiting requests answer with the reason now
                await asyncio.sleep(pause)
                pause = min(pause * 2, 60.0)
            except TokenfeedError as e:
                self.fail(f"tokenizer: {e}")
        return self.tokenizer is not None and not self._failure

    async def build_index(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        if not await self._fetch_tokenizer(executor, retry):
            self._ready.set()
            return
        await asyncio.gather(*(i.build(executor, parallel, retry) for i in self.indexes))
        if all(i.state == READY for i in self.indexes):
            for idx in self.indexes:  # the job's claim covers its raw data too
                self.store.cache.release(idx.raw_claim)
            try:
                self.store.cache.claim(self.name, self.working_set(parallel), f"job {self.name}")
            except CacheTooSmallError as e:
                self.fail(str(e))
        self._ready.set()

    async def servable(self) -> None:
        """Returns once step 0 can be served (its windows are built), or the build has ended."""
        while not self._ready.is_set():
            try:
                self.plan(0, 0, 1)
                return
            except (NotBuiltError, NotReadyError):
                pass
            except (JobFailedError, RequestError):
                return
            more = asyncio.ensure_future(self._built_more.wait())
            ready = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait([more, ready], return_when=asyncio.FIRST_COMPLETED)
            more.cancel()
            ready.cancel()

    async def built(self) -> None:
        """Returns once the index build has ended, READY or FAILED."""
        await self._ready.wait()

    def working_set(self, parallel: int) -> int:
        """Cache bytes the job needs to make progress: its largest window of token chunks in
        each dataset (plus one chunk being rebuilt, and the next window's first chunk, which a
        window's last row reads into), and the raw data of the chunks being tokenized at once."""
        total, raw = 0, 0
        for idx in self.indexes:
            sizes = np.sort(idx.body_bytes)[::-1]
            total += int(sizes[: self.spec.window_chunks + 2].sum())
            raw = max(raw, idx.raw_working_set(parallel))
        return total + raw

    def cancel(self) -> None:
        for i in self.indexes:
            i.cancel()

    @property
    def chunks_indexed(self) -> int:
        return sum(i.chunks_indexed for i in self.indexes)

    @property
    def num_chunks(self) -> int:
        return sum(len(i.chunks) for i in self.indexes)

    def _on_built(self) -> None:
        self._built_more.set()
        self._built_more = asyncio.Event()

    async def plan_when_built(
        self, steps: list[int], rank: int, world_size: int, timeout: float
    ) -> RowPlan:
        """The plan of one rank's batches of `steps` (plan_steps), waiting up to `timeout`
        seconds for the chunks they need to be built (serving while building: steps are
        served as soon as their windows are tokenized, in sample order, never from a partial
        window)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.state == FAILED:
                raise JobFailedError(self.error)
            try:
                return self.plan_steps(steps, rank, world_size)
            except NotBuiltError as e:
                remaining = deadline - loop.time()
                if not self._ready.is_set() and any(i.error for i in self.indexes):
                    # The build failed here and waits to retry: another server can serve sooner.
                    raise NotReadyError(
                        f"job {self.name} cannot be indexed on this server "
                        f"right now ({self.error}); retry on another server",
                        retry_after=1.0,
                    ) from None
                if remaining <= 0:
                    raise NotReadyError(
                        f"{e}; retry in about {e.retry_after:.0f}s", retry_after=e.retry_after
                    ) from None
                event = self._built_more
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    pass

    # ---------------------------------------------------------------- batches

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return packing.TENSOR_NAMES

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch of a plain job's dataset at the first batch size (0 for mixtures)."""
        if len(self.indexes) > 1:
            return 0
        return self.index.rows_per_epoch // self.spec.global_batch_size

    def check_request(self, step: int, rank: int, world_size: int) -> None:
        self.planner.check_request(step, rank, world_size)

    @property
    def step_limit(self) -> int:
        return self.planner.step_limit

    def plan(self, step: int, rank: int, world_size: int) -> RowPlan:
        """Where each row of one rank's batch lives: pure order arithmetic, no data read."""
        return self.plan_steps([step], rank, world_size)

    def plan_steps(self, steps: list[int], rank: int, world_size: int) -> RowPlan:
        """One plan of several steps of one rank (Planner.plan_steps), once the job can
        serve: JobFailedError if it failed, NotReadyError while its tokenizer is missing."""
        if self.state == FAILED or self.tokenizer is None:
            for step in steps:  # a bad request still says what is wrong with it
                self.check_request(step, rank, world_size)
        if self.state == FAILED:
            raise JobFailedError(self.error)
        if self.tokenizer is None:
            raise NotReadyError(
                f"job {self.name} cannot serve yet: {self._tokenizer_error}", retry_after=5.0
            )
        return self.planner.plan_steps(steps, rank, world_size)

    def chunks_read(self, plan: RowPlan) -> set[tuple[int, int, int]]:
        return self.planner.chunks_read(plan)

    split_plan = staticmethod(Planner.split)

    def layout(self, d: int, epoch: int) -> order.EpochLayout:
        return self.planner.layout(d, epoch)

    # ---------------------------------------------------------------- the future

    def note_served(self, tokens: int) -> None:
        self.progress.tokens_served += tokens
        if self.supervisor is not None:  # its status page counts every worker's tokens
            self.supervisor.served(self.name, tokens)

    def note_request(self, step: int, rank: int, world_size: int) -> None:
        if self.supervisor is not None:  # its prefetch and eviction follow the trainers
            self.supervisor.note(self.name, step, rank, world_size)
        self.progress.note(step, rank, world_size)
        metrics.JOB_FURTHEST_STEP.labels(self.name).set(self.progress.furthest)

    def fail(self, error: str) -> None:
        """The data refuses the job after it became ready (an object changed under it)."""
        if not self._failure:
            self._failure = error
            log.error("job %s failed: %s", self.name, error)

    # ---------------------------------------------------------------- batches (assembly.py)

    def pinned(self, plan: RowPlan):
        return self.assembler.pinned(plan)

    async def open_chunks(self, plan: RowPlan, executor: Executor) -> None:
        await self.assembler.open_chunks(plan, executor)

    def assemble(self, plan: RowPlan) -> tuple[int, wire.Compact]:
        return self.assembler.assemble(plan)

    def assemble_steps(self, plan: RowPlan, steps: int) -> list[tuple[int, wire.Compact]]:
        return self.assembler.assemble_steps(plan, steps)

    def batch(self, step: int, rank: int, world_size: int) -> tuple[int, dict[str, np.ndarray]]:
        """(epoch of the first row, the five int32 arrays [rows, seq_len]) of one rank's slice,
        expanded as the client expands the wire form."""
        epoch, compact = self.assemble(self.plan(step, rank, world_size))
        return epoch, {name: wire.expand(compact, name) for name in wire.TENSOR_NAMES}
