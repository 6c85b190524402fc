"""Row buffers shared by the serving processes of one node (`server.workers` > 1).

The ranks of a job spread over every worker (the kernel spreads connections) and each rank's
rows over every chunk of a window, so without sharing each worker would lay out every chunk's
row buffer of every epoch itself: N workers, N times the layout work for the same tokens
(bench/results/cores16-serving.txt measured it). Here the first process that needs a buffer lays
it out straight into a slot of the node's arena (arenawrite.py); it and the others read it
there, in place. Row buffers are memory (`server.stream_cache_bytes`), not the disk cache: the
arena is not under `server.cache_bytes`, and the supervisor removes its directory when it starts
and stops.

The arena is one file in the node's shared memory (`/dev/shm`, else the temporary directory:
`node_dir`) of at most `stream_cache_bytes` (and half of the file system), mapped once by every
process: its pages stay mapped, so a buffer costs its writer its layout (no copy: the layout's
range copies write the slot; a carry block, or a chunk of documents too short to copy whole, is
laid out in memory and copied in) and its readers a check (a file per buffer cost far more:
CHANGELOG, Serving). It is SEGMENTS segments filled in turn, a ring: a writer appends to the
current segment and, when it is full, starts the next one that no process reads from, whose
generation it bumps (the entries of the one before are stale). A process reading buffers of a
segment holds a shared record lock on it (`F_OFD_SETLK`) while any array of those buffers lives
(a finalizer lets it go), so no segment is rewritten under a reader; a writer that finds every
other segment read from lays its buffer out in its own memory (`unshared`). A process, the
buffers it wrote included, holds at most a quarter of the arena in place (`in_place_budget`;
past it a buffer is copied out), and lets go of what it holds in the segments the ring writes
next, as the ring moves and every second, idle or not (`RowBuffers.let_go`); the supervisor lays
out at most half the arena ahead (jobs/layahead.py): the ring keeps a segment to write
(CHANGELOG).

A buffer's slot holds its stamp, its name's digest, its sizes and the xxh3-128 of its payload,
which the node's first reader checks and marks checked in the slot; the node's later readers
trust the mark (a slot is not written again until its segment is renewed, under a new stamp), so
a buffer is hashed once per node, not once per worker (every worker takes every buffer its ranks
read). A small entry file under the buffer's name says where its slot is. A stale entry, or a
slot that fails its check, is removed and the buffer laid out again. A buffer's bytes are
decided by its name: the plan's fingerprint at its version (which covers the job's fixed parts,
its phases and its datasets' content), the dataset and segment, the epoch and the chunk, so any
process would write the same bytes.

One process lays a buffer out while the others wait for it: it holds an exclusive `flock` on the
buffer's lock file, which the kernel lets go when the process ends however it ends; a waiter
tries the lock from 50 us, doubling to 1 ms, so it reads the buffer about a millisecond after
its writing; on the event loop a process does not wait (`get_or_make_now`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
from tokenfeed.server.pack.arenaformat import (
    ARENA,
    ARENA_MAGIC,
    CHECKED,
    CHECKED_AT,
    DATA_START,
    ENTRY,
    ENTRY_MAGIC,
    GENERATIONS,
    SEGMENTS,
    SLOT,
    SLOT_HEADER,
    SLOT_MAGIC,
    align8,
    name_digest,
    slot_arrays,
    slot_digest,
)
from tokenfeed.server.pack.arenalocks import Flocked, Pins
from tokenfeed.server.pack.arenawrite import ArenaWriting, Maker, unlink
from tokenfeed.server.pack.rowlayout import RowBuffer
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

RENEWED_NEXT = 3  # the segments after the current one that readers let go of (`next_renewed`)
WAIT_SECONDS = 10.0  # the longest a process waits for another's layout before its own
# A waiter tries the writer's lock after POLL_FIRST seconds, then twice as long up to POLL_MOST.
POLL_FIRST, POLL_MOST = 50e-6, 1e-3


class SharedRows(ArenaWriting):
    """Row buffers in the arena under `root`, at most `budget` bytes of them (and at most half
    of the file system's size: /dev/shm is often small in a container)."""

    def __init__(self, root: str | Path, budget: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        self.made = 0  # buffers this process laid out and wrote
        self.mapped = 0  # buffers this process took from another's layout
        # Where this process starts in a plan's list of missing buffers (assembly.open_chunks):
        # a place of its own, so the node's processes lay out different buffers at once.
        self.turn = os.getpid()
        self._alloc = threading.Lock()  # this process's writers, one at a time
        path = self.root / "arena"
        # Two open file descriptions: a writer's exclusive lock must meet this process's own
        # readers' shared locks (locks of one description never conflict with each other).
        self._read_fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        self._write_fd = os.open(path, os.O_RDWR)
        with Flocked(self._read_fd):
            size = os.fstat(self._read_fd).st_size
            if size < DATA_START:  # the first process here sizes it
                st = os.statvfs(self.root)
                size = min(budget, st.f_blocks * st.f_frsize // 2)
                segment = max((size - DATA_START) // SEGMENTS // DATA_START * DATA_START, 0)
                size = DATA_START + SEGMENTS * segment
                os.ftruncate(self._read_fd, size)
                os.pwrite(self._read_fd, ARENA.pack(ARENA_MAGIC, size, segment, 0, 0, 0), 0)
            head = os.pread(self._read_fd, ARENA.size, 0)
        magic, self.budget, self.segment_bytes = ARENA.unpack(head)[:3]
        if magic != ARENA_MAGIC or self.budget != size:
            raise OSError(errno.EINVAL, f"{path} is not a row-buffer arena of this version")
        self._map = mmap.mmap(self._read_fd, size)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._gens = np.frombuffer(self._map, np.uint64, SEGMENTS, GENERATIONS)
        self._pins = Pins(self._read_fd, DATA_START, self.segment_bytes)

    @property
    def in_place_budget(self) -> int:
        """The most bytes of buffers a process reads in place (holding their segments; past
        it, a buffer is copied out): a quarter of the arena, as the module's docstring says."""
        return self.budget // 4

    def next_renewed(self) -> frozenset[int]:
        """The RENEWED_NEXT segments the ring writes after the current one (its oldest)."""
        cur = ARENA.unpack_from(self._map, 0)[3]
        return frozenset((cur + i) % SEGMENTS for i in range(1, RENEWED_NEXT + 1))

    def segment_of(self, array: np.ndarray) -> int | None:
        """The segment an array read in place lies in (None: not in this arena)."""
        at = array.__array_interface__["data"][0] - self._address - DATA_START
        return at // self.segment_bytes if 0 <= at < SEGMENTS * self.segment_bytes else None

    def in_place_bytes(self) -> int:
        """The bytes of buffers this process holds in place now (arrays of them live)."""
        self._pins.drain()
        return self._pins.in_place

    def get_or_make(self, name: str, make: Maker, dtype: np.dtype) -> RowBuffer:
        """The buffer `name` (a relative path): taken from the arena, or laid out by `make` in
        this process (and written for the others) when the arena does not hold it; where
        another process is laying it out, taken once that one has written it. `make` is
        called with `place`: a slot of the arena to lay the buffer out in (`_make`), or None
        where it is laid out for this process alone."""
        found = self._get_or_make(name, make, dtype, wait=True)
        if found is None:
            raise RuntimeError(f"row buffer {name}: neither read nor laid out")
        return found

    def get_or_make_now(
        self, name: str, make: Maker, dtype: np.dtype, looked: bool = False
    ) -> RowBuffer | None:
        """`get_or_make` without waiting (the event loop): None where another process is
        laying the buffer out. `looked`: the caller has just found no entry (`read`), so the
        entry is read only once the writer's lock is held."""
        return self._get_or_make(name, make, dtype, wait=False, looked=looked)

    def read(self, name: str, dtype: np.dtype) -> RowBuffer | None:
        """The buffer `name` where the arena holds it (never waits, never lays out)."""
        return self._read(os.path.join(self._root, name), name, dtype)

    def _get_or_make(
        self,
        name: str,
        make: Maker,
        dtype: np.dtype,
        wait: bool,
        looked: bool = False,
    ) -> RowBuffer | None:
        path = self.root / name
        found = None if looked else self._read(str(path), name, dtype)
        if found is not None:
            return found
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name + ".lock")
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            if not wait and not _locked(fd, 0.0):
                return None
            if wait and not _locked(fd, time.monotonic() + WAIT_SECONDS):
                # A writer slower than WAIT_SECONDS: lay it out here, write nothing.
                metrics.ROW_BUFFERS.labels("unshared").inc()
                return make(place=None)
            found = self._read(str(path), name, dtype)  # written by the lock's holder first
            if found is not None:
                return found
            buf, written = self._make(path, name, make, dtype)
            self.made += written
            metrics.ROW_BUFFERS.labels("laid_out" if written else "unshared").inc()
            # The lock file goes before the lock: a process that opens the name later makes a
            # new one, and finds the buffer's entry first anyway. A process holding the old
            # one's descriptor takes its lock next and reads the buffer.
            unlink(lock)
            return buf
        finally:
            os.close(fd)  # lets go of the lock

    # ---------------------------------------------------------------- reading

    def _read(self, path: str, name: str, dtype: np.dtype) -> RowBuffer | None:
        """The buffer of the entry at `path`, in place in the arena (read-only arrays that hold
        its segment while they live); None where there is no entry, or where its segment was
        rewritten since or its slot fails the check (the entry is removed)."""
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                raw = os.read(fd, ENTRY.size + 1)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("row buffer %s unreadable (%s): laid out again", path, e)
            unlink(path)
            return None
        got = self._in_place(raw, name, dtype) if len(raw) == ENTRY.size else None
        if got is None:
            unlink(path)
            return None
        self.mapped += 1
        metrics.ROW_BUFFERS.labels("mapped").inc()
        return got

    def _in_place(self, raw: bytes, name: str, dtype: np.dtype) -> RowBuffer | None:
        magic, seg, gen, offset, length, stamp = ENTRY.unpack(raw)
        start = DATA_START + seg * self.segment_bytes
        if (
            magic != ENTRY_MAGIC
            or seg >= SEGMENTS
            or not start <= offset <= start + self.segment_bytes - max(length, SLOT_HEADER)
        ):
            return None
        if not self._pins.pin(seg):
            return None  # a writer is starting the segment anew
        held = False
        try:
            if int(self._gens[seg]) != gen:
                return None  # rewritten since the entry was written
            head = SLOT.unpack_from(self._map, offset)
            slot_magic, slot_stamp, named, n_ids, n_starts, itemsize, digest = head
            starts_at = SLOT_HEADER + align8(n_ids * itemsize)
            if (
                slot_magic != SLOT_MAGIC
                or slot_stamp != stamp
                or named != name_digest(name)
                or itemsize != dtype.itemsize
                or starts_at + n_starts * 8 > length
            ):
                return None
            ids, starts = slot_arrays(self._view[offset : offset + length], n_ids, n_starts, dtype)
            if CHECKED.unpack_from(self._map, offset + CHECKED_AT)[0] != stamp:
                if slot_digest(ids, starts) != digest:
                    log.warning("row buffer %s fails its check: laid out again", name)
                    return None
                CHECKED.pack_into(self._map, offset + CHECKED_AT, stamp)
            held = True  # from here `_kept` holds the pin or lets it go
            return self._kept(ids, starts, seg, offset, length, keep=True)
        finally:
            if not held:
                self._pins.unpin(seg)


def _locked(fd: int, deadline: float) -> bool:
    """Whether this process took the exclusive lock of `fd` before `deadline` (monotonic)."""
    pause = POLL_FIRST
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, POLL_MOST)
