"""Named blobs under one prefix: a directory (local disk or a shared file system) or an `s3://`
prefix. Plain reads and writes for the shared store's chunks, and conditional ones (a write that
takes effect only if the blob is still the version read: S3's If-Match / If-None-Match, a locked
compare on a directory) for what must never be overwritten blindly: a job's plan log.
"""

from __future__ import annotations

import fcntl
import hashlib
from functools import partial
from pathlib import Path

import botocore.exceptions as bce
from tokenfeed.server.diskcache.cache import DiskCache, Kind
from tokenfeed.server.diskcache.diskfiles import write_atomic
from tokenfeed.server.objstore.s3backend import S3Backend, split_uri

# What a conditional write expects to find: the tag of the version read, or ABSENT (no blob).
ABSENT = ""


class Conflict(Exception):
    """A conditional write found another version than the one it expected (someone wrote
    since it was read): read again, and decide again."""


class LocalBlobs:
    """A directory (local disk or a shared file system)."""

    def __init__(self, root: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def get_tagged(self, name: str) -> tuple[bytes | None, str]:
        """The blob and its tag (a digest of its bytes), or (None, ABSENT)."""
        data = self.get(name)
        return (None, ABSENT) if data is None else (data, _digest(data))

    def put_if(self, name: str, data: bytes, expected: str) -> str:
        """Write the blob if its tag is still `expected` (ABSENT: if there is none); its new
        tag, or Conflict. A lock file beside it makes compare and write one step, for every
        process and thread on hosts that share the directory's locks."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _, now = self.get_tagged(name)
            if now != expected:
                raise Conflict(f"{path}: expected version {expected or 'none'}, found {now}")
            write_atomic(path, data)
        return _digest(data)

    def modified(self, prefix: str) -> dict[str, float]:
        """Names under `prefix` and their modification times (seconds, the store's clock)."""
        out = {}
        for path in (self.root / prefix).glob("*"):
            try:
                out[path.name] = path.stat().st_mtime
            except FileNotFoundError:
                continue
        return out


class CacheBlobs(LocalBlobs):
    """Blobs in the disk cache's directory, counted under its budget as entries of the `plan`
    kind that are never evicted: a lone server's plan logs (dataplan/keeper.py)."""

    KIND = "plan"

    def __init__(self, cache: DiskCache):
        super().__init__(str(cache.root))
        self.cache = cache
        cache.register(Kind(self.KIND, self._scan, self._delete, evictable=False))

    def _scan(self) -> list[tuple[str, int]]:
        return [(p.name, p.stat().st_size) for p in (self.root / "plans").glob("*.json")]

    def _delete(self, key: str) -> None:
        (self.root / "plans" / key).unlink(missing_ok=True)

    def put(self, name: str, data: bytes) -> None:
        with self.cache.reserving(len(data), f"{self.KIND} {name}"):
            super().put(name, data)
            self.cache.commit(self.KIND, Path(name).name, len(data))

    def put_if(self, name: str, data: bytes, expected: str) -> str:
        with self.cache.reserving(len(data), f"{self.KIND} {name}"):
            tag = super().put_if(name, data, expected)
            self.cache.commit(self.KIND, Path(name).name, len(data))
        return tag


class S3Blobs:
    """An `s3://bucket/prefix/`, through S3Backend's client and retry policy."""

    def __init__(self, s3: S3Backend, uri: str):
        self.s3 = s3
        self.bucket, prefix = split_uri(uri)
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""

    def get(self, name: str) -> bytes | None:
        key = self.prefix + name

        def attempt() -> bytes | None:
            try:
                resp = self.s3.client.get_object(Bucket=self.bucket, Key=key)
            except bce.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 404 or e.response.get("Error", {}).get("Code") == "NoSuchKey":
                    return None
                raise
            data = resp["Body"].read()
            if len(data) != resp["ContentLength"]:
                raise bce.IncompleteReadError(
                    actual_bytes=len(data), expected_bytes=resp["ContentLength"]
                )
            return data

        return self.s3._call("get", f"s3://{self.bucket}/{key}", attempt)

    def put(self, name: str, data: bytes) -> None:
        key = self.prefix + name
        self.s3._call(
            "put",
            f"s3://{self.bucket}/{key}",
            lambda: self.s3.client.put_object(Bucket=self.bucket, Key=key, Body=data),
        )

    def get_tagged(self, name: str) -> tuple[bytes | None, str]:
        """The blob and its ETag (strongly consistent: S3 reads see the latest write), or
        (None, ABSENT)."""
        key = self.prefix + name

        def attempt() -> tuple[bytes | None, str]:
            try:
                resp = self.s3.client.get_object(Bucket=self.bucket, Key=key)
            except bce.ClientError as e:
                if _status(e) == 404 or _code(e) == "NoSuchKey":
                    return None, ABSENT
                raise
            data = resp["Body"].read()
            if len(data) != resp["ContentLength"]:
                raise bce.IncompleteReadError(
                    actual_bytes=len(data), expected_bytes=resp["ContentLength"]
                )
            return data, str(resp["ETag"])

        return self.s3._call("get", f"s3://{self.bucket}/{key}", attempt)

    def put_if(self, name: str, data: bytes, expected: str) -> str:
        """Write the blob if its ETag is still `expected` (ABSENT: if there is none), with S3's
        conditional writes (If-Match, If-None-Match: *); its new ETag, or Conflict."""
        key = self.prefix + name
        condition = {"IfMatch": expected} if expected else {"IfNoneMatch": "*"}

        def attempt() -> str | None:
            try:
                resp = self.s3.client.put_object(
                    Bucket=self.bucket, Key=key, Body=data, **condition
                )
            except bce.ClientError as e:
                # 412: another version is there; 409: a concurrent conditional write won.
                if _status(e) in (409, 412) or _code(e) in ("PreconditionFailed", "Conflict"):
                    return None
                raise
            return str(resp["ETag"])

        tag = self.s3._call("put", f"s3://{self.bucket}/{key}", attempt)
        if tag is None:
            raise Conflict(f"s3://{self.bucket}/{key}: another version than {expected or 'none'}")
        return tag

    def modified(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        kwargs = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        while True:
            page = self.s3._call(
                "list",
                f"s3://{self.bucket}/{kwargs['Prefix']}",
                partial(self.s3.client.list_objects_v2, **kwargs),
            )
            for item in page.get("Contents", []):
                out[item["Key"].rsplit("/", 1)[-1]] = item["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _status(e: bce.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _code(e: bce.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
