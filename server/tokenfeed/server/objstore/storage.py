"""Object storage behind a tiny interface, chosen by URI scheme.

`file://` URIs and bare paths are served by `LocalStore` (the embedded default: nothing to start),
`s3://` URIs by `S3Store` (s3store.py), whose blocks live in the disk cache (cache.py).
Every object is identified by its URI and pinned by (size, version) the first time it is listed:
a later read that sees another size or version raises `SourceChangedError` naming the object,
so a job never mixes two versions of one object. A chunk that groups small objects (chunks.py)
carries each one's listed `ObjectInfo`, so every part is pinned and checked like a lone object.
"""

from __future__ import annotations

import glob
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from tokenfeed.server.errors import SourceChangedError, SourceError
from tokenfeed.server.settings.config import ObjectStoreSpec

if TYPE_CHECKING:
    from tokenfeed.server.objstore.blockfiles import BlockFiles
    from tokenfeed.server.objstore.s3store import S3Store


@dataclass(frozen=True, order=True)
class ObjectInfo:
    uri: str
    size: int
    # Changes whenever the content may have changed: an ETag for object stores, the
    # modification time in nanoseconds for local files.
    version: str


class ObjectStore(Protocol):
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


def _local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


class LocalStore:
    """Local files and globs (`**` recurses); a directory is every file under it."""

    parallel_reads = 1

    def list(self, pattern: str) -> list[ObjectInfo]:
        path = _local_path(pattern)
        if not glob.has_magic(path) and os.path.isdir(path):
            # A layout (an MDS or save_to_disk directory, a Hub repository) is named by its
            # directory: everything under it, as on object storage.
            path = os.path.join(glob.escape(path), "**")
        matches = glob.glob(path, recursive=True) if glob.has_magic(path) else [path]
        infos: list[ObjectInfo] = []
        dirs: dict[str, str] = {}
        for match in matches:
            try:
                st = os.stat(match)
            except OSError as e:
                raise SourceError(f"cannot stat source {match}: {e.strerror}") from e
            if stat.S_ISDIR(st.st_mode):
                continue
            infos.append(ObjectInfo(_resolved(match, dirs), st.st_size, str(st.st_mtime_ns)))
        return sorted(infos)

    def _check(self, obj: ObjectInfo, fd: int) -> None:
        st = os.fstat(fd)
        if st.st_size != obj.size or str(st.st_mtime_ns) != obj.version:
            raise SourceChangedError(
                f"source {obj.uri} changed after it was pinned: size {obj.size} -> {st.st_size}, "
                f"mtime_ns {obj.version} -> {st.st_mtime_ns}; restart the job on a stable corpus"
            )

    def read_range(self, obj: ObjectInfo, start: int, end: int) -> bytes:
        with self.open(obj) as f:
            f.seek(start)
            return f.read(max(0, min(end, obj.size) - start))

    def open(self, obj: ObjectInfo) -> BinaryIO:
        try:
            f = open(_local_path(obj.uri), "rb")  # noqa: SIM115 - returned to the caller
        except OSError as e:
            raise SourceError(f"cannot open source {obj.uri}: {e.strerror}") from e
        try:
            self._check(obj, f.fileno())
        except BaseException:
            f.close()
            raise
        return f


def _resolved(path: str, dirs: dict[str, str]) -> str:
    """`Path(path).resolve()` with each directory resolved once per listing: resolving walks
    every component of a path (an lstat each), which made up most of listing 10,000 small
    files (bench/smallobjects.py). Only a symlink's own target needs the whole walk."""
    if os.path.islink(path):
        return str(Path(path).resolve())
    head, name = os.path.split(path)
    if head not in dirs:
        dirs[head] = str(Path(head).resolve())
    return os.path.join(dirs[head], name)


_LOCAL = LocalStore()  # stateless: one instance, so per-store caches key on it


class Storage:
    """The stores of one server, by URI scheme. The S3 backend (and boto3) is loaded on the
    first `s3://` URI; its blocks go to the disk cache when one is given."""

    def __init__(
        self, object_store: ObjectStoreSpec | None = None, blocks: BlockFiles | None = None
    ):
        self.object_store = object_store or ObjectStoreSpec()
        self.blocks = blocks
        self._s3: S3Store | None = None
        self._lock = threading.Lock()

    def for_uri(self, uri: str) -> ObjectStore:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        if scheme == "file":
            return _LOCAL
        if scheme == "s3":
            return self.s3()
        raise SourceError(
            f"unsupported URI scheme {scheme!r} in {uri!r}; supported: s3://, file://, paths"
        )

    def s3(self) -> S3Store:
        """The S3 backend, made on the first `s3://` URI."""
        with self._lock:
            if self._s3 is None:
                from tokenfeed.server.objstore.s3store import S3Store  # boto3 only when needed

                self._s3 = S3Store(self.object_store, self.blocks)
            return self._s3

    def read_object(self, uri: str) -> tuple[ObjectInfo, bytes]:
        """A whole object (a tokenizer file): its pinned version and bytes."""
        store = self.for_uri(uri)
        found = store.list(uri)
        if len(found) != 1:
            raise SourceError(f"{uri}: expected one object, found {len(found)}")
        return found[0], store.read_range(found[0], 0, found[0].size)


def store_for(uri: str) -> ObjectStore:
    """A store for local URIs without a server's configuration (tools, tests)."""
    return Storage().for_uri(uri)
