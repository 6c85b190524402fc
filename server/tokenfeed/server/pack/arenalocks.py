"""The locks of the node's row-buffer arena (sharedrows.py): record locks on its segments'
bytes, held by an open file description (`F_OFD_SETLK`: shared by a process's readers,
exclusive for a writer that starts a segment anew; the kernel lets them go with the process);
the segments a process reads from, counted (`Pins`); a slot as an array's memory that holds its
segment while any view of it lives (`Pinned`); and the arena's allocation lock (`Flocked`)."""

from __future__ import annotations

import collections
import errno
import fcntl
import mmap
import os
import struct
import threading

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (x86-64 and aarch64 Linux)


class Pins:
    """The segments this process reads from, each held by a shared record lock (on `fd`)
    while any array of its buffers lives: counted here, locked once; and the bytes of the
    buffers it reads in place (`in_place`)."""

    def __init__(self, fd: int, first: int, segment_bytes: int):
        self._fd, self._first, self._segment = fd, first, segment_bytes
        self._count: dict[int, int] = {}
        self.in_place = 0  # bytes of buffers whose arrays hold their segments
        self._lock = threading.Lock()
        # Segments whose arrays died: a finalizer may run in any thread, in the middle of this
        # object's work (a garbage collection), so it only queues; the next pin or write lets go.
        self._released: collections.deque[tuple[int, int]] = collections.deque()

    def pin(self, seg: int) -> bool:
        """Hold segment `seg`; False where a writer is starting it anew right now."""
        with self._lock:
            self._drain()
            n = self._count.get(seg, 0)
            if n == 0 and not range_lock(self._fd, fcntl.F_RDLCK, *self._range(seg)):
                return False
            self._count[seg] = n + 1
            return True

    def unpin(self, seg: int) -> None:
        with self._lock:
            self._drop(seg)

    def keep(self, length: int) -> None:
        """A pinned segment's buffer of `length` bytes is read in place: its arrays hold it
        (`release_later` once none is left)."""
        with self._lock:
            self.in_place += length

    def release_later(self, seg: int, length: int) -> None:
        self._released.append((seg, length))

    def drain(self) -> None:
        with self._lock:
            self._drain()

    def held(self) -> dict[int, int]:
        with self._lock:
            self._drain()
            return dict(self._count)

    def _drain(self) -> None:
        while self._released:
            seg, length = self._released.popleft()
            self.in_place -= length
            self._drop(seg)

    def _drop(self, seg: int) -> None:
        n = self._count[seg] - 1
        if n:
            self._count[seg] = n
            return
        del self._count[seg]
        range_lock(self._fd, fcntl.F_UNLCK, *self._range(seg))

    def _range(self, seg: int) -> tuple[int, int]:
        return self._first + seg * self._segment, self._segment


class Pinned:
    """A slot of the arena as an array's memory (read-only): every view of it keeps this alive,
    and its finalizer lets go of the slot's segment once none is left."""

    __slots__ = ("__array_interface__", "__weakref__", "_arena")

    def __init__(self, arena: mmap.mmap, address: int, length: int):
        self._arena = arena  # mapped while a view of it lives, whoever else lets go of it
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (length,),
            "typestr": "|u1",
            "version": 3,
        }


def held_in_place(array: object) -> bool:
    """Whether an array's memory is a slot of the arena (a `Pinned`, which holds its
    segment), through however many views."""
    base = getattr(array, "base", None)
    while base is not None and not isinstance(base, Pinned):
        base = getattr(base, "base", None)
    return base is not None


class Flocked:
    """The arena's allocation lock (`flock` on the arena file) while in a `with`."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def range_lock(fd: int, kind: int, offset: int, length: int) -> bool:
    """Take (F_RDLCK, F_WRLCK) or let go of (F_UNLCK) an open file description's record lock on
    bytes [offset, offset + length) of `fd`, without waiting; whether it was taken."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, offset, length, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
