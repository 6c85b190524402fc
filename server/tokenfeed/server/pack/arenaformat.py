"""The layout of a node's row-buffer arena (pack/sharedrows.py): where it lives, its header
page (size, segments, the ring's current segment and head, a generation per segment), a slot
(its header and payload, checked by xxh3-128, and whether a reader has checked it) and a
buffer's entry file; one place for the formats that the arena's writers and readers, and its
tests, share."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import xxhash

SEGMENTS = 8
# The arena's header page: magic, size, segment bytes, current segment, head in it, last stamp;
# then one generation per segment.
ARENA = struct.Struct("<8sQQQQQ")
ARENA_MAGIC = b"TFARENA2"
GENERATIONS = 64  # where the segments' generations start in the header page
DATA_START = 4096
# A slot: magic, stamp, the name's digest, ids, starts, itemsize, xxh3-128 of the payload.
SLOT = struct.Struct("<8sQ16sQQI4x16s")
SLOT_MAGIC = b"TFSLOT03"
# After it in the slot's header: the stamp again once a reader has checked the payload against
# its xxh3-128, which the node's later readers then need not hash again (0 until then).
CHECKED = struct.Struct("<Q")
CHECKED_AT = SLOT.size
SLOT_HEADER = 128  # the payload starts this far into its slot
ENTRY = struct.Struct("<8sQQQQQ")  # magic, segment, generation, offset, length, stamp
ENTRY_MAGIC = b"TFROWS03"


def node_dir(cache_dir: str | Path) -> Path:
    """The shared row buffers' directory of the server whose cache is `cache_dir`: in shared
    memory where the node has it, named by the cache directory (one server, one directory)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    tag = hashlib.blake2b(str(Path(cache_dir).resolve()).encode(), digest_size=8).hexdigest()
    return base / f"tokenfeed-rows-{tag}"


def remove(root: str | Path) -> None:
    """The directory, its arena and every entry in it."""
    shutil.rmtree(root, ignore_errors=True)


def slot_digest(ids: np.ndarray, starts: np.ndarray) -> bytes:
    """A slot's check: the xxh3-128 of its ids' and its starts' bytes."""
    digest = xxhash.xxh3_128()
    digest.update(ids.data.cast("B"))
    digest.update(starts.data.cast("B"))
    return digest.digest()


def slot_length(n_ids: int, n_starts: int, itemsize: int) -> int:
    """The bytes of a slot holding `n_ids` ids of `itemsize` bytes and `n_starts` starts."""
    return align64(SLOT_HEADER + align8(n_ids * itemsize) + n_starts * 8)


def slot_arrays(
    slot: np.ndarray, n_ids: int, n_starts: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """A slot's ids and starts as views of its bytes (`slot`: uint8, from its header on)."""
    starts_at = SLOT_HEADER + align8(n_ids * dtype.itemsize)
    ids = slot[SLOT_HEADER : SLOT_HEADER + n_ids * dtype.itemsize].view(dtype)
    return ids, slot[starts_at : starts_at + n_starts * 8].view(np.int64)


def name_digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def align8(n: int) -> int:
    return (n + 7) & ~7


def align64(n: int) -> int:
    return (n + 63) & ~63
