"""A token store shared by a fleet: chunks tokenized by one node are published under one prefix
(`store.uri`, an `s3://` prefix or a directory) and read by every other node.

Layout under the prefix (docs/token-store.md):
- `chunks/<key[:2]>/<key>.{bin,idx,rec,json}`: a chunk's files, exactly as in the local store;
  the manifest (`.json`) is written last and is the commit point. Keys are content addresses of
  the inputs (Chunk.key), and tokenization is deterministic, so two nodes that publish the same
  chunk publish the same bytes: a race between writers is harmless.
- `datasets/<name>.json`: the inputs a dataset's chunks were made from (sources with their sizes
  and ETags, tokenizer digest, chunk format version, chunk size). A job whose inputs differ is
  refused with what differs: a store holds one version of a dataset.
- `nodes/<node>.json`: heartbeats. The live nodes (heartbeat newer than `node_ttl_seconds`, by
  the store's own clock) split the chunks by rendezvous hashing; a node tokenizes its own
  chunks, reads the others' once published, and takes one over when its owner is gone or it is
  still missing after `takeover_seconds`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass

from tokenfeed.server.errors import StoreCorruptError, StoreMismatchError
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.settings.config import StoreSpec
from tokenfeed.server.store.blobs import LocalBlobs, S3Blobs
from tokenfeed.server.store.chunkfiles import EncodedChunk, parse_manifest
from tokenfeed.server.telemetry import metrics

log = logging.getLogger(__name__)

STORE_FORMAT = 1
BODY_SUFFIXES = ("bin", "idx", "rec")


@dataclass
class StoreCounts:
    published: int = 0  # chunks this node tokenized and published
    fetched: int = 0  # manifests read from the store instead of tokenizing
    bodies_fetched: int = 0
    taken_over: int = 0  # chunks of another node tokenized here


class SharedStore:
    def __init__(self, spec: StoreSpec, storage: ObjectStorage):
        self.spec, self.node = spec, spec.node
        if spec.uri.startswith("s3://"):
            self.blobs: LocalBlobs | S3Blobs = S3Blobs(storage.s3(), spec.uri)
        else:
            self.blobs = LocalBlobs(spec.uri)
        self.counts = StoreCounts()
        self._lock = threading.Lock()
        self._nodes: list[str] = [self.node]
        self._beat = -1e9  # monotonic time of the last heartbeat

    # ------------------------------------------------------------ chunks

    @staticmethod
    def _name(key: str, suffix: str) -> str:
        return f"chunks/{key[:2]}/{key}.{suffix}"

    def manifest(self, key: str) -> bytes | None:
        """The chunk's published manifest (checked), or None if it is not published."""
        raw = self.blobs.get(self._name(key, "json"))
        if raw is None:
            return None
        try:
            parse_manifest(key, raw)
        except StoreCorruptError:
            log.warning(
                "shared store %s: chunk %s has a corrupt manifest; rebuilding it here",
                self.spec.uri,
                key,
            )
            return None
        return raw

    def body(self, key: str, manifest_bytes: bytes) -> EncodedChunk | None:
        """The chunk's published files, verified against its manifest (None if missing or
        corrupt: the caller tokenizes it)."""
        m = parse_manifest(key, manifest_bytes)
        bin_, idx, rec = (self.blobs.get(self._name(key, s)) for s in BODY_SUFFIXES)
        if bin_ is None or idx is None or rec is None:
            return None
        chunk = EncodedChunk(key, bin_, idx, rec, manifest_bytes, m)
        if not chunk.verified():
            log.warning(
                "shared store %s: chunk %s fails its checksums; rebuilding it here",
                self.spec.uri,
                key,
            )
            return None
        with self._lock:
            self.counts.bodies_fetched += 1
        metrics.STORE_CHUNKS.labels("fetched").inc()
        return chunk

    def publish(self, chunk: EncodedChunk) -> None:
        """The body files first, the manifest last (the commit point)."""
        for suffix, data in zip(BODY_SUFFIXES, (chunk.bin, chunk.idx, chunk.rec), strict=True):
            self.blobs.put(self._name(chunk.key, suffix), data)
        self.blobs.put(self._name(chunk.key, "json"), chunk.manifest_bytes)
        with self._lock:
            self.counts.published += 1
        metrics.STORE_CHUNKS.labels("published").inc()

    # ------------------------------------------------------------ datasets

    def check_dataset(self, name: str, inputs: dict) -> None:
        """Record the dataset's inputs, or refuse when the store holds other ones."""
        path = f"datasets/{name}.json"
        record = {"store_format": STORE_FORMAT, "dataset": name, **inputs}
        raw = self.blobs.get(path)
        if raw is None:
            self.blobs.put(path, json.dumps(record, indent=1, sort_keys=True).encode())
            return
        try:
            found = json.loads(raw)
        except ValueError:
            raise StoreMismatchError(
                f"shared store {self.spec.uri}: {path} is not JSON; "
                "remove it or use another store prefix"
            ) from None
        differences = describe_differences(found, record)
        if differences:
            raise StoreMismatchError(
                f"shared store {self.spec.uri} holds dataset {name!r} made from other inputs: "
                + "; ".join(differences)
                + ". A store holds one version of a dataset: point "
                "store.uri at a new prefix (or rename the dataset) for the new inputs"
            )

    # ------------------------------------------------------------ the fleet

    def heartbeat(self, force: bool = False) -> list[str]:
        """Refresh this node's heartbeat and the list of live nodes (at most every ttl/4)."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._beat < self.spec.node_ttl_seconds / 4:
                return self._nodes
            self._beat = now
        self.blobs.put(f"nodes/{_safe(self.node)}.json", json.dumps({"node": self.node}).encode())
        beats = self.blobs.modified("nodes/")
        mine = beats.get(f"{_safe(self.node)}.json", max(beats.values(), default=0.0))
        live = sorted(
            n.removesuffix(".json")
            for n, t in beats.items()
            if t >= mine - self.spec.node_ttl_seconds
        )
        with self._lock:
            self._nodes = live or [_safe(self.node)]
            return self._nodes

    def join(self) -> list[str]:
        """Wait (up to join_seconds) until min_nodes nodes heartbeat."""
        deadline = time.monotonic() + self.spec.join_seconds
        while True:
            nodes = self.heartbeat(force=True)
            if len(nodes) >= self.spec.min_nodes or time.monotonic() > deadline:
                log.info(
                    "shared store %s: %d live node(s): %s",
                    self.spec.uri,
                    len(nodes),
                    ", ".join(nodes),
                )
                return nodes
            time.sleep(min(1.0, self.spec.node_ttl_seconds / 4))

    def owner(self, key: str) -> str:
        """The live node a chunk is assigned to: highest rendezvous score."""
        nodes = self.heartbeat()
        return max(
            nodes, key=lambda n: hashlib.blake2b(f"{n}\x1f{key}".encode(), digest_size=8).digest()
        )

    def mine(self, key: str) -> bool:
        return self.owner(key) == _safe(self.node)


def _safe(node: str) -> str:
    """A node name usable as one path segment of an object key."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in node)


def describe_differences(found: dict, wanted: dict) -> list[str]:
    """What differs between the inputs recorded in a store and a job's, in words."""
    out = []
    for field in ("store_format", "chunk_format", "tokenizer_blake2b", "chunk_bytes"):
        if found.get(field) != wanted.get(field):
            out.append(f"{field} {found.get(field)} in the store, {wanted.get(field)} here")
    have = {s[0]: s for s in found.get("sources", [])}
    want = {s[0]: s for s in wanted.get("sources", [])}
    added, gone = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    changed = sorted(u for u in set(have) & set(want) if have[u] != want[u])
    for label, uris in (
        ("sources added", added),
        ("sources missing", gone),
        ("sources changed (size, ETag or reading)", changed),
    ):
        if uris:
            more = f" and {len(uris) - 3} more" if len(uris) > 3 else ""
            out.append(f"{len(uris)} {label}: {', '.join(uris[:3])}{more}")
    return out
