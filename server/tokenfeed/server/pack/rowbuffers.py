"""Row buffers: under concat each (dataset, epoch, chunk) stream is laid out once in the epoch's
order of the chunk's documents, followed by the units its last row reads past the chunk's end
(its tail), so every row is one slice copy of the buffer of the chunk it starts in; a carry block
(the carry of a later segment, planner.carry_block) is laid out the same way. Kept in
`server.stream_cache_bytes`, laid out by one thread at a time, and in a serving worker shared
with the node's other processes (sharedrows.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenfeed.server.diskcache.lru import LRU
from tokenfeed.server.pack import rowlayout
from tokenfeed.server.pack.arenalocks import held_in_place
from tokenfeed.server.pack.opened import NotMapped, OpenedChunks
from tokenfeed.server.pack.sharedrows import SharedRows
from tokenfeed.server.sampling import order

if TYPE_CHECKING:
    from tokenfeed.server.tokenizer.tokenize import TextTokenizer

BUFFERS_MAX = 1 << 20  # row buffers kept at most, whatever their bytes: about 100 MB of keys
# Row buffers of chunks of at most this many tokens are laid out on the event loop where their
# chunks are mapped (`lay_out_here`): about a millisecond each, between two of the loop's other
# tasks. In a thread, each of a layout's hundred-odd small numpy steps let go of the GIL and
# waited to get it back behind the serving thread: on 2 cores a [32, 4096] stream's layouts took
# 0.67 ms of CPU each there against 0.4 ms on the loop, and the stream ran about a fifth slower
# (bench/, wire section). A larger chunk's buffer goes to a thread: its fixed costs are spread
# over more tokens, and its copy (the GIL let go) overlaps serving.
LOOP_TOKENS = 1 << 20


class RowBuffers:
    def __init__(
        self,
        opened: OpenedChunks,
        tokenizer: Callable[[], TextTokenizer],
        wire_dtype: Callable[[], np.dtype],
        stream_cache_bytes: int,
        tail: Callable[[int, int, int, int], order.Pieces],
        carry: Callable[[int, int, int], tuple[order.Pieces, list[int]]],
        shared: SharedRows | None = None,
        identity: Callable[[], str] = str,
    ):
        self.opened, self._tokenizer, self._wire_dtype = opened, tokenizer, wire_dtype
        self.indexes, self.store = opened.indexes, opened.store
        # In a serving worker: row buffers laid out once for every process of the node, named
        # by `identity` (what decides their bytes; empty: not shared yet), sharedrows.py.
        self.shared, self._identity = shared, identity
        # (dataset, epoch, position, segment) -> what a row buffer holds past its chunk
        self._tail = tail
        # (dataset, segment, block) -> the pieces of a segment's carry block, and its joins
        self._carry = carry
        # Row buffers per (dataset, epoch, chunk) in this much memory: a row is then one slice
        # copy (bench/, wire section). Bounded by bytes, not by count: a corpus of 20,000
        # chunks of 1 KB has as many small buffers an epoch, and a cap of 4096 laid them out
        # again on every read (bench/, scale).
        self.buffers: LRU[tuple[Any, int, int], rowlayout.RowBuffer] = LRU(
            BUFFERS_MAX, stream_cache_bytes
        )
        # Row buffers being laid out, by key: a buffer is laid out once for every stream and
        # rank that needs it (the others wait for it), never once per thread that missed it.
        self._making: dict[tuple[Any, int, int], threading.Event] = {}
        self._making_lock = threading.Lock()
        self._renewed: frozenset[int] = frozenset()  # the ring's next segments, last looked at

    def lay_out_all(self, keys: list[tuple[Any, int, int, int]]) -> None:
        for key in keys:
            self.row_buffer(*key)

    def row_buffer(
        self, key: int | tuple[int, int], epoch: int, c: int, position: int
    ) -> rowlayout.RowBuffer:
        """Chunk c's row buffer in `epoch` (it is at `position` of the epoch's order): its
        concat stream and its tail, in the wire's dtype. `key` is the dataset, or (dataset,
        segment) for a later segment's rows (another tail); epoch -1 names a carry block. Laid
        out by one thread at a time: another that needs it meanwhile waits for it."""
        if epoch < 0:
            return self._once((key, -1, c), partial(self._lay_carry, key, c))
        return self._once((key, epoch, c), partial(self._lay_out, key, epoch, c, position))

    def _once(
        self, key: tuple[Any, int, int], make: Callable[[], rowlayout.RowBuffer]
    ) -> rowlayout.RowBuffer:
        """The row buffer `key`, made by `make` in this thread unless another thread is making
        it (then this one waits for it, and makes it itself if that one failed); in a serving
        worker, mapped from another process's layout where there is one."""
        shared = self.shared
        if shared is not None and (identity := self._identity()):
            name, laid_out = self._file_name(identity, key), make

            def make() -> rowlayout.RowBuffer:
                return shared.get_or_make(name, laid_out, self._wire_dtype())

        while True:
            found = self.buffers.get(key)
            if found is not None:
                return found
            with self._making_lock:
                making = self._making.get(key)
                if making is None:
                    making = self._making[key] = threading.Event()
                    break
            making.wait()
        try:
            return self.buffers.get_or_make(key, make)
        finally:
            with self._making_lock:
                del self._making[key]
            making.set()
            self.let_go()

    @staticmethod
    def _file_name(identity: str, key: tuple[Any, int, int]) -> str:
        """A row buffer's file among the node's shared ones (sharedrows.py)."""
        dkey, epoch, c = key
        return f"{identity}/{_dataset(dkey)}-{_segment(dkey)}-{epoch}-{c}"

    def lay_out_here(self, key: int | tuple[int, int], epoch: int, c: int, position: int) -> bool:
        """Lay out a row buffer (`row_buffer`'s arguments) on the calling thread, the event
        loop, where nothing can block it: a buffer of at most LOOP_TOKENS tokens whose chunks
        (its own, and those its tail reads that are not laid out) are mapped and verified here,
        that no thread here is making and, in a serving worker, that no other process of the
        node is writing (its file is mapped, or laid out and written here); whether it is laid
        out (or already was). Else nothing is done and the caller hands it to a thread."""
        d = _dataset(key)
        if epoch < 0 or self.indexes[d].num_tokens[c] > LOOP_TOKENS:
            return False
        name = (key, epoch, c)
        if self.buffers.contains(name):
            return True
        shared = self.shared
        identity = self._identity() if shared is not None else ""
        file = self._file_name(identity, name) if identity else ""
        if file and self._map_here(name, file):
            return True
        if not self.opened.mapped(d, c):
            return False
        tail = self._tail(d, epoch, position, _segment(key))
        for e, k in zip(tail.epoch.tolist(), tail.chunk.tolist(), strict=True):
            if self.buffers.peek((d, e, k)) is None and not self.opened.mapped(d, k):
                return False
        with self._making_lock:
            if name in self._making:  # a thread is making it: that thread's to finish
                return False
            making = self._making[name] = threading.Event()
        make: Callable[[], rowlayout.RowBuffer] = partial(
            self._lay_out, key, epoch, c, position, True
        )
        if shared is not None and file:
            laid_out = make

            def make() -> rowlayout.RowBuffer:
                # `_map_here` has just found no entry: read again only under the lock.
                found = shared.get_or_make_now(file, laid_out, self._wire_dtype(), looked=True)
                if found is None:  # another process is laying it out: a thread waits for it
                    raise NotMapped(file)
                return found

        try:
            self.buffers.get_or_make(name, make)
        except NotMapped:  # damaged or evicted since the look, or being laid out elsewhere
            return False
        finally:
            with self._making_lock:
                del self._making[name]
            making.set()
            self.let_go()
        return True

    def _map_here(self, name: tuple[Any, int, int], file: str) -> bool:
        """Take row buffer `name` from the node's arena when another process has laid it out
        there (no chunk of it need be mapped here, no tail worked out): whether it was. Every
        worker takes every buffer its ranks read, so this is what a buffer costs each of the
        others: an entry read and a lock (the node's first reader checks the slot; CHANGELOG,
        Serving workers)."""
        shared = self.shared
        assert shared is not None
        with self._making_lock:
            if name in self._making:  # a thread is making (or taking) it
                return False
            making = self._making[name] = threading.Event()
        try:
            found = shared.read(file, self._wire_dtype())
            if found is not None:
                self.buffers.get_or_make(name, lambda: found)
        finally:
            with self._making_lock:
                del self._making[name]
            making.set()
        if found is not None:
            self.let_go()
        return found is not None

    def let_go(self, every: bool = False) -> None:
        """In a serving worker (or its supervisor), let go of row buffers read in place in the
        node's arena, so that its ring always has a segment to write: those in the segments it
        writes next (`SharedRows.next_renewed`: its oldest, of windows already read), looked
        for whenever the ring has moved on and, with `every` (once a second), whatever this
        process does; and once it holds more than three quarters of its share
        (`SharedRows.in_place_budget`), its oldest ones until it holds half. A process that
        holds its old buffers, idle or not, otherwise keeps the writer from their segments,
        and the node's processes lay out every later buffer each for itself (`unshared`;
        CHANGELOG). A buffer let go that is read again is taken from the arena again while it
        is there, or laid out anew."""
        shared = self.shared
        if shared is None:
            return
        over = shared.in_place_bytes() > shared.in_place_budget * 3 // 4
        renewed = shared.next_renewed()
        if not over and not every and renewed == self._renewed:
            return
        self._renewed, keep = renewed, shared.in_place_budget // 2
        for key in self.buffers.keys():  # oldest first
            buf = self.buffers.peek(key)
            if buf is None or not held_in_place(buf.ids):
                continue
            if shared.segment_of(buf.ids) in renewed:
                self.buffers.discard(key)
            elif over and shared.in_place_bytes() > keep:
                self.buffers.discard(key)

    def _lay_out(
        self,
        key: int | tuple[int, int],
        epoch: int,
        c: int,
        position: int,
        here: bool = False,
        place: rowlayout.Place | None = None,
    ) -> rowlayout.RowBuffer:
        """Chunk c's row buffer in `epoch`, laid out here: into the node's arena where
        `place` offers a slot (a serving worker's, or its supervisor's), else in memory."""
        d, segment = (key, 0) if isinstance(key, int) else key
        t = self._tokenizer()
        tail = self._laid(d, self._tail(d, epoch, position, segment), here)
        tokens = self.opened.verified(d, c, here).tokens  # before stream: that maps it
        return rowlayout.row_buffer(
            self.opened.stream(d, epoch, c),
            tokens,
            tail,
            t.bos_id,
            t.eos_id,
            self._wire_dtype(),
            place,
        )

    def _lay_carry(
        self, key: int | tuple[int, int], block: int, place: rowlayout.Place | None = None
    ) -> rowlayout.RowBuffer:
        """A carry block of a segment (planner.carry_block) laid out: its pieces copied from
        verified chunks, one after another, a document segment starting at each join. Always
        in memory (`place` unused): the arena copies it in."""
        if isinstance(key, int):
            raise ValueError("a dataset's first segment has no carry")
        d, segment = key
        pc, joins = self._carry(d, segment, block)
        laid = self._laid(d, pc)
        ids = np.concatenate([b.ids for b in laid]) if laid else np.zeros(0, self._wire_dtype())
        at = np.cumsum([0] + [len(b.ids) for b in laid[:-1]])
        found = [b.starts + a for b, a in zip(laid, at.tolist(), strict=True)]
        starts = np.union1d(np.concatenate([*found, np.array(joins, dtype=np.int64)]), [])
        return rowlayout.RowBuffer(ids, starts.astype(np.int64))

    def _laid(self, d: int, pc: order.Pieces, here: bool = False) -> list[rowlayout.RowBuffer]:
        """Pieces of dataset d's chunks laid out, in order (their chunks pinned meanwhile)."""
        keys = [("chunk", self.indexes[d].keys[k]) for k in set(pc.chunk.tolist())]
        cols = (pc.epoch.tolist(), pc.chunk.tolist(), pc.lo.tolist(), pc.hi.tolist())
        with self.store.cache.pinned(keys):
            return [
                self._tail_piece(d, e, k, lo, hi, here) for e, k, lo, hi in zip(*cols, strict=True)
            ]

    def _tail_piece(
        self, d: int, epoch: int, c: int, lo: int, hi: int, here: bool = False
    ) -> rowlayout.RowBuffer:
        """Stream positions [lo, hi) of chunk c in `epoch`: cut from its row buffer when that
        is laid out (copied from a verified chunk then), else copied from the chunk verified
        now. Both are the same bytes."""
        laid_out = self.buffers.peek((d, epoch, c))
        if laid_out is not None:
            return laid_out.cut(lo, hi)
        t = self._tokenizer()
        tokens = self.opened.verified(d, c, here).tokens
        return rowlayout.stream_slice(
            self.opened.stream(d, epoch, c), tokens, lo, hi, t.bos_id, t.eos_id, self._wire_dtype()
        )


def _dataset(key: int | tuple[int, int]) -> int:
    """The dataset of a row buffer's key (the dataset, or (dataset, segment))."""
    return key if isinstance(key, int) else key[0]


def _segment(key: int | tuple[int, int]) -> int:
    return 0 if isinstance(key, int) else key[1]
