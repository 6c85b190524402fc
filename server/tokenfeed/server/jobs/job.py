"""A job at run time: its datasets' token indexes (index.py), its schedule (mixture.py) and
the batches it serves.

A batch is planned (which dataset row fills each position, then where each row lives: pure
order arithmetic), its chunks are opened (disk work: `open_chunks` runs it in a worker thread,
so a slow or corrupt chunk never stalls other calls), and it is assembled by the pure packing
functions from the stored tokens. Its build, from start to ready, is building.py's.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Protocol

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server.dataplan.keeper import PlanKeeper
from tokenfeed.server.dataplan.model import DataPlan
from tokenfeed.server.errors import (
    JobFailedError,
    LocalError,
    NotBuiltError,
    NotReadyError,
    ObjectStoreError,
    SourceError,
    TokenfeedError,
)
from tokenfeed.server.indexing.index import FAILED, INDEXING, READY, DatasetIndex, JobState
from tokenfeed.server.indexing.owner import ChunkOwner
from tokenfeed.server.jobs.building import JobBuild
from tokenfeed.server.jobs.identity import JobIdentity
from tokenfeed.server.jobs.jobplan import JobPlan
from tokenfeed.server.jobs.progress import Progress
from tokenfeed.server.jobs.shapes import ChunkShapes
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.pack import packing
from tokenfeed.server.pack.assembly import Assembler, GroupRows
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
        self.refused = ""  # a job-level refusal (the cache cannot hold its working set)
        # The tokenizer may live in object storage: a fetch that fails is this job's problem
        # only (retried by build_index like any storage failure), a file that is not a
        # tokenizer fails the job; the server and its other jobs serve on (loaded below).
        self.tokenizer: TextTokenizer | None = None
        # Its build, from start to ready, and what requests wait on meanwhile (building.py).
        self.build = JobBuild(self)
        # No tokenizer yet: load_tokenizer gives each index the job's, once it is loaded
        # (DatasetIndex's annotation says the tokenizer is always there).
        self.indexes: list[DatasetIndex] = []
        for d in self.plans.plan.datasets:
            self.indexes.append(self._index(d))
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
        self.identity = JobIdentity(spec, self.plans)
        self.progress = Progress()
        try:
            self.load_tokenizer()
        except LocalError as e:
            self.build.tokenizer_error = f"tokenizer {spec.tokenizer.path}: {e}; retrying"
            log.warning("job %s: %s", self.name, self.build.tokenizer_error)
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
            self.tokenizer,
            self.storage,
            self.shared,
            self.supervisor,
            position=position,
            seq_len=first.seq_len,
        )
        idx.listeners.append(self.build.wake)
        return idx

    def _plan_changed(self, old: DataPlan, new: DataPlan) -> None:
        """A new version of the plan (from any thread): the datasets it adds get an index (and
        a build, on the loop), the planner the new schedule. The plan only changed past its
        horizon, so every step already servable plans the same."""
        for dataset in new.datasets[len(self.indexes) :]:
            idx = self._index(dataset)
            self.indexes.append(idx)
            self.build.add(idx)
        self._use_plan()

    def _use_plan(self) -> None:
        plan = self.plans.plan
        self.planner.use(
            self.plans.schedule,
            self.plans.step_limit(MAX_STEP),
            self.plans.seq_len,
            [(p.start_step, p.seq_len, p.packing) for p in plan.phases],
        )
        self.count_shapes()

    def count_shapes(self) -> None:
        """Start counting the best-fit rows a phase of another packing or seq_len needs, as
        soon as the plan has it (the phase starts at least plan_freeze_steps later)."""
        for p in self.plans.plan.phases:
            if (p.packing or self.spec.packing) != "best_fit":
                continue
            for d, idx in enumerate(self.indexes):
                own = self.spec.packing == "best_fit" and idx.seq_len == p.seq_len
                if idx.state == READY and not own and self.tokenizer is not None:
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
        self.build.wake_from_thread()

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
        if FAILED in states or self.refused:
            return FAILED
        return READY if states == {READY} else INDEXING

    @property
    def error(self) -> str:
        b = self.build
        own = [e for e in (self.refused, b.tokenizer_error, b.plan_error) if e]
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
            self.build.tokenizer_error = ""
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

    # ---------------------------------------------------------------- its build (building.py)

    async def build_index(self, executor: Executor, parallel: int, retry: bool = True) -> None:
        await self.build.build_index(executor, parallel, retry)

    async def servable(self) -> None:
        await self.build.servable()

    async def built(self) -> None:
        await self.build.built()

    async def plan_when_built(
        self, steps: list[int], rank: int, world_size: int, timeout: float
    ) -> RowPlan:
        return await self.build.plan_when_built(steps, rank, world_size, timeout)

    def working_set(self, parallel: int) -> int:
        return self.build.working_set(parallel)

    def cancel(self) -> None:
        for i in self.indexes:
            i.cancel()

    @property
    def chunks_indexed(self) -> int:
        return sum(i.chunks_indexed for i in self.indexes)

    @property
    def num_chunks(self) -> int:
        return sum(len(i.chunks) for i in self.indexes)

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
                f"job {self.name} cannot serve yet: {self.build.tokenizer_error}", retry_after=5.0
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
        if not self.refused:
            self.refused = error
            log.error("job %s failed: %s", self.name, error)

    # ---------------------------------------------------------------- batches (assembly.py)

    def pinned(self, plan: RowPlan):
        return self.assembler.pinned(plan)

    async def open_chunks(self, plan: RowPlan, executor: Executor) -> None:
        await self.assembler.open_chunks(plan, executor)

    def assemble(self, plan: RowPlan) -> tuple[int, wire.Compact]:
        return self.assembler.assemble(plan)

    def assemble_group(self, plan: RowPlan, steps: int) -> tuple[list[int], wire.Compact]:
        return self.assembler.assemble_group(plan, steps)

    def group(self, plan: RowPlan, steps: int) -> tuple[list[int], wire.Compact | GroupRows]:
        return self.assembler.group(plan, steps)

    def batch(self, step: int, rank: int, world_size: int) -> tuple[int, dict[str, np.ndarray]]:
        """(epoch of the first row, the five int32 arrays [rows, seq_len]) of one rank's slice,
        expanded as the client expands the wire form."""
        epoch, compact = self.assemble(self.plan(step, rank, world_size))
        return epoch, {name: wire.expand(compact, name) for name in wire.TENSOR_NAMES}
