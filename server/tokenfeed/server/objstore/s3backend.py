"""`s3://bucket/key` objects through boto3: AWS S3, MinIO, Ceph RGW, R2 and the like.

Reads are ranged GETs. A range is served from aligned blocks of `object_store.block_bytes`
kept in the disk cache when at least half of a block is wanted; a thin sliver of a block (the
byte before a JSON Lines chunk, the end of a line that crosses into the next chunk) is fetched
alone and not cached, so a chunk costs about its own bytes and a few requests. Missing blocks
of one read are fetched several at a time.

Every request is retried here, with exponential backoff and full jitter, on throttling (503
SlowDown, 429), other 5xx, timeouts, resets and short bodies; botocore's own retries are off so
that every attempt is counted once and a truncated body is never used. The object's ETag and
size, pinned when it was listed, are checked on every response (and sent as If-Match): an object
that changed raises `SourceChangedError` naming it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import BinaryIO, TypeVar

import boto3
import botocore.config
import botocore.exceptions as bce
from tokenfeed.server.errors import ObjectStoreError, SourceChangedError, SourceError
from tokenfeed.server.objstore.blockfiles import BlockFiles
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.settings.config import ObjectStoreSpec
from tokenfeed.server.telemetry import metrics
from urllib3.exceptions import HTTPError as Urllib3Error

log = logging.getLogger(__name__)

T = TypeVar("T")

_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "503",
    "429",
}
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "500",
    "502",
    "503",
    "504",
}
_NETWORK_ERRORS = (
    bce.ConnectionError,
    bce.HTTPClientError,
    bce.ReadTimeoutError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    Urllib3Error,
    ConnectionError,
    TimeoutError,
)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def _network_reason(e: BaseException) -> str:
    """A body cut short surfaces as a streaming or incomplete-read error (from botocore or
    urllib3, possibly chained); a timeout names itself; the rest are resets and refusals."""
    chain: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(chain) < 5:
        chain.append(type(cause).__name__.lower())
        cause = cause.__cause__ or cause.__context__
    if any("incompleteread" in n or "streaming" in n for n in chain):
        return "short_body"
    return "timeout" if any("timeout" in n for n in chain) else "reset"


class _Retry(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SourceError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise SourceError(f"{uri!r}: no bucket name")
    return bucket, key


def glob_regex(pattern: str) -> re.Pattern:
    """`*` and `?` stay within one path segment, `**` crosses segments, `[...]` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if pattern.startswith("/", i):  # `a/**/b` also matches `a/b`
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (j := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1 : j]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


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
        self._random = random.Random()
        self._random_lock = threading.Lock()

    # ------------------------------------------------------------ requests

    def _call(self, op: str, what: str, attempt: Callable[[], T]) -> T:
        """Run one request with our retry policy; `what` names the object for errors."""
        spec = self.spec
        for n in range(1, spec.max_attempts + 1):
            start = time.monotonic()
            try:
                result = attempt()
            except _Retry as e:
                reason, detail = e.reason, str(e)
            except bce.ClientError as e:
                reason, detail = self._classify(e, what)
            except _NETWORK_ERRORS as e:
                reason, detail = _network_reason(e), f"{type(e).__name__}: {e}"
            else:
                metrics.OBJECT_SECONDS.labels(op).observe(time.monotonic() - start)
                metrics.OBJECT_REQUESTS.labels(op, "ok").inc()
                return result
            metrics.OBJECT_SECONDS.labels(op).observe(time.monotonic() - start)
            if n == spec.max_attempts:
                metrics.OBJECT_REQUESTS.labels(op, "error").inc()
                metrics.OBJECT_ERRORS.labels(reason).inc()
                raise ObjectStoreError(
                    f"{op} {what} failed {n} times, last: {reason} ({detail}); "
                    f"object_store.max_attempts is {spec.max_attempts}"
                )
            metrics.OBJECT_REQUESTS.labels(op, "retried").inc()
            metrics.OBJECT_RETRIES.labels(reason).inc()
            with self._random_lock:
                jitter = self._random.random()
            pause = min(spec.backoff_max_seconds, spec.backoff_base_seconds * 2 ** (n - 1))
            log.info("%s %s: %s (%s); retry %d in %.2fs", op, what, reason, detail, n, pause)
            time.sleep(pause * jitter)
        raise AssertionError("unreachable")

    @staticmethod
    def _classify(e: bce.ClientError, what: str) -> tuple[str, str]:
        """(retry reason, detail) for a retryable error; raises for the others."""
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        detail = f"HTTP {status} {code}: {err.get('Message', '')}".strip()
        if code in _THROTTLED or status in (429, 503):
            return "throttled", detail
        if code in _TRANSIENT_CODES or status >= 500:
            return "server_error", detail
        metrics.OBJECT_ERRORS.labels("client_error").inc()
        if status == 412 or code == "PreconditionFailed":
            raise SourceChangedError(
                f"source {what} changed after it was pinned (its ETag no longer matches); "
                "restart the job on a stable corpus"
            ) from e
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
            raise SourceChangedError(f"source {what} is gone ({detail})") from e
        raise SourceError(f"{what}: {detail}") from e

    # ------------------------------------------------------------ listing

    def list(self, pattern: str) -> list[ObjectInfo]:
        bucket, key_pattern = split_uri(pattern)
        if not _has_magic(key_pattern):
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
                raise _Retry("short_body", f"got {len(data)} of {want} bytes")
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
