"""How the server reaches object storage, and the token store a fleet shares.

Each option is declared once on its field (options.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configcheck import Integer, Number, OptionalText, Rule, Size, Text
from tokenfeed.server.settings.configread import NUMBER, SIZE, TEXT_OR_NONE, resolve
from tokenfeed.server.settings.options import Convert, Option, option, validate

ADDRESSING_STYLES = ("auto", "path", "virtual")


def _seconds(doc: str, above_zero: bool = False, why: str = "") -> dict[str, Option]:
    accepts = "seconds > 0" if above_zero else "seconds >= 0"
    return option(Number(above_zero=above_zero), read=NUMBER, doc=doc, why=why, accepts=accepts)


@dataclass(frozen=True)
class ObjectStoreSpec:
    """How `s3://` URIs are reached. Credentials come from boto3's standard chain (environment,
    shared files, `profile`, instance or pod roles), never from this file."""

    endpoint_url: str | None = field(
        default=None,
        metadata=option(
            OptionalText(),
            Rule(lambda v: v is None or re.match(r"https?://", v), "http:// or https://"),
            doc="the S3-compatible endpoint (`http://minio:9000`); left out: AWS S3",
            accepts="`http://` or `https://` URL",
        ),
    )
    region: str | None = field(default=None, metadata=option(OptionalText(), doc="the region"))
    addressing_style: str = field(
        default="auto",
        metadata=option(
            Text(ADDRESSING_STYLES), doc="MinIO and most on-premise stores need `path`"
        ),
    )
    profile: str | None = field(
        default=None,
        metadata=option(OptionalText(), doc="a named profile of the shared AWS files"),
    )
    block_bytes: int = field(
        default=8 * 2**20,
        metadata=option(
            Size(),
            read=SIZE,
            doc="reads are ranged GETs of aligned blocks of this size, cached on disk; keep "
            "`chunk_bytes` a multiple of it ([reads](storage-and-cache.md))",
        ),
    )
    max_concurrency: int = field(
        default=8, metadata=option(Integer(minimum=1), doc="block GETs in flight per server")
    )
    max_attempts: int = field(
        default=8,
        metadata=option(
            Integer(minimum=1),
            doc="per request, the first included; then the read fails with `UNAVAILABLE`",
        ),
    )
    backoff_base_seconds: float = field(
        default=0.1, metadata=_seconds("exponential backoff with full jitter between attempts")
    )
    backoff_max_seconds: float = field(default=20.0, metadata=_seconds("the backoff's cap"))
    connect_timeout_seconds: float = field(
        default=10.0, metadata=_seconds("a connection not made in this long is retried")
    )
    read_timeout_seconds: float = field(
        default=60.0, metadata=_seconds("a response silent for this long is retried")
    )

    def __post_init__(self) -> None:
        validate(self)


def _store_uri(value: object, where: str, base: Path) -> str:
    """`s3://bucket/prefix/`, or a directory: relative to the config file like other paths."""
    uri = OptionalText()(where, value) or ""
    if uri and not uri.startswith("s3://"):
        uri = resolve(uri.removeprefix("file://"), base)
    return uri


@dataclass(frozen=True)
class StoreSpec:
    """A token store shared by a fleet (sharedstore.py): chunks tokenized by one node are
    published under `uri` and read by the others, so each chunk is tokenized about once."""

    uri: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=Convert(_store_uri, "`s3://bucket/prefix/` or a directory"),
            doc="where the fleet's chunks are published "
            "([token store](token-store.md#the-shared-store)); left out: no shared store",
        ),
    )
    node: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=TEXT_OR_NONE,
            shown="host name and `cache_dir`",
            doc="this node's name for rendezvous hashing and heartbeats",
            why="stable across restarts of one node",
        ),
    )
    min_nodes: int = field(
        default=1,
        metadata=option(
            Integer(minimum=1),
            doc="before building, wait (up to `join_seconds`) until this many nodes heartbeat, so "
            "a fleet started together splits the work from the first chunk",
            why="1: a node starts building at once, alone or not",
        ),
    )
    join_seconds: float = field(default=60.0, metadata=_seconds("see `min_nodes`"))
    node_ttl_seconds: float = field(
        default=30.0,
        metadata=_seconds(
            "a node whose heartbeat is older than this is gone: its chunks are taken over",
            above_zero=True,
        ),
    )
    takeover_seconds: float = field(
        default=120.0,
        metadata=_seconds(
            "a chunk assigned to a live node but still unpublished after this long is tokenized "
            "here"
        ),
    )

    def __post_init__(self) -> None:
        validate(self)
        # Chunks are assigned to node names: a nameless node would own nothing and take over
        # everything.
        if self.uri and not self.node:
            raise ConfigError(f"node: required with uri {self.uri!r}")
