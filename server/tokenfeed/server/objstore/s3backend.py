"""`s3://bucket/key` objects through boto3: AWS S3, MinIO, Ceph RGW, R2 and the like.

Reads are ranged GETs. A range is served from aligned blocks of `object_store.block_bytes`
kept in the disk cache when at least half of a block is wanted; a thin sliver of a block (the
byte before a JSON Lines chunk, the end of a line that crosses into the next chunk) is fetched
alone and not cached, so a chunk costs about its own bytes and a few requests. Missing blocks
of one read are fetched several at a time.

Every request is retried (s3retry.py), with exponential backoff and full jitter, on throttling,
other 5xx, timeouts, resets and short bodies; botocore's own retries are off so that every
attempt is counted once and a truncated body is never used. The object's ETag and
size, pinned when it was listed, are checked on every response (and sent as If-Match): an object
that changed raises `SourceChangedError` naming it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import BinaryIO, TypeVar

import boto3
import botocore.config
from tokenfeed.server.errors import ObjectStoreError, SourceChangedError
from tokenfeed.server.objstore.blockfiles import BlockFiles
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.objstore.s3retry import Retry, RetryPolicy
from tokenfeed.server.objstore.s3uris import glob_regex, has_magic, split_uri
from tokenfeed.server.settings.config import ObjectStoreSpec
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class S3Backend:
    def __init__(self, spec: ObjectStoreSpec, blocks: BlockFiles | None):
        self.spec, self.blocks = spec, blocks
        session = boto3.session.Session(profile_name=spec.profile)
        config = botocore.config.Config(
            region_name=spec.region,
            s3={"addressing_style": spec.addressing_style},
            retries={"total_max_attempts": 1, "mode": "standard"},  # ours count and verify
            connect_timeout=spec.connect_timeout_seconds,
            read_timeout=spec.read_timeout_seconds,
            max_pool_connections=2 * spec.max_concurrency + 4,
        )
        self.client = session.client("s3", endpoint_url=spec.endpoint_url, config=config)
        self._pool = ThreadPoolExecutor(spec.max_concurrency, thread_name_prefix="s3-get")
        self.parallel_reads = spec.max_concurrency  # the parts of a group of small objects
        self._retry = RetryPolicy(spec)

    # ------------------------------------------------------------ requests

    def _call(self, op: str, what: str, attempt: Callable[[], T]) -> T:
        """Run one request with our retry policy (s3retry.py; blobs.py's requests too); `what`
        names the object for errors."""
        return self._retry.call(op, what, attempt)

    # ------------------------------------------------------------ listing

    def list(self, pattern: str) -> list[ObjectInfo]:
        bucket, key_pattern = split_uri(pattern)
        if not has_magic(key_pattern):
            info = self._head(bucket, key_pattern, pattern) if key_pattern else None
            if info is not None:
                return [info]
            # No such object: a "directory" (a layout named by its prefix) lists what is under it.
            prefix = key_pattern.rstrip("/") + "/" if key_pattern.strip("/") else ""
            regex = re.compile(re.escape(prefix) + ".*")
        else:
            prefix = re.split(r"[*?\[]", key_pattern, maxsplit=1)[0]
            regex = glob_regex(key_pattern)
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", pattern, partial(self.client.list_objects_v2, **kwargs))
            for item in page.get("Contents", []):
                if regex.match(item["Key"]) and not item["Key"].endswith("/"):
                    found.append(
                        ObjectInfo(f"s3://{bucket}/{item['Key']}", int(item["Size"]), item["ETag"])
                    )
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        return sorted(found)

    def _head(self, bucket: str, key: str, uri: str) -> ObjectInfo | None:
        try:
            head = self._call("head", uri, lambda: self.client.head_object(Bucket=bucket, Key=key))
        except SourceChangedError:  # 404: matches nothing
            return None
        return ObjectInfo(uri, int(head["ContentLength"]), head["ETag"])

    # ------------------------------------------------------------ reads

    def _get(self, obj: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of the pinned object, verified, with retries."""
        bucket, key = split_uri(obj.uri)
        want = end - start

        def attempt() -> bytes:
            resp = self.client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=obj.version
            )
            if resp.get("ETag") != obj.version:
                raise SourceChangedError(
                    f"source {obj.uri} changed after it was pinned: ETag {obj.version} -> "
                    f"{resp.get('ETag')}; restart the job on a stable corpus"
                )
            total = self._total_size(resp, obj)
            if total != obj.size:
                raise SourceChangedError(
                    f"source {obj.uri} changed after it was pinned: size {obj.size} -> {total}"
                )
            body = resp["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            if len(data) != want:
                raise Retry("short_body", f"got {len(data)} of {want} bytes")
            metrics.OBJECT_BYTES.inc(len(data))
            return data

        data = self._call("get", f"{obj.uri} bytes {start}-{end}", attempt)
        if start == 0 and end == obj.size:
            self._check_md5(obj, data)
        return data

    @staticmethod
    def _total_size(resp: dict, obj: ObjectInfo) -> int:
        m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
        return int(m.group(3)) if m else int(resp.get("ContentLength", -1))

    @staticmethod
    def _check_md5(obj: ObjectInfo, data: bytes) -> None:
        """A single-part upload's ETag is the MD5 of its bytes: a whole-object read is checked
        against it (a multipart ETag, `<md5>-<parts>`, cannot be)."""
        etag = obj.version.strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag) and hashlib.md5(data).hexdigest() != etag:
            raise ObjectStoreError(
                f"{obj.uri}: body does not match its ETag (MD5); the read is discarded"
            )

    def _block_key(self, obj: ObjectInfo, k: int) -> str:
        text = f"{obj.uri}\x1f{obj.version}\x1f{obj.size}\x1f{self.spec.block_bytes}\x1f{k}"
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def read_range(self, obj: ObjectInfo, start: int, end: int) -> bytes:
        end = min(end, obj.size)
        if start >= end:
            return b""
        b = self.spec.block_bytes
        parts: list[Callable[[], bytes]] = []
        for k in range(start // b, (end - 1) // b + 1):
            lo, hi = k * b, min((k + 1) * b, obj.size)
            a, z = max(start, lo), min(end, hi)
            key = self._block_key(obj, k)
            cached = self.blocks is not None and self.blocks.cache.contains(BlockFiles.KIND, key)
            if self.blocks is not None and (cached or 2 * (z - a) >= hi - lo):
                parts.append(partial(self._through_block, self.blocks, obj, key, lo, hi, a, z))
            else:
                parts.append(partial(self._get, obj, a, z))
        if len(parts) == 1:
            return parts[0]()
        return b"".join(self._pool.map(lambda f: f(), parts))

    def _through_block(
        self, blocks: BlockFiles, obj: ObjectInfo, key: str, lo: int, hi: int, a: int, z: int
    ) -> bytes:
        """Bytes [a, z) of the object, from its block [lo, hi) in the disk cache."""
        return blocks.get(key, partial(self._get, obj, lo, hi))[a - lo : z - lo]

    def open(self, obj: ObjectInfo) -> BinaryIO:
        return io.BufferedReader(_RangeFile(self, obj), buffer_size=256 * 1024)


class _RangeFile(io.RawIOBase):
    """A seekable read-only file over an object, for readers that seek (Parquet)."""

    def __init__(self, store: S3Backend, obj: ObjectInfo):
        self.store, self.obj, self.pos = store, obj, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        data = self.store.read_range(self.obj, self.pos, self.pos + len(buffer))
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)
