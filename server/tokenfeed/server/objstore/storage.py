"""Object storage behind a tiny interface, chosen by URI scheme.

`file://` URIs and bare paths are served by `LocalBackend` (the embedded default: nothing to start),
`s3://` URIs by `S3Backend` (s3backend.py), whose blocks live in the disk cache (cache.py).
Every object is identified by its URI and pinned by (size, version) the first time it is listed:
a later read that sees another size or version raises `SourceChangedError` naming the object,
so a job never mixes two versions of one object. A chunk that groups small objects (chunks.py)
carries each one's listed `ObjectInfo`, so every part is pinned and checked like a lone object.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.localfiles import LocalBackend
from tokenfeed.server.objstore.objects import ObjectBackend, ObjectInfo
from tokenfeed.server.settings.config import ObjectStoreSpec

if TYPE_CHECKING:
    from tokenfeed.server.objstore.blockfiles import BlockFiles
    from tokenfeed.server.objstore.s3backend import S3Backend


_LOCAL = LocalBackend()  # stateless: one instance, so per-store caches key on it


class ObjectStorage:
    """The stores of one server, by URI scheme. The S3 backend (and boto3) is loaded on the
    first `s3://` URI; its blocks go to the disk cache when one is given."""

    def __init__(
        self, object_store: ObjectStoreSpec | None = None, blocks: BlockFiles | None = None
    ):
        self.object_store = object_store or ObjectStoreSpec()
        self.blocks = blocks
        self._s3: S3Backend | None = None
        self._lock = threading.Lock()

    def for_uri(self, uri: str) -> ObjectBackend:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        if scheme == "file":
            return _LOCAL
        if scheme == "s3":
            return self.s3()
        raise SourceError(
            f"unsupported URI scheme {scheme!r} in {uri!r}; supported: s3://, file://, paths"
        )

    def s3(self) -> S3Backend:
        """The S3 backend, made on the first `s3://` URI."""
        with self._lock:
            if self._s3 is None:
                from tokenfeed.server.objstore.s3backend import S3Backend  # boto3 only when needed

                self._s3 = S3Backend(self.object_store, self.blocks)
            return self._s3

    def read_object(self, uri: str) -> tuple[ObjectInfo, bytes]:
        """A whole object (a tokenizer file): its pinned version and bytes."""
        store = self.for_uri(uri)
        found = store.list(uri)
        if len(found) != 1:
            raise SourceError(f"{uri}: expected one object, found {len(found)}")
        return found[0], store.read_range(found[0], 0, found[0].size)


_LOCAL_STORAGE = ObjectStorage()


def local_storage() -> ObjectStorage:
    """Object storage for local URIs without a server's configuration (tools, tests)."""
    return _LOCAL_STORAGE


def backend_for(uri: str) -> ObjectBackend:
    """A backend for local URIs without a server's configuration (tools, tests)."""
    return _LOCAL_STORAGE.for_uri(uri)
