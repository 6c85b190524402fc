"""What the serving port accepts: TLS, bearer tokens, and bounds on what clients may ask.

Each option is declared once on its field (options.py); auth.py reads the files they name
when the server starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.configcheck import Integer, Number, Rule, Size, Text
from tokenfeed.server.settings.configread import NUMBER, OPTIONAL_PATH, PATH, SIZE, TEXT_OR_NONE
from tokenfeed.server.settings.options import REQUIRED, Option, option, validate

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The smallest request: a job name and a few integers.
MIN_REQUEST_BYTES = 1024


@dataclass(frozen=True)
class TlsSpec:
    """TLS on the gRPC port; auth.py reads and checks the files when the server starts."""

    cert_file: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=PATH,
            default=REQUIRED,
            doc="PEM certificate chain: TLS on `server.listen`. Read when the server starts: a "
            "missing or unreadable file, a file without PEM, or a key that is not the "
            "certificate's stops the start (status 2) with the key and the path",
        ),
    )
    key_file: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=PATH,
            default=REQUIRED,
            doc="the certificate's PEM private key, unencrypted",
        ),
    )
    client_ca_file: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=OPTIONAL_PATH,
            doc="PEM CA bundle: mTLS, every client must present a certificate signed by it (a "
            "client without one fails its TLS handshake)",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)
        cert, key, ca = self.cert_file, self.key_file, self.client_ca_file
        # A certificate without its key (or a key alone) cannot serve TLS; a CA without TLS
        # would look like mTLS while the port stays plaintext.
        if cert and not key:
            raise ConfigError(f"key_file: required with cert_file {cert!r}")
        if key and not cert:
            raise ConfigError(f"cert_file: required with key_file {key!r}")
        if ca and not cert:
            raise ConfigError(f"cert_file: required with client_ca_file {ca!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


def _seconds(minimum: float, doc: str, why: str = "") -> dict[str, Option]:
    return option(Number(minimum), read=NUMBER, doc=doc, why=why, accepts=f"seconds >= {minimum:g}")


@dataclass(frozen=True)
class LimitsSpec:
    """Bounds on what clients may ask of a serving process (docs/configuration.md, limits)."""

    max_request_bytes: int = field(
        default=64 * 1024,
        metadata=option(
            Size(),
            Rule(
                lambda v: v >= MIN_REQUEST_BYTES,
                "at least 1KiB",
                "{value} bytes cannot hold a request; expected at least 1KiB",
            ),
            read=SIZE,
            doc="larger requests are refused with `RESOURCE_EXHAUSTED` before they are buffered "
            "(`grpc.max_receive_message_length`). Without it a 256 MiB request took a server to "
            "2.8 GB. Replies (batches) keep a 1 GiB limit",
            why="a request is a job name and a few integers (tens of bytes): 64 KiB leaves room "
            "for any job name while a client can no longer make the server buffer a gigabyte",
        ),
    )
    max_concurrent_rpcs: int = field(
        default=1024,
        metadata=option(
            Integer(minimum=1),
            doc="calls in flight at once, unary calls and open streams together "
            "(`maximum_concurrent_rpcs` of the gRPC server); a call past it gets "
            "`RESOURCE_EXHAUSTED` at once, which the client library does not retry (but for "
            "the next piece of a stream of small batches, opened again once the piece before "
            "it has ended). Also what bounds the memory of stalled streams ([limits](#limits)); "
            "set it to at least the ranks served × 3 (a stream's two pieces and a retry)",
            why="holds one stream per rank of a large run on one process with room for retries",
        ),
    )
    max_streams_per_connection: int = field(
        default=256,
        metadata=option(
            Integer(minimum=1),
            doc="HTTP/2 streams open on one connection (`grpc.max_concurrent_streams`); a client "
            "that opens more waits for one to end instead of piling calls on one connection",
        ),
    )
    keepalive_seconds: float = field(
        default=60.0,
        metadata=_seconds(
            1.0,
            doc="the server pings a connection after this long without traffic "
            "(`grpc.keepalive_time_ms`)",
            why="a vanished client's connection and its calls go away within a minute and 20 s",
        ),
    )
    keepalive_timeout_seconds: float = field(
        default=20.0,
        metadata=_seconds(
            1.0,
            doc="and closes it if no answer comes in this long (`grpc.keepalive_timeout_ms`)",
            why="see keepalive_seconds",
        ),
    )
    min_ping_seconds: float = field(
        default=5.0,
        metadata=_seconds(
            0.0,
            doc="clients' own keepalive pings are accepted as often as this, even without calls "
            "(`grpc.http2.min_ping_interval_without_data_ms`, "
            "`grpc.keepalive_permit_without_calls`, and no ping strikes)",
            why="a client configured to ping is never disconnected with `too_many_pings`",
        ),
    )
    idle_seconds: float = field(
        default=600.0,
        metadata=_seconds(
            1.0,
            doc="a connection without calls for this long is closed "
            "(`grpc.max_connection_idle_ms`); clients reconnect when they next call",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class AuthSpec:
    """Bearer tokens every call but the health checks must carry (auth.py). The accepted set is
    the union of the file's tokens and the variable's."""

    tokens_file: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            read=OPTIONAL_PATH,
            doc="bearer tokens, one per line with `#` comments ([format](#tokens-file)); re-read "
            "when its modification time, size or inode changes, looked at no more than once a "
            "second, so rotation needs no restart (there is no SIGHUP handling)",
        ),
    )
    tokens_env: str = field(
        default="",
        metadata=option(
            Text(empty=True),
            Rule(lambda v: not v or ENV_NAME.fullmatch(v), "the name of an environment variable"),
            read=TEXT_OR_NONE,
            doc="the name of an environment variable holding tokens (separated by newlines or "
            "spaces, same `token[:jobs]` form), read once at start; accepted together with the "
            "file's",
        ),
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.tokens_env)
