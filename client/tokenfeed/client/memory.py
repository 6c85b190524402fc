"""A process's allocator: freed memory kept for reuse, not handed back to the kernel.

glibc serves blocks above its mmap threshold (128 KiB, rising with the blocks freed) with fresh
mappings and trims the heap's top as soon as it is free, so memory that a process frees and
allocates again, block after block, is faulted in and zeroed by the kernel page by page each
time. `keep_freed_memory()` makes blocks up to 32 MiB come from the heap and stay there once
freed; the process then holds its high-water mark.

- The server calls it in every serving process: a served epoch lays out every chunk's row
  buffer once (a megabyte or more each) and drops it later, and copying a chunk into fresh
  memory cost about four times copying it into reused memory (bench/, wire section). Its
  budgets bound the mark (`stream_cache_bytes`, `stream_ahead`).
- A trainer may call it (`tokenfeed.client.keep_freed_memory()`, at start): each batch's arrays
  are fresh memory, about 1.3 MB per [32, 4096] batch (docs/client.md). The client never calls
  it by itself: the setting is the whole process's.

`TOKENFEED_KEEP_FREED_MEMORY=0` leaves the allocator's defaults. Other C libraries (musl) have
no such knob: nothing changes there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Tune this process's allocator (glibc only); whether it was tuned."""
    if os.environ.get("TOKENFEED_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        return False
    if mallopt is None or gnu is None:  # not glibc: its allocator has no such knobs
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("could not tune the allocator (mallopt refused); serving goes on untuned")
    return ok
