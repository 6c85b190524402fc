"""What the serving port accepts: TLS, bearer tokens, and bounds on what clients may ask.

Checked on construction like every spec (configcheck.py); auth.py reads the files they name
when the server starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings import configcheck as check

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class TlsSpec:
    """TLS on the gRPC port; auth.py reads and checks the files when the server starts."""

    cert_file: str = ""  # PEM certificate chain; empty: no TLS
    key_file: str = ""  # PEM private key of the certificate, unencrypted
    # PEM CA bundle: when set, every client must present a certificate it signed (mTLS).
    client_ca_file: str = ""

    def __post_init__(self) -> None:
        cert = check.text("cert_file", self.cert_file, empty=True)
        key = check.text("key_file", self.key_file, empty=True)
        ca = check.text("client_ca_file", self.client_ca_file, empty=True)
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


@dataclass(frozen=True)
class LimitsSpec:
    """Bounds on what clients may ask of a serving process (docs/configuration.md, limits)."""

    # Requests are a job name and a few integers: tens of bytes. 64 KiB leaves room for any
    # job name while a client can no longer make the server buffer a gigabyte.
    max_request_bytes: int = 64 * 1024
    # RPCs in flight at once (unary calls and open streams together); past it, RESOURCE_
    # EXHAUSTED. 1024: every rank of a large run on one server, with room for retries.
    max_concurrent_rpcs: int = 1024
    # HTTP/2 streams per connection: a client multiplexing more waits for one to finish.
    max_streams_per_connection: int = 256
    # Server pings an idle connection every keepalive_seconds and drops it if no answer comes
    # in keepalive_timeout_seconds; clients may ping as often as every min_ping_seconds.
    keepalive_seconds: float = 60.0
    keepalive_timeout_seconds: float = 20.0
    min_ping_seconds: float = 5.0
    # A connection with no call for this long is closed (the client reconnects when needed).
    idle_seconds: float = 600.0

    def __post_init__(self) -> None:
        size = check.size("max_request_bytes", self.max_request_bytes)
        if size < 1024:
            raise ConfigError(
                f"max_request_bytes: {size} bytes cannot hold a request; expected at least 1KiB"
            )
        check.integer("max_concurrent_rpcs", self.max_concurrent_rpcs, minimum=1)
        check.integer("max_streams_per_connection", self.max_streams_per_connection, minimum=1)
        check.float_field(self, "keepalive_seconds", minimum=1.0)
        check.float_field(self, "keepalive_timeout_seconds", minimum=1.0)
        check.float_field(self, "min_ping_seconds", minimum=0.0)
        check.float_field(self, "idle_seconds", minimum=1.0)


@dataclass(frozen=True)
class AuthSpec:
    """Bearer tokens every call but the health checks must carry (auth.py). The accepted set is
    the union of the file's tokens and the variable's."""

    tokens_file: str = ""  # one token per line, `#` comments; re-read when it changes
    tokens_env: str = ""  # the name of an environment variable holding tokens, read at start

    def __post_init__(self) -> None:
        check.text("tokens_file", self.tokens_file, empty=True)
        env = check.text("tokens_env", self.tokens_env, empty=True)
        if env and not ENV_NAME.fullmatch(env):
            raise check.fail("tokens_env", "the name of an environment variable", env)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file or self.tokens_env)
