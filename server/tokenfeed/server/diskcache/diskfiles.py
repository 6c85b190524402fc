"""Files of a cache directory: its owner's lock, and atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenfeed.server.errors import CacheBusyError


def lock_directory(root: Path, what: str) -> int:
    """Take `root`'s lock (an exclusive flock on `root/.lock`, holding the owner's pid) for
    the life of this process, or refuse: one cache directory belongs to one owning process,
    since its rescan removes the partial writes of any other. Returns the lock's descriptor."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    path = root / ".lock"
    held = _LOCKS.get(str(path.resolve()))
    if held is not None:  # this process owns it already (several jobs, several builds)
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CacheBusyError(
            f"cache_dir {root} is in use by another tokenfeed process (pid {owner}); {what} "
            "cannot share it: ask the running server instead (e.g. `tokenfeed inspect "
            "--target HOST:PORT`), or give this command another cache_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _LOCKS[str(path.resolve())] = fd
    return fd


_LOCKS: dict[str, int] = {}  # the cache directories this process owns: lock path -> descriptor


def write_atomic(path: Path, data: bytes) -> None:
    """Temporary file in the same directory, flushed, fsynced, renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
