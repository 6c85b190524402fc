"""A job's batches from its plans: the chunks a plan reads are opened (disk work, in a worker
thread: `open_chunks`), then the pure packing functions assemble the rows from the stored
tokens, in the wire's dtype: concat rows as slices of row buffers (rowbuffers.py), best_fit rows
from their chunks' best-fit layouts, a later segment's padded carry rows from its carry blocks.
The chunks themselves, verified at each copy, are opened.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenfeed.client import wire
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.errors import BadRecordError, JobFailedError, SourceError
from tokenfeed.server.pack import bestfit, packing, rowlayout
from tokenfeed.server.pack.opened import DatasetChunks, OpenedChunks
from tokenfeed.server.pack.rowbuffers import BUFFERS_MAX, RowBuffers, _dataset, _segment
from tokenfeed.server.pack.sharedrows import SharedRows
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.planner import RowPlan

if TYPE_CHECKING:
    from tokenfeed.server.settings.config import JobSpec
    from tokenfeed.server.store.tokstore import TokenStore
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer

__all__ = ["Assembler", "DatasetChunks", "GroupRows"]


@dataclass(frozen=True)
class GroupRows:
    """A group's concat batches, one after another, their rows not yet copied (`sources`, in
    the wire's `dtype`), with the document starts and row splits of the wire's form."""

    sources: rowlayout.RowSources
    starts: np.ndarray
    row_splits: np.ndarray
    dtype: np.dtype
    padding: None = None  # concat rows are never padded

    @property
    def rows(self) -> int:
        return len(self.sources.which)

    @property
    def seq_len(self) -> int:
        return self.sources.span - 1

    def compact(self) -> wire.Compact:
        """The rows copied: the same batch as a compact one."""
        return wire.Compact(self.sources.copy(self.dtype), self.starts, self.row_splits, None)


class Assembler:
    def __init__(
        self,
        spec: JobSpec,
        indexes: Sequence[DatasetChunks],
        store: TokenStore,
        fail: Callable[[str], None],
        stream_cache_bytes: int,
        tail: Callable[[int, int, int, int], order.Pieces],
        carry: Callable[[int, int, int], tuple[order.Pieces, list[int]]],
        shared: SharedRows | None = None,
        identity: Callable[[], str] = str,
    ):
        self.spec, self.indexes, self.store, self._fail = spec, indexes, store, fail
        self.tokenizer: TextTokenizer | None = None  # set once the job's tokenizer is loaded
        get = self._loaded
        self.opened = OpenedChunks(spec, indexes, store, get, stream_cache_bytes, BUFFERS_MAX)
        self.rows = RowBuffers(
            self.opened,
            get,
            lambda: self.wire_dtype,
            stream_cache_bytes,
            tail,
            carry,
            shared,
            identity,
        )
        self.chunk, self.stream = self.opened.chunk, self.opened.stream
        self.bestfit_tokens, self.bestfit_layout = (
            self.opened.bestfit_tokens,
            self.opened.bestfit_layout,
        )
        self.forget_gone, self.row_buffer = self.opened.forget_gone, self.rows.row_buffer
        self.let_go = self.rows.let_go

    @property
    def buffers(self) -> LRU[tuple[Any, int, int], rowlayout.RowBuffer]:
        """The row buffers kept (rowbuffers.py)."""
        return self.rows.buffers

    @buffers.setter
    def buffers(self, lru: LRU[tuple[Any, int, int], rowlayout.RowBuffer]) -> None:
        self.rows.buffers = lru

    @property
    def tokens(self) -> LRU[tuple[int, int], np.ndarray]:
        """best_fit's verified copies of chunks' tokens (opened.py)."""
        return self.opened.tokens

    @tokens.setter
    def tokens(self, lru: LRU[tuple[int, int], np.ndarray]) -> None:
        self.opened.tokens = lru

    def _loaded(self) -> TextTokenizer:
        return self.loaded_tokenizer

    @property
    def wire_dtype(self) -> np.dtype:
        return wire.token_dtype(self.loaded_tokenizer.vocab_size)

    @property
    def loaded_tokenizer(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("the job's tokenizer is not loaded")
        return self.tokenizer

    # ---------------------------------------------------------------- chunks of a plan

    def chunk_keys(self, plan: RowPlan) -> list[tuple[str, str]]:
        """The cache entries of the chunks a plan's rows start in, to pin while it is served
        (the chunks of a row buffer's tail are pinned while the buffer is made)."""
        needed = {(_dataset(key), c) for key, e, c, _ in plan.buffers if e >= 0}
        return [("chunk", self.indexes[d].keys[c]) for d, c in needed]

    def pinned(self, plan: RowPlan):
        return self.store.cache.pinned(self.chunk_keys(plan))

    async def open_chunks(self, plan: RowPlan, executor: Executor) -> None:
        """Open (verify, or rebuild) in a worker thread the chunks a plan needs. Row buffers
        are laid out in one task, from the last position of an epoch to the first: a buffer's
        tail is then cut from the next buffer, laid out just before (bench/, wire section); on
        the event loop while they can be (`lay_out_here`), the rest in that thread; in a
        serving worker, from a place of its own in that order (`SharedRows.turn`)."""
        missing: list[Callable[[], object]] = []
        # Row buffers (concat rows and carry rows) are laid out in the epoch's order, with
        # their tails; best_fit rows read their chunks' tokens.
        keys = sorted(
            {k for k in _buffers(plan, bestfit=False) if not self.buffers.contains(k[:3])},
            key=lambda k: (_dataset(k[0]), _segment(k[0]), k[1], k[3]),
            reverse=True,
        )
        shared = self.rows.shared
        if len(keys) > 1 and shared is not None:
            # The node's serving processes read the same steps at the same time: each starts at
            # its own place in the list (and goes round), so they lay out different buffers at
            # once and map each other's, instead of all waiting on one writer after another.
            turn = shared.turn % len(keys)
            keys = keys[turn:] + keys[:turn]
        keys = await self.lay_out_here(keys)
        if keys:
            missing.append(partial(self.rows.lay_out_all, keys))
        chunks = {
            (_dataset(key), c)
            for key, _, c, _ in _buffers(plan, bestfit=True)
            if not self.tokens.contains((_dataset(key), c))
        }
        missing += [partial(self.bestfit_tokens, d, c) for d, c in chunks]
        if missing:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.gather(*(loop.run_in_executor(executor, make) for make in missing))
            except (SourceError, BadRecordError) as e:
                self._fail(str(e))
                raise JobFailedError(str(e)) from e

    async def lay_out_here(self, keys: list[tuple[Any, int, int, int]]) -> list:
        """Lay out row buffers `keys` in order on the event loop while each can be
        (`RowBuffers.lay_out_here`: small, its chunks mapped), letting the loop's other tasks
        run after each; the keys from the first that cannot, left to a thread."""
        for i, key in enumerate(keys):
            if not self.rows.lay_out_here(*key):
                return keys[i:]
            await asyncio.sleep(0)
        return []

    # ---------------------------------------------------------------- batches

    def assemble(self, plan: RowPlan) -> tuple[int, wire.Compact]:
        """(epoch of the first row, the compact batch) of a plan: token ids in the wire's
        dtype and document starts (docs/batch-format.md)."""
        first_epoch = 0
        for part in plan.parts:
            hit = np.nonzero(part.slots == 0)[0]
            if hit.size:
                first_epoch = int(part.epochs[hit[0]])
        return first_epoch, self._compact(plan)

    def _compact(self, plan: RowPlan) -> wire.Compact:
        kinds = {p.packing for p in plan.parts}
        if kinds == {"best_fit"}:
            return wire.compact_from_tensors(self._assemble_bestfit(plan), self.wire_dtype)
        if kinds == {"concat"}:
            ids, starts, splits = rowlayout.assemble_rows(
                plan.rows,
                plan.seq_len,
                [(p.key, p.slots, p.starts) for p in plan.parts],
                self.row_buffer,
                self.wire_dtype,
            )
            pdtype = wire.position_dtype(plan.seq_len)
            return wire.Compact(ids, starts.astype(pdtype), splits, None)
        # A phase that changed the packing: padded carry rows beside concat or best_fit rows.
        return wire.compact_from_tensors(self._assemble_mixed(plan), self.wire_dtype)

    def _assemble_mixed(self, plan: RowPlan) -> dict[str, np.ndarray]:
        L, eos = plan.seq_len, self.loaded_tokenizer.eos_id
        out = {name: np.empty((plan.rows, L), dtype=np.int32) for name in packing.TENSOR_NAMES}
        bestfit_parts = [p for p in plan.parts if p.packing == "best_fit"]
        if bestfit_parts:
            self._bestfit_into(out, bestfit_parts, L)
        for part in plan.parts:
            if part.packing == "best_fit":
                continue
            n = len(part.slots)
            if part.packing == "concat":
                ids, starts, splits = rowlayout.assemble_rows(
                    n, L, [(part.key, np.arange(n), part.starts)], self.row_buffer, np.int32
                )
                mask = np.zeros(ids.shape, dtype=bool)
                mask[np.repeat(np.arange(n), np.diff(splits)), starts] = True
                rows = packing.concat_tensors(ids, mask, L)
            else:  # padded: slices of carry blocks, the last one ending early
                s = part.starts
                buffers = [
                    self.row_buffer(part.key, int(e), int(c), int(q))
                    for e, c, q in zip(s.epoch, s.chunk, s.position, strict=True)
                ]
                rows = rowlayout.padded_rows(buffers, s.lo, L, eos)
            for name, arr in rows.items():
                out[name][part.slots] = arr
        return out

    def assemble_group(self, plan: RowPlan, steps: int) -> tuple[list[int], wire.Compact]:
        """(epoch of each step's first row, the steps' batches as one compact batch, one after
        another): a plan of several steps assembled in one pass (`group`, its rows copied)."""
        epochs, whole = self.group(plan, steps)
        return epochs, whole.compact() if isinstance(whole, GroupRows) else whole

    def group(self, plan: RowPlan, steps: int) -> tuple[list[int], wire.Compact | GroupRows]:
        """`assemble_group`, left for a stream to serialize its batches from
        (serve/batchmsg.group_messages): concat rows not yet copied (`GroupRows`: each row is
        copied once, into its batch's message), other rows as a compact batch."""
        if {p.packing for p in plan.parts} == {"concat"}:
            sources, starts, splits = rowlayout.row_sources(
                plan.rows,
                plan.seq_len,
                [(p.key, p.slots, p.starts) for p in plan.parts],
                self.row_buffer,
            )
            dtype = self.wire_dtype
            pdtype = wire.position_dtype(plan.seq_len)
            whole = GroupRows(sources, starts.astype(pdtype), splits, dtype)
            if all(a.dtype == dtype for a in sources.ids):  # row buffers are in it
                return self._epochs(plan, steps), whole
            return self._epochs(plan, steps), whole.compact()  # converted as it is copied
        if steps == 1:
            epoch, compact = self.assemble(plan)
            return [epoch], compact
        return self._epochs(plan, steps), self._compact(plan)

    @staticmethod
    def _epochs(plan: RowPlan, steps: int) -> list[int]:
        """The epoch of each step's first row (of a plan of `steps` steps)."""
        per_step = plan.rows // steps
        epochs = np.zeros(steps, dtype=np.int64)
        for part in plan.parts:
            first = part.slots % per_step == 0
            epochs[part.slots[first] // per_step] = part.epochs[first]
        return epochs.tolist()

    def _assemble_bestfit(self, plan: RowPlan) -> dict[str, np.ndarray]:
        out = {
            name: np.empty((plan.rows, plan.seq_len), dtype=np.int32)
            for name in packing.TENSOR_NAMES
        }
        self._bestfit_into(out, plan.parts, plan.seq_len)
        return out

    def _bestfit_into(self, out: dict[str, np.ndarray], parts: Sequence[Any], L: int) -> None:
        """Best-fit rows of `parts` (at seq_len L) into their slots of `out`."""
        t = self.loaded_tokenizer
        for part in parts:
            pc = part.starts  # a best_fit unit is a row: `lo` is the row within its chunk
            for c in dict.fromkeys(pc.chunk.tolist()):
                sel = pc.chunk == c
                chunk, layout = self.chunk(part.dataset, c), self.bestfit_layout(part.dataset, c, L)
                tokens = self.bestfit_tokens(part.dataset, c)
                rows = bestfit.bestfit_rows_at(
                    layout,
                    chunk.doc_offsets,
                    tokens,
                    pc.lo[sel],
                    L,
                    t.bos_id,
                    t.eos_id,
                    t.eos_id,
                )
                for name, arr in rows.items():  # padding slots hold EOS, masked by loss_mask
                    out[name][part.slots[sel]] = arr


def _buffers(plan: RowPlan, bestfit: bool) -> set[tuple[Any, int, int, int]]:
    """(dataset key, epoch, chunk, position) of the chunks (or carry blocks) a plan's rows start
    in: those of its best_fit rows, or those of the others (row buffers)."""
    if all((p.packing == "best_fit") == bestfit for p in plan.parts):
        return set(plan.buffers)
    out: set[tuple[Any, int, int, int]] = set()
    for p in plan.parts:
        if (p.packing == "best_fit") == bestfit:
            s = p.starts
            cols = (s.epoch.tolist(), s.chunk.tolist(), s.position.tolist())
            out.update((p.key, e, c, q) for e, c, q in zip(*cols, strict=True))
    return out
