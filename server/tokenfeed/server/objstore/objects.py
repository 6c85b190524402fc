"""What object storage holds, and the interface each backend gives: a pinned object (URI, size,
version) and listing and ranged reads of such objects. Every backend (localfiles.py,
s3backend.py) implements `ObjectBackend`; `ObjectStorage` (storage.py) picks one by URI scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol


@dataclass(frozen=True, order=True)
class ObjectInfo:
    uri: str
    size: int
    # Changes whenever the content may have changed: an ETag for object stores, the
    # modification time in nanoseconds for local files.
    version: str


class ObjectBackend(Protocol):
    # Reads worth having in flight at once, e.g. the parts of a group of small objects: each is
    # a round trip to object storage (`object_store.max_concurrency`), a page-cache copy locally.
    parallel_reads: int

    def list(self, pattern: str) -> list[ObjectInfo]:
        """Objects matching a glob, sorted by URI; a directory (a prefix that names no object
        of its own) lists every object under it, as `<dir>/**` would."""
        ...

    def read_range(self, obj: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of a pinned object; end is clamped to its size."""
        ...

    def open(self, obj: ObjectInfo) -> BinaryIO:
        """A seekable binary file over a pinned object."""
        ...

    # Per-store caches of parsed headers key on the store: hashable, by identity.
    def __hash__(self) -> int: ...
