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
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server import bestfit, metrics, order, packing
from tokenfeed.server.chunks import CHUNK_FORMAT_VERSION
from tokenfeed.server.config import JobSpec
from tokenfeed.server.control import SupervisorLink
from tokenfeed.server.errors import (
    BadRecordError,
    CacheTooSmallError,
    JobFailedError,
    LocalError,
    NotBuiltError,
    NotReadyError,
    ObjectStoreError,
    RequestError,
    SourceError,
    StoreCorruptError,
    TokenfeedError,
)
from tokenfeed.server.explain import explain_rows
from tokenfeed.server.index import FAILED, INDEXING, READY, DatasetIndex
from tokenfeed.server.lru import LRU
from tokenfeed.server.mixture import Phase, Schedule
from tokenfeed.server.progress import Progress
from tokenfeed.server.sharedstore import SharedStore
from tokenfeed.server.storage import Storage
from tokenfeed.server.tokenize import TextTokenizer
from tokenfeed.server.tokstore import TokenChunk, TokenStore

log = logging.getLogger(__name__)

MAX_STEP = 2**62
__all__ = ["FAILED", "INDEXING", "MAX_STEP", "READY", "Job"]


@dataclass(frozen=True)
class PlanPart:
    """The rows of one dataset in one rank's batch: `slots` are their places in the batch,
    `epochs` the epoch each starts in, `pieces` where their units live (order.Pieces, whose
    `row` indexes `slots`)."""

    dataset: int
    slots: np.ndarray
    epochs: np.ndarray
    pieces: order.Pieces


class Plan(NamedTuple):
    rows: int  # rows of the rank's batch
    parts: list[PlanPart]


