"""A job at run time: its datasets' token indexes (index.py), its schedule (mixture.py) and
the batches it serves.

A batch is planned (which dataset row fills each position, then where each row lives: pure
order arithmetic), its chunks are opened (disk work: `open_chunks` runs it in a worker thread,
so a slow or corrupt chunk never stalls other calls), and it is assembled by the pure packing
functions from the stored tokens.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Protocol

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server.dataplan.keeper import PlanKeeper
from tokenfeed.server.dataplan.model import DataPlan
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
from tokenfeed.server.jobs.backoff import with_backoff
from tokenfeed.server.jobs.identity import JobIdentity
from tokenfeed.server.jobs.jobplan import JobPlan
from tokenfeed.server.jobs.progress import Progress
from tokenfeed.server.jobs.shapes import ChunkShapes
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.pack import packing
from tokenfeed.server.pack.assembly import Assembler
from tokenfeed.server.pack.sharedrows import SharedRows
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.mixture import Schedule
from tokenfeed.server.sampling.planner import MAX_STEP, Planner, RowPlan
from tokenfeed.server.settings.config import DatasetSpec, JobSpec
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
        keeper: PlanKeeper | None = None,
        rows: SharedRows | None = None,
    ):
        self.spec, self.name, self.store = spec, spec.name, store
        self.storage, self.shared = storage, shared
        self.supervisor = supervisor  # in a serving worker: the process that owns the cache
        # The data plan: the config's until the job's plan log is open (build_index), then the
        # log's, and each version appended to it (jobplan.py, dataplan/).
        self.plans = JobPlan(spec, keeper, self._plan_changed)
        # No tokenizer yet: load_tokenizer gives each index the job's, once it is loaded
        # (DatasetIndex's annotation says the tokenizer is always there).
        self.indexes: list[DatasetIndex] = []
        for d in self.plans.plan.datasets:
            self.indexes.append(self._index(d))
        self._building: tuple[asyncio.AbstractEventLoop, Executor, int, bool] | None = None
        # A phase that changes the packing reads the datasets' documents (jobs/shapes.py).
        self.shapes = ChunkShapes(
            spec.name, spec.seed, self.indexes, self._doc_lengths, self._add_bos, self._counted
        )
        self.planner = Planner(spec, self.indexes, self.plans.schedule, self.shapes)
        self._use_plan()
        self.assembler = Assembler(
            spec,
            self.indexes,
            store,
            self.fail,
            stream_cache_bytes,
            self.planner.chunk_tail,
            self.planner.carry_block,
            rows,
            self._layout_identity,
        )
        self._ready = asyncio.Event()
        self.identity = JobIdentity(spec, self.plans)
        self.progress = Progress()
        self._built_more = asyncio.Event()  # set (and replaced) whenever more rows are built
        # The tokenizer may live in object storage: a fetch that fails is this job's problem
        # only (retried by build_index like any storage failure), a file that is not a
        # tokenizer fails the job; the server and its other jobs serve on.
        self.tokenizer: TextTokenizer | None = None
        self._tokenizer_error = ""
        self._plan_error = ""
        self._failure = ""  # a job-level refusal (the cache cannot hold its working set)
        self._added_builds: set[asyncio.Future] = set()
        try:
            self.load_tokenizer()
        except LocalError as e:
            self._tokenizer_error = f"tokenizer {spec.tokenizer.path}: {e}; retrying"
            log.warning("job %s: %s", self.name, self._tokenizer_error)
        except TokenfeedError as e:
            self.fail(f"tokenizer: {e}")

    def _index(self, dataset: DatasetSpec) -> DatasetIndex:
        """The index of one of the plan's datasets (the next one: they are added in order)."""
        position = len(self.indexes)
        first = next(
            p for p in self.plans.plan.phases if len(p.weights) > position
        )  # the phase that made the dataset known: its rows start in that phase's grid
        idx = DatasetIndex(
            self.spec,
            dataset,
            self.store,
            getattr(self, "tokenizer", None),
            self.storage,
            self.shared,
            self.supervisor,
            position=position,
            seq_len=first.seq_len,
        )
        idx.listeners.append(self._on_built)
        return idx

    def _plan_changed(self, old: DataPlan, new: DataPlan) -> None:
        """A new version of the plan (from any thread): the datasets it adds get an index (and
        a build, on the loop), the planner the new schedule. The plan only changed past its
        horizon, so every step already servable plans the same."""
        for dataset in new.datasets[len(self.indexes) :]:
            idx = self._index(dataset)
            self.indexes.append(idx)
            if self._building is not None:
                loop, executor, parallel, retry = self._building
                loop.call_soon_threadsafe(self._build_added, idx, executor, parallel, retry)
        self._use_plan()

    def _use_plan(self) -> None:
        plan = self.plans.plan
        self.planner.use(
            self.plans.schedule,
            self.plans.step_limit(MAX_STEP),
            self.plans.seq_len,
            [(p.start_step, p.seq_len, p.packing) for p in plan.phases],
        )
        self._count_shapes()

    def _count_shapes(self) -> None:
        """Start counting the best-fit rows a phase of another packing or seq_len needs, as
        soon as the plan has it (the phase starts at least plan_freeze_steps later)."""
        for p in self.plans.plan.phases:
            if (p.packing or self.spec.packing) != "best_fit":
                continue
            for d, idx in enumerate(self.indexes):
                own = self.spec.packing == "best_fit" and idx.seq_len == p.seq_len
                if idx.state == READY and not own and getattr(self, "tokenizer", None):
                    self.shapes.count(d, p.seq_len)

    def _doc_lengths(self, d: int, c: int) -> np.ndarray:
        """Runs in a thread: the document lengths of chunk c of dataset d."""
        return np.array(self.indexes[d].open_body(c)[1].doc_lengths, dtype=np.int64)

    def _add_bos(self) -> bool:
        if self.tokenizer is None:
            raise NotBuiltError((f"job {self.name}: its tokenizer is not loaded yet", 5.0))
        return self.tokenizer.add_bos

    def _counted(self) -> None:
        """From a thread: a count a phase of another packing waited for is done."""
        building = self._building
        if building is not None:
            building[0].call_soon_threadsafe(self._on_built)

    def _build_added(
        self, idx: DatasetIndex, executor: Executor, parallel: int, retry: bool
    ) -> None:
        """On the loop: build a dataset the plan added while the job runs."""
        log.info("job %s: dataset %s added by the plan; building its index", self.name, idx.name)
        self._on_built()
        task = asyncio.ensure_future(self._build_one(idx, executor, parallel, retry))
        self._added_builds.add(task)
        task.add_done_callback(self._added_builds.discard)

    async def _build_one(
        self, idx: DatasetIndex, executor: Executor, parallel: int, retry: bool
    ) -> None:
        await idx.build(executor, parallel, retry)
        self._claim(parallel)

    @property
    def schedule(self) -> Schedule:
        return self.plans.schedule

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
        own = [e for e in (self._failure, self._tokenizer_error, self._plan_error) if e]
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
        """Everything that decides the bytes of the job's batches as the run started (its plan
        at version 1: the same on every server however the plan was amended since, and
        whatever their config files say now); jobs/identity.py."""
        return self.identity.fingerprint(self.tokenizer, self.indexes)

    def chain(self) -> list[tuple[int, str]]:
        """(start step, fingerprint) of each phase of the plan in force, made once per plan
        version: every served batch names its link (jobs/identity.py)."""
        return self.identity.chain(self.tokenizer, self.indexes)

    def _layout_identity(self) -> str:
        """What decides the bytes of the job's row buffers (shared by the serving processes of
        a node, pack/sharedrows.py): the plan's fingerprint at its version, once the job is
        ready; empty (nothing shared) until then."""
        if self.state != READY:
            return ""
        chain = self.chain()
        return chain[-1][1] if chain else ""

    def plan_of(self, step: int) -> tuple[int, str]:
        """(start step of the phase in force at `step`, the plan's fingerprint up to it)."""
        chain = self.chain()
        k = self.plans.phase_at(step)
        return chain[k] if chain else (self.plans.plan.phases[k].start_step, "")

    async def _fetch_tokenizer(self, executor: Executor, retry: bool) -> bool:
        """Load the tokenizer, retrying fetch failures with backoff until it loads, or the job
        fails (the file is not a tokenizer) or is cancelled."""
        if self.tokenizer is not None:
            return not self._failure
        loop = asyncio.get_running_loop()

        def note(error: str) -> None:
            self._tokenizer_error = error

        return await with_backoff(
            lambda: loop.run_in_executor(executor, self.load_tokenizer),
            job=self.name,
            what="tokenizer",
            retrying=f"tokenizer {self.spec.tokenizer.path}",
            retry=retry,
            note=note,
            fail=self.fail,
            wake=self._on_built,
            stopped=lambda: bool(self._failure),
        )

    async def build_index(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        if not await self._fetch_tokenizer(executor, retry):
            self._ready.set()
            return
        if not await self._open_plan(executor, retry):
            self._ready.set()
            return
        self._building = (asyncio.get_running_loop(), executor, parallel, retry)
        await asyncio.gather(*(i.build(executor, parallel, retry) for i in list(self.indexes)))
        self._claim(parallel)
        self._ready.set()

    async def _open_plan(self, executor: Executor, retry: bool) -> bool:
        """Open the job's plan log (its datasets may be more than the config's), retrying a
        log that cannot be reached while requests get UNAVAILABLE."""

        def note(error: str) -> None:
            self._plan_error = error

        return await with_backoff(
            lambda: self.plans.open(executor),
            job=self.name,
            what="data plan",
            retrying="data plan",
            retry=retry,
            note=note,
            fail=self.fail,
            wake=self._on_built,
            stopped=lambda: bool(self._failure),
        )

    def _claim(self, parallel: int) -> None:
        """Once every dataset is built: the job's claim on the cache (its working set)."""
        if all(i.state == READY for i in self.indexes):
            for idx in self.indexes:  # the job's claim covers its raw data too
                self.store.cache.release(idx.raw_claim)
            try:
                self.store.cache.claim(self.name, self.working_set(parallel), f"job {self.name}")
            except CacheTooSmallError as e:
                self.fail(str(e))
            self._count_shapes()

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
