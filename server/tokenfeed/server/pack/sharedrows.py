"""Row buffers shared by the serving processes of one node (`server.workers` > 1).

The ranks of a job spread over every worker (the kernel spreads connections) and each rank's
rows over every chunk of a window, so without sharing each worker would lay out every chunk's
row buffer of every epoch itself: N workers, N times the layout work for the same tokens
(bench/results/cores16-serving.txt measured it). Here the first process that needs a buffer
lays it out and writes it to a directory of the node's shared memory (`/dev/shm`, else the
temporary directory: `node_dir`); the others map the file. Row buffers are memory
(`server.stream_cache_bytes`), not the disk cache: this directory is not under
`server.cache_bytes`, and the supervisor removes it when it starts and when it stops.

A buffer's bytes are decided by its name: the plan's fingerprint at its version (which covers
the job's fixed parts, its phases and its datasets' content), the dataset and segment, the
epoch and the chunk. So any process would write the same bytes, and a race between two writers
is harmless: files are written whole under a temporary name and renamed. A file is checked
(its xxh3-128) when it is mapped; one that fails the check is laid out again and rewritten.
One process lays a buffer out while the others wait for it: it holds an exclusive `flock` on
the buffer's lock file, which the kernel lets go when the process ends however it ends (a dead
writer's lock is free at once); a waiter tries the lock at a short interval (from 50 us,
doubling to 1 ms), so it maps the file within about a millisecond of its writing; on the event
loop a process does not wait (`get_or_make_now`) and leaves the buffer to a thread. The
directory is kept under a byte budget: oldest files first are removed; a process that maps a
removed file keeps its pages until it drops the mapping.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash
from tokenfeed.server.pack.rowlayout import RowBuffer
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

MAGIC = b"TFROWS01"
HEADER = struct.Struct("<8sQQI4x16s")  # magic, ids, starts, itemsize, digest of the payload
WAIT_SECONDS = 10.0  # the longest a process waits for another's layout before its own
# A waiter tries the writer's lock again after POLL_FIRST seconds, then twice as long each time
# up to POLL_MOST: a layout takes about a millisecond or a few (bench/, wire section).
POLL_FIRST, POLL_MOST = 50e-6, 1e-3


def node_dir(cache_dir: str | Path) -> Path:
    """The shared row buffers' directory of the server whose cache is `cache_dir`: in shared
    memory where the node has it, named by the cache directory (one server, one directory)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    tag = hashlib.blake2b(str(Path(cache_dir).resolve()).encode(), digest_size=8).hexdigest()
    return base / f"tokenfeed-rows-{tag}"


def remove(root: str | Path) -> None:
    """The directory and every buffer in it (a process that maps one keeps its pages)."""
    shutil.rmtree(root, ignore_errors=True)


class SharedRows:
    """Row buffers in files under `root`, at most `budget` bytes of them (and at most half of
    the file system's size: /dev/shm is often small in a container)."""

    def __init__(self, root: str | Path, budget: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.root)
        self.budget = min(budget, st.f_blocks * st.f_frsize // 2)
        self._written = 0  # bytes written since the last sweep
        self.made = 0  # buffers this process laid out and wrote
        self.mapped = 0  # buffers this process mapped from another's file
        # Where this process starts in a plan's list of missing buffers (assembly.open_chunks):
        # a place of its own, so the node's processes lay out different buffers at once.
        self.turn = os.getpid()

    def get_or_make(self, name: str, make: Callable[[], RowBuffer], dtype: np.dtype) -> RowBuffer:
        """The buffer `name` (a relative path): mapped from its file, or laid out by `make` in
        this process (and written for the others) when no file holds it; where another
        process is laying it out, mapped once that one has written it."""
        found = self._get_or_make(name, make, dtype, wait=True)
        if found is None:
            raise RuntimeError(f"row buffer {name}: neither mapped nor laid out")
        return found

    def get_or_make_now(
        self, name: str, make: Callable[[], RowBuffer], dtype: np.dtype
    ) -> RowBuffer | None:
        """`get_or_make` without waiting (the event loop): None where another process is
        laying the buffer out."""
        return self._get_or_make(name, make, dtype, wait=False)

    def _get_or_make(
        self, name: str, make: Callable[[], RowBuffer], dtype: np.dtype, wait: bool
    ) -> RowBuffer | None:
        path = self.root / name
        found = self._read(path, dtype)
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
                return make()
            found = self._read(path, dtype)  # written by the lock's holder before us
            if found is not None:
                return found
            buf = make()
            written = self._write(path, buf)
            self.made += written
            metrics.ROW_BUFFERS.labels("laid_out" if written else "unshared").inc()
            # The lock file goes before the lock: a process that opens the name later makes a
            # new one, and finds the buffer's file first anyway. A process holding the old
            # one's descriptor takes its lock next and maps the file.
            _unlink(lock)
            return buf
        finally:
            os.close(fd)  # lets go of the lock

    # ---------------------------------------------------------------- files

    def _read(self, path: Path, dtype: np.dtype) -> RowBuffer | None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < HEADER.size:
                    raise ValueError("shorter than its header")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("row buffer %s unreadable (%s): laid out again", path, e)
            _unlink(path)
            return None
        magic, n_ids, n_starts, itemsize, digest = HEADER.unpack_from(mapped, 0)
        payload = memoryview(mapped)[HEADER.size :]
        if (
            magic != MAGIC
            or itemsize != dtype.itemsize
            or len(payload) != n_ids * itemsize + n_starts * 8
            or xxhash.xxh3_128_digest(payload) != digest
        ):
            payload.release()
            log.warning("row buffer %s fails its check: laid out again", path)
            _unlink(path)
            return None
        ids = np.frombuffer(mapped, dtype=dtype, count=n_ids, offset=HEADER.size)
        starts = np.frombuffer(
            mapped, dtype=np.int64, count=n_starts, offset=HEADER.size + n_ids * itemsize
        )
        payload.release()
        self.mapped += 1
        metrics.ROW_BUFFERS.labels("mapped").inc()
        return RowBuffer(ids, starts)

    def _write(self, path: Path, buf: RowBuffer) -> bool:
        ids = np.ascontiguousarray(buf.ids)
        starts = np.ascontiguousarray(buf.starts, dtype=np.int64)
        digest = xxhash.xxh3_128()
        digest.update(ids.data.cast("B"))
        digest.update(starts.data.cast("B"))
        header = HEADER.pack(MAGIC, ids.size, starts.size, ids.dtype.itemsize, digest.digest())
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(ids.data.cast("B"))
                f.write(starts.data.cast("B"))
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk: this process's copy still serves
            log.warning("row buffer %s not written (%s)", path, e)
            _unlink(tmp)
            return False
        self._written += HEADER.size + ids.nbytes + starts.nbytes
        if self._written > self.budget // 4:
            self.sweep()
        return True

    def sweep(self) -> int:
        """Remove the oldest files until the directory holds at most 3/4 of the budget, if it
        holds more than the budget; the bytes removed."""
        self._written = 0
        files = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if n.endswith((".lock", ".tmp")):
                    continue
                p = os.path.join(dirpath, n)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        if total <= self.budget:
            return 0
        removed = 0
        for _, size, p in sorted(files):
            if total - removed <= self.budget * 3 // 4:
                break
            _unlink(Path(p))
            removed += size
        return removed


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


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