class Job:
    def __init__(
        self,
        spec: JobSpec,
        store: TokenStore,
        storage: Storage | None = None,
        shared: SharedStore | None = None,
        supervisor: SupervisorLink | None = None,
        stream_cache_bytes: int = 512 * 2**20,
    ):
        self.spec, self.name, self.store = spec, spec.name, store
        self.storage = storage = storage or Storage()
        self.supervisor = supervisor  # in a serving worker: the process that owns the cache
        self.indexes = [
            DatasetIndex(spec, d, store, None, storage, shared, supervisor) for d in spec.datasets
        ]
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
        phases = [Phase(p.start_step, p.global_batch_size, p.weights) for p in spec.phases]
        self.schedule = Schedule(phases, spec.seed)
        self._ready = asyncio.Event()
        self._layouts = LRU(4 * len(self.indexes))
        self._streams = LRU(512)
        self._windows = LRU(16 * len(self.indexes))
        self._open = LRU(256)
        # Concat streams materialised per (dataset, epoch, chunk): a row is then one slice copy
        # per chunk it touches (bench/, wire section: [32, 4096] batches at about 3x the rate of
        # gathering token by token), for this much memory.
        self._materialised = LRU(4096, stream_cache_bytes)
        self._fingerprint = ""
        self.progress = Progress()
        self._built_more = asyncio.Event()  # set (and replaced) whenever more rows are built
        for idx in self.indexes:
            idx.listeners.append(self._on_built)
        store.cache.on_evict(self._forget)

    @property
    def index(self) -> DatasetIndex:
        """The first dataset's index (the only one of a plain job)."""
        return self.indexes[0]

    @property
    def state(self) -> str:
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
            self.tokenizer = TextTokenizer(self.spec.tokenizer, raw)
            for idx in self.indexes:
                idx.tokenizer = self.tokenizer
            self._tokenizer_error = ""
        return self.tokenizer

    @property
    def fingerprint(self) -> str:
        """Everything that decides the bytes of a batch; known once every dataset's chunks are
        planned (before they are tokenized), empty until then."""
        if not self._fingerprint and all(i.fingerprint for i in self.indexes):
            s, t = self.spec, self.tokenizer
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
    ) -> Plan:
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
        limit = MAX_STEP // max(p.global_batch_size for p in self.spec.phases)
        if not 0 <= step < limit:
            raise RequestError(f"step must be in [0, {limit}), got {step}")
        if world_size < 1:
            raise RequestError(f"world_size must be >= 1, got {world_size}")
        b = self.schedule.batch_size(step)
        if b % world_size:
            divisors = [w for w in range(1, b + 1) if b % w == 0]
            raise RequestError(
                f"world_size {world_size} does not divide global_batch_size {b} of job "
                f"{self.name} at step {step}; valid world sizes: {divisors}"
            )
        if not 0 <= rank < world_size:
            raise RequestError(f"rank must be in [0, {world_size}), got {rank}")

    def plan(self, step: int, rank: int, world_size: int) -> Plan:
        """Where each row of one rank's batch lives: pure order arithmetic, no data read."""
        return self.plan_steps([step], rank, world_size)

    def plan_steps(self, steps: list[int], rank: int, world_size: int) -> Plan:
        """One plan of one rank's batches of several steps of the same batch size, their rows
        one step after another: each dataset's rows are located in one pass (a stream's next
        steps pay the per-call costs once)."""
        for step in steps:
            self.check_request(step, rank, world_size)
        if self.state == FAILED:
            raise JobFailedError(self.error)
        if self.tokenizer is None:
            raise NotReadyError(
                f"job {self.name} cannot serve yet: {self._tokenizer_error}", retry_after=5.0
            )
        per_rank = self.schedule.batch_size(steps[0]) // world_size
        if any(self.schedule.batch_size(step) // world_size != per_rank for step in steps):
            raise ValueError(f"steps {steps} have different batch sizes")
        found = [self.schedule.rows(step, rank * per_rank, per_rank) for step in steps]
        datasets = np.concatenate([f[0] for f in found]) if len(steps) > 1 else found[0][0]
        dataset_rows = np.concatenate([f[1] for f in found]) if len(steps) > 1 else found[0][1]
        parts = []
        for d in dict.fromkeys(datasets.tolist()):  # distinct, in order; cheap when small
            mine = np.nonzero(datasets == d)[0]
            rows = dataset_rows[mine]
            # The first step that needs a row not built yet is the one that waits.
            epochs, pieces = self._locate(d, rows, steps[int(mine[np.argmax(rows)]) // per_rank])
            parts.append(PlanPart(d, mine, epochs, pieces))
        return Plan(per_rank * len(steps), parts)

    def _locate(self, d: int, rows: np.ndarray, step: int) -> tuple[np.ndarray, order.Pieces]:
        """(epoch of each row, the pieces of chunks they read) for rows of dataset `d`."""
        idx = self.indexes[d]
        if idx.state == READY:
            epochs = order.epoch_of_row(rows, idx.units_per_epoch, idx.per_row)
        else:  # still building: only epoch 0's rows of fully built windows are known
            need = int(rows.max()) + 1
            if need > idx.rows_built:
                raise NotBuiltError(self._not_built(idx, step, need))
            epochs = np.zeros(len(rows), dtype=np.int64)
        natural = np.empty_like(rows)
        for epoch in dict.fromkeys(epochs.tolist()):
            sel = epochs == epoch
            natural[sel] = order.natural_rows(
                self.layout(d, epoch),
                rows[sel],
                lambda w, d=d, e=epoch: self._window_perm(d, e, w),
            )
        pieces = order.locate_units(
            natural * idx.per_row, idx.span, idx.units_per_epoch, lambda e: self.layout(d, e)
        )
        return epochs, pieces

    def chunks_of_steps(self, first: int, end: int) -> set[tuple[int, int]]:
        """The (dataset, chunk) pairs that the whole global batches of steps [first, end)
        read: one pass over their rows, whatever the number of steps."""
        rows: dict[int, list[np.ndarray]] = {}
        for step in range(first, end):
            datasets, dataset_rows = self.schedule.rows(step, 0, self.schedule.batch_size(step))
            for d in dict.fromkeys(datasets.tolist()):
                rows.setdefault(d, []).append(dataset_rows[datasets == d])
        out: set[tuple[int, int]] = set()
        for d, found in rows.items():
            _, pieces = self._locate(d, np.concatenate(found), first)
            out.update((d, c) for c in np.unique(pieces.chunk).tolist())
        return out

    @staticmethod
    def plan_chunks(plan: Plan) -> set[tuple[int, int, int]]:
        """The (dataset, epoch, chunk) stretches a plan reads."""
        out = set()
        for p in plan.parts:
            pairs = zip(p.pieces.epoch.tolist(), p.pieces.chunk.tolist(), strict=True)
            out.update((p.dataset, e, c) for e, c in pairs)
        return out

    def _not_built(self, idx: DatasetIndex, step: int, need: int) -> tuple[str, float]:
        """Why step cannot be served yet, and a guess of the seconds until it can."""
        built = idx.positions_built
        elapsed = max(time.monotonic() - idx.started, 1e-3)
        rate = idx.rows_built / elapsed  # rows per second built so far
        eta = (need - idx.rows_built) / rate if rate > 0 else 5.0
        return (
            f"step {step} of job {self.name} needs {need} rows of dataset "
            f"{idx.dataset.name}; {idx.rows_built} rows are built so far ({built}/"
            f"{len(idx.chunks)} chunks tokenized in sample order)",
            min(max(eta, 1.0), 600.0),
        )

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

    async def prefetch(self, executor: Executor, steps: int) -> None:
        """Keep every chunk of the next `steps` steps past the furthest request in the cache
        (rebuilding evicted ones), until cancelled. Once the lead falls to half of `steps`,
        the steps up to the full lead are planned together: a stream advancing one step at a
        time costs one plan per `steps // 2` steps, not one per step."""
        await self._ready.wait()
        p = self.progress
        while steps and self.state == READY:
            first = max(p.prefetched, p.furthest) + 1
            end = max(p.furthest, 0) + steps + 1
            if first > max(p.furthest, 0) + (steps + 1) // 2:
                await p.changed()
                continue
            was = p.furthest
            try:
                await self._prefetch_steps(executor, first, end)
            except (SourceError, BadRecordError) as e:
                self.fail(str(e))
                return
            except Exception as e:  # local (cache full, network): requests will say so
                log.warning(
                    "job %s: prefetch of steps %d..%d failed: %s", self.name, first, end - 1, e
                )
                await asyncio.sleep(1.0)
                continue
            if p.furthest >= was:  # else a rollback moved it back meanwhile: start again
                p.prefetched = end - 1
            metrics.PREFETCH_LEAD_STEPS.labels(self.name).set(max(p.lead_steps, 0))
            metrics.PREFETCH_LEAD_SECONDS.labels(self.name).set(p.lead_seconds)

    async def _prefetch_steps(self, executor: Executor, first: int, end: int) -> None:
        needed = self.chunks_of_steps(first, end)
        missing = [(d, c) for d, c in needed if not self.store.has_body(self.indexes[d].keys[c])]
        if missing:
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(
                    loop.run_in_executor(executor, self.indexes[d].ensure_chunk, c, True)
                    for d, c in missing
                )
            )

    def fail(self, error: str) -> None:
        """The data refuses the job after it became ready (an object changed under it)."""
        if not self._failure:
            self._failure = error
            log.error("job %s failed: %s", self.name, error)

    # ---------------------------------------------------------------- chunks

    def chunk_keys(self, plan) -> list[tuple[str, str]]:
        """The cache entries a plan reads, to pin while it is served."""
        needed = {(d, c) for d, _, c in self.plan_chunks(plan)}
        return [("chunk", self.indexes[d].keys[c]) for d, c in needed]

    def pinned(self, plan):
        return self.store.cache.pinned(self.chunk_keys(plan))

    async def open_chunks(self, plan, executor: Executor) -> None:
        """Open (verify, or rebuild) in a worker thread the chunks a plan needs."""
        needed = self.plan_chunks(plan)
        if self.spec.packing == "concat":  # opened and laid out in the epoch's order
            missing = [key for key in needed if not self._materialised.contains(key)]
            make = self._stream_ids
        else:
            missing = list(
                {(d, c) for d, _, c in needed if not self._materialised.contains((d, -1, c))}
            )
            make = self._bestfit_tokens
        if missing:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.gather(
                    *(loop.run_in_executor(executor, make, *key) for key in missing)
                )
            except (SourceError, BadRecordError) as e:
                self.fail(str(e))
                raise JobFailedError(str(e)) from e

    def batch(self, step: int, rank: int, world_size: int) -> tuple[int, dict[str, np.ndarray]]:
        """(epoch of the first row, the five int32 arrays [rows, seq_len]) of one rank's slice,
        expanded as the client expands the wire form."""
        epoch, compact = self.assemble(self.plan(step, rank, world_size))
        return epoch, {name: wire.expand(compact, name) for name in wire.TENSOR_NAMES}

    def assemble(self, plan: Plan) -> tuple[int, wire.Compact]:
        """(epoch of the first row, the compact batch) of a plan: token ids in the wire's
        dtype and document starts (docs/batch-format.md)."""
        seq_len = self.spec.seq_len
        first_epoch = 0
        for part in plan.parts:
            hit = np.nonzero(part.slots == 0)[0]
            if hit.size:
                first_epoch = int(part.epochs[hit[0]])
        if self.spec.packing == "best_fit":
            return first_epoch, wire.compact_from_tensors(
                self._assemble_bestfit(plan), self.wire_dtype
            )
        ids, starts = packing.assemble_concat(
            plan.rows,
            seq_len,
            [(p.dataset, p.slots, p.pieces) for p in plan.parts],
            self.stream,
            self._stream_ids,
            self.wire_dtype,
        )
        return first_epoch, wire.compact_from_flat_starts(ids, starts)

    def assemble_steps(self, plan: Plan, steps: int) -> list[tuple[int, wire.Compact]]:
        """`assemble` of a plan of several steps (plan_steps): the whole assembled in one
        pass, then cut into the steps' batches, each with the epoch of its first row."""
        epoch, whole = self.assemble(plan)
        if steps == 1:
            return [(epoch, whole)]
        per_step = plan.rows // steps
        epochs = np.zeros(steps, dtype=np.int64)
        for part in plan.parts:
            first = part.slots % per_step == 0
            epochs[part.slots[first] // per_step] = part.epochs[first]
        return [
            (int(epochs[i]), wire.slice_rows(whole, i * per_step, (i + 1) * per_step))
            for i in range(steps)
        ]

    @property
    def wire_dtype(self) -> np.dtype:
        return wire.token_dtype(self.tokenizer.vocab_size)

    def _assemble_bestfit(self, plan: Plan) -> dict[str, np.ndarray]:
        s, t = self.spec, self.tokenizer
        out = {
            name: np.empty((plan.rows, s.seq_len), dtype=np.int32) for name in packing.TENSOR_NAMES
        }
        for part in plan.parts:
            pc = part.pieces  # one piece per row: `lo` is the row within its chunk
            for c in dict.fromkeys(pc.chunk.tolist()):
                sel = pc.chunk == c
                chunk, layout = self.chunk(part.dataset, c), self.bestfit_layout(part.dataset, c)
                tokens = self._bestfit_tokens(part.dataset, c)
                rows = bestfit.bestfit_rows_at(
                    layout,
                    chunk.doc_offsets,
                    tokens,
                    pc.lo[sel],
                    s.seq_len,
                    t.bos_id,
                    t.eos_id,
                    t.eos_id,
                )
                for name, arr in rows.items():  # padding slots hold EOS, masked by loss_mask
                    out[name][part.slots[pc.row[sel]]] = arr
        return out

    def explain(self, step: int, rank: int, world_size: int) -> list[dict]:
        """Provenance of every row of one rank's batch (reads manifests, may count lines:
        run it off the event loop)."""
        plan = self.plan(step, rank, world_size)
        with self.pinned(plan):
            return explain_rows(self, plan)

    def layout(self, d: int, epoch: int) -> order.EpochLayout:
        """Epoch `epoch`'s layout. While the index builds, the layout of epoch 0 is exact over
        its built windows (chunks not built yet count 0 rows, after them); it is keyed by how
        many windows are built, so it is remade as the build advances."""
        idx, s = self.indexes[d], self.spec
        version = -1 if idx.state == READY else idx.rows_built

        def make() -> order.EpochLayout:
            return order.epoch_layout(
                idx.units_per_chunk,
                s.seed,
                idx.dataset.name,
                epoch,
                s.window_chunks,
                idx.per_row,
                idx.units_per_epoch or None,
            )

        return self._layouts.get_or_make((d, epoch, version), make)

    def _window_perm(self, d: int, epoch: int, w: int) -> np.ndarray:
        layout = self.layout(d, epoch)
        return self._windows.get_or_make((d, epoch, w), lambda: order.window_order(layout, w))

    def chunk(self, d: int, c: int) -> TokenChunk:
        return self._open.get_or_make((d, c), lambda: self._load(d, c))

    def _load(self, d: int, c: int) -> TokenChunk:
        # An evicted or corrupt body is rebuilt: tokenization is deterministic, so the rebuilt
        # chunk has the same bytes (its digest is checked against the index).
        idx = self.indexes[d]
        return self._checked(idx, c, idx.open_body(c)[1])

    def forget_gone(self) -> int:
        """In a serving worker: drop the mappings of bodies the supervisor has evicted since
        (so their disk space is freed); the number dropped."""
        gone = [(d, c) for d, c in self._open.keys() if self.store.gone(self.indexes[d].keys[c])]
        for key in gone:
            self._open.discard(key)
        return len(gone)

    def _forget(self, entry: tuple[str, str]) -> None:
        """An evicted body is no longer mapped here (called with the cache's lock held)."""
        kind, key = entry
        for d, idx in enumerate(self.indexes):
            c = idx.keys.get(key) if kind == "chunk" else None
            if c is not None:
                self._open.discard((d, c))

    @staticmethod
    def _checked(idx: DatasetIndex, c: int, chunk: TokenChunk) -> TokenChunk:
        if len(chunk.doc_lengths) != idx.num_docs[c] or chunk.tokens.size != idx.num_tokens[c]:
            raise StoreCorruptError(
                f"token chunk {idx.keys[c]} holds {len(chunk.doc_lengths)} documents and "
                f"{chunk.tokens.size} tokens, the index says {idx.num_docs[c]} and "
                f"{idx.num_tokens[c]}"
            )
        return chunk

    def stream(self, d: int, epoch: int, c: int) -> packing.ChunkStream:
        def make() -> packing.ChunkStream:
            chunk, s, name = self.chunk(d, c), self.spec, self.indexes[d].dataset.name
            doc_order = order.document_order(len(chunk.doc_lengths), s.seed, name, epoch, c)
            return packing.concat_stream(
                chunk.doc_offsets, chunk.doc_lengths, doc_order, self.tokenizer.add_bos
            )

        return self._streams.get_or_make((d, epoch, c), make)

    def _stream_ids(self, d: int, epoch: int, c: int) -> np.ndarray:
        """Chunk c's concat stream in `epoch`, token by token, in the wire's dtype."""

        def make() -> np.ndarray:
            t = self.tokenizer
            return packing.materialise(
                self.stream(d, epoch, c),
                self._verified(d, c).tokens,
                t.bos_id,
                t.eos_id,
                self.wire_dtype,
            )

        return self._materialised.get_or_make((d, epoch, c), make)

    def _verified(self, d: int, c: int) -> TokenChunk:
        """Chunk c opened with its digests checked now, whatever was checked before: what is
        served is copied from it (a stream laid out, best_fit's tokens), so damage to a body
        while the server runs is found at the next copy, and the chunk rebuilt, never served."""
        self.store.forget_verified(self.indexes[d].keys[c])
        self._open.discard((d, c))
        return self.chunk(d, c)

    def _bestfit_tokens(self, d: int, c: int) -> np.ndarray:
        """Chunk c's tokens, verified and copied (best_fit reads rows from them)."""
        return self._materialised.get_or_make(
            (d, -1, c), lambda: np.array(self._verified(d, c).tokens)
        )

    def bestfit_layout(self, d: int, c: int) -> bestfit.BestFitLayout:
        # best-fit rows do not depend on the epoch's document order (the rows are permuted)
        def make() -> bestfit.BestFitLayout:
            lengths = self.chunk(d, c).doc_lengths
            return bestfit.bestfit_layout(lengths, self.spec.seq_len, self.tokenizer.add_bos)

        return self._streams.get_or_make((d, -1, c), make)
