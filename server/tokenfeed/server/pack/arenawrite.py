"""The writing side of the node's row-buffer arena (sharedrows.py's `SharedRows`): a buffer laid
out straight into a slot it takes (`_make`: rowlayout's `place`), or copied in where its maker
lays it out in memory (`_write`); the slot's header, check and entry file; the ring's next slot
(`_take`, starting a segment anew where no process reads from it); stale entries swept once a
round. A process that writes a buffer reads it in place afterwards, like any reader: its
segment held while its arrays live, up to the process's in-place budget."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenfeed.server.pack.arenaformat import (
    ARENA,
    CHECKED,
    CHECKED_AT,
    DATA_START,
    ENTRY,
    ENTRY_MAGIC,
    SEGMENTS,
    SLOT,
    SLOT_MAGIC,
    name_digest,
    slot_arrays,
    slot_digest,
    slot_length,
)
from tokenfeed.server.pack.arenalocks import Flocked, Pinned, Pins, range_lock
from tokenfeed.server.pack.rowlayout import RowBuffer

log = logging.getLogger("tokenfeed.server.pack.sharedrows")  # the arena's one logger

# Lays a buffer out, called with `place=`: a slot of the arena to lay it out in, or None.
Maker = Callable[..., RowBuffer]


class ArenaWriting:
    """What SharedRows writes with; its state is SharedRows'."""

    root: Path
    segment_bytes: int
    _map: mmap.mmap
    _view: np.ndarray
    _address: int
    _gens: np.ndarray
    _pins: Pins
    _alloc: threading.Lock
    _read_fd: int
    _write_fd: int

    @property
    def in_place_budget(self) -> int:
        raise NotImplementedError

    def segment_of(self, array: np.ndarray) -> int | None:
        raise NotImplementedError

    def _make(self, path: Path, name: str, make: Maker, dtype: np.dtype) -> tuple[RowBuffer, bool]:
        """The buffer laid out by `make` and written for the node (whether it was): straight
        into a slot of the arena where `make` takes the one it is offered (`place`), so its
        bytes are written once and this process reads them in place like any other; else
        laid out here and copied in (`_write`)."""
        taken: list[tuple[int, int, int, int, bool, int]] = []

        def place(n_ids: int, n_starts: int) -> tuple[np.ndarray, np.ndarray] | None:
            if taken:
                raise RuntimeError(f"row buffer {name} asked for a second slot")
            got = self._slot(n_ids, n_starts, dtype)
            if got is None:
                return None
            taken.append(got[0])
            return got[1], got[2]

        try:
            buf = make(place=place)
        except BaseException:
            if taken:  # the slot stays unnamed: no entry points at it
                self._pins.unpin(taken[0][0])
            raise
        if not taken:
            return buf, self._write(path, name, buf)
        return self._seal(path, name, buf, *taken[0])

    def _seal(
        self,
        path: Path,
        name: str,
        buf: RowBuffer,
        seg: int,
        gen: int,
        offset: int,
        stamp: int,
        renewed: bool,
        length: int,
    ) -> tuple[RowBuffer, bool]:
        """A buffer laid out in its slot (held: `_take`) made readable by the node: the slot's
        header and check, then its entry; the buffer as this process reads it (in place, its
        segment held while its arrays live, or copied out past the in-place budget)."""
        ids, starts = buf.ids, buf.starts
        if self.segment_of(ids) != seg or self.segment_of(starts) != seg:
            self._pins.unpin(seg)
            raise RuntimeError(f"row buffer {name} was not laid out in the slot it took")
        written = self._publish(path, name, ids, starts, seg, gen, offset, length, stamp)
        kept = self._kept(ids, starts, seg, offset, length, keep=written)
        if renewed and seg == 0:  # once a round of the ring: stale entries are a round's at most
            self.sweep()
        return kept, written

    def _kept(
        self, ids: np.ndarray, starts: np.ndarray, seg: int, offset: int, length: int, keep: bool
    ) -> RowBuffer:
        """The arrays of a slot this process holds (segment `seg` pinned), as it goes on
        reading them: in place while its in-place budget allows (`keep`), the pin then held
        until no view of them is left; else copied out, the pin let go."""
        if not keep or self._pins.in_place + length > self.in_place_budget:
            out = RowBuffer(ids.copy(), starts.copy())
            out.ids.flags.writeable = out.starts.flags.writeable = False
            self._pins.unpin(seg)
            return out
        pinned = Pinned(self._map, self._address + offset, length)
        weakref.finalize(pinned, self._pins.release_later, seg, length)
        self._pins.keep(length)
        # Read-only, and `pinned` lives while any view of it does.
        return RowBuffer(*slot_arrays(np.asarray(pinned), ids.size, starts.size, ids.dtype))

    def _write(self, path: Path, name: str, buf: RowBuffer) -> bool:
        """Write `buf` into the arena and its entry at `path`; False where it cannot be (larger
        than a segment, every other segment read from, a file that cannot be written): this
        process's own copy still serves."""
        ids = np.ascontiguousarray(buf.ids)
        starts = np.ascontiguousarray(buf.starts, dtype=np.int64)
        got = self._slot(ids.size, starts.size, ids.dtype)
        if got is None:
            return False
        (seg, gen, offset, stamp, renewed, length), into, into_starts = got
        try:  # the segment is held (pinned) while its slot is written
            into[:] = ids
            into_starts[:] = starts
            written = self._publish(path, name, ids, starts, seg, gen, offset, length, stamp)
        finally:
            self._pins.unpin(seg)
        if renewed and seg == 0:  # once a round of the ring: stale entries are a round's at most
            self.sweep()
        return written

    def _slot(
        self, n_ids: int, n_starts: int, dtype: np.dtype
    ) -> tuple[tuple[int, int, int, int, bool, int], np.ndarray, np.ndarray] | None:
        """A slot for a buffer of `n_ids` ids and `n_starts` starts, held (`_take`): ((segment,
        generation, offset, stamp, whether a segment was started anew, length), its ids, its
        starts), or None where it cannot be had (larger than a segment, every other segment
        read from)."""
        length = slot_length(n_ids, n_starts, dtype.itemsize)
        if length > self.segment_bytes:
            return None
        with self._alloc:
            taken = self._take(length)
        if taken is None:
            return None
        offset = taken[2]
        ids, starts = slot_arrays(self._view[offset : offset + length], n_ids, n_starts, dtype)
        return (*taken, length), ids, starts

    def _publish(
        self,
        path: Path,
        name: str,
        ids: np.ndarray,
        starts: np.ndarray,
        seg: int,
        gen: int,
        offset: int,
        length: int,
        stamp: int,
    ) -> bool:
        """A written slot's header and check, then its entry file under the buffer's name
        (written whole, renamed into place); False where the file system refuses the entry (full,
        read-only): this process's copy still serves."""
        SLOT.pack_into(
            self._map,
            offset,
            SLOT_MAGIC,
            stamp,
            name_digest(name),
            ids.size,
            starts.size,
            ids.dtype.itemsize,
            slot_digest(ids, starts),
        )
        CHECKED.pack_into(self._map, offset + CHECKED_AT, 0)  # no reader has checked it
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(ENTRY.pack(ENTRY_MAGIC, seg, gen, offset, length, stamp))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("row buffer %s not written (%s)", path, e)
            return False
        return True

    def _take(self, length: int) -> tuple[int, int, int, int, bool] | None:
        """Room for `length` bytes: in the current segment, else at the start of the next one
        that no process reads from (its generation bumped), held (pinned) for the writing:
        (segment, generation, offset, stamp, whether a segment was started anew); None where
        every other segment is read from."""
        self._pins.drain()
        with Flocked(self._read_fd):
            magic, size, segment, cur, head, stamp = ARENA.unpack_from(self._map, 0)
            renewed = head + length > segment
            if renewed:
                for step in range(1, SEGMENTS):
                    nxt = (cur + step) % SEGMENTS
                    where = (DATA_START + nxt * segment, segment)
                    if range_lock(self._write_fd, fcntl.F_WRLCK, *where):  # no one reads it
                        self._gens[nxt] += np.uint64(1)
                        range_lock(self._write_fd, fcntl.F_UNLCK, *where)
                        cur, head = nxt, 0
                        break
                else:
                    return None
            offset = DATA_START + cur * segment + head
            ARENA.pack_into(self._map, 0, magic, size, segment, cur, head + length, stamp + 1)
            if not self._pins.pin(cur):  # cannot fail: segments start anew under this lock
                return None
            return cur, int(self._gens[cur]), offset, stamp + 1, renewed

    def sweep(self) -> int:
        """Remove the entries of segments written anew since (stale); how many. Run by the
        writer that starts the first segment anew, once a round of the ring."""
        removed = 0
        for dirpath, _, names in os.walk(self.root):
            if dirpath == str(self.root):
                continue  # the arena
            for n in names:
                if n.endswith((".lock", ".tmp")):
                    continue
                p = Path(dirpath) / n
                try:
                    raw = p.read_bytes()
                except OSError:
                    continue
                if not self._current(raw):
                    unlink(p)
                    removed += 1
        return removed

    def _current(self, raw: bytes) -> bool:
        """Whether an entry is of its segment's current generation."""
        if len(raw) != ENTRY.size:
            return False
        magic, seg, gen = ENTRY.unpack(raw)[:3]
        return magic == ENTRY_MAGIC and seg < SEGMENTS and int(self._gens[seg]) == gen


def unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
