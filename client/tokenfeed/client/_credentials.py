"""How the client proves who it is: TLS (mTLS with a client certificate) and a bearer token.

Over TLS the token travels as gRPC call credentials, which gRPC sends over secure channels only;
over a plaintext channel (a sidecar on localhost) it travels as plain per-call metadata. Either
way the server reads `authorization: Bearer <token>`. Every server of a fleet gets the same
credentials.

A `dns:///name:port` target is resolved to addresses by the client (fleet.py) and each address
gets its own channel, so the certificate is checked against `name` (`tls_server_name` to
choose another): a Kubernetes Service's certificate names the Service, not its pods' IPs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from tokenfeed.client.fleet import parse_target

Pem = str | os.PathLike[str] | bytes
# A rotated token file is seen within this long; a stat() per second per client costs nothing.
RELOAD_SECONDS = 1.0


def _pem(value: Pem, option: str) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as e:
        raise ValueError(f"{option}: cannot read {str(value)!r}: {e.strerror}") from None


def _checked(token: str, source: str) -> str:
    token = token.strip()
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"{source}: expected one token of visible ASCII characters (the token "
            "alone, without 'Bearer ')"
        )
    return token


class TokenSource:
    """A bearer token: a fixed string, or a file re-read when it changes (looked at no more
    than once a second), so a rotated Kubernetes Secret reaches a running trainer."""

    def __init__(self, token: str | None = None, path: str | os.PathLike[str] | None = None):
        self.path = os.fspath(path) if path is not None else None
        self._lock = threading.Lock()
        self._checked = -float("inf")
        self._stamp: tuple[int, int, int] | None = None
        if self.path is None:
            self._token = _checked(token or "", "token")
        else:
            try:
                self._stamp, self._token = self._read(self.path)
            except OSError as e:
                raise ValueError(f"token_file: cannot read {self.path!r}: {e.strerror}") from None
            self._checked = time.monotonic()

    @staticmethod
    def _read(path: str) -> tuple[tuple[int, int, int], str]:
        st = os.stat(path)
        text = Path(path).read_text(encoding="ascii", errors="replace")
        return (st.st_mtime_ns, st.st_size, st.st_ino), _checked(text, f"token_file {path}")

    def value(self) -> str:
        if self.path is None:
            return self._token
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= RELOAD_SECONDS:
                self._checked = now
                try:
                    st = os.stat(self.path)
                    if (st.st_mtime_ns, st.st_size, st.st_ino) != self._stamp:
                        self._stamp, self._token = self._read(self.path)
                except (OSError, ValueError):
                    pass  # mid-rotation (missing or half written): keep the last good token
            return self._token


class _TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, source: TokenSource):
        self.source = source

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        try:
            callback((("authorization", f"Bearer {self.source.value()}"),), None)
        except Exception as e:  # reported to the call as UNAVAILABLE by grpc
            callback((), e)


class Credentials:
    """The channel credentials, channel options and per-call metadata of one client."""

    def __init__(
        self,
        target: str,
        *,
        tls: bool | None = None,
        tls_root_certs: Pem | None = None,
        tls_client_cert: Pem | None = None,
        tls_client_key: Pem | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
    ):
        given = [
            name
            for name, value in (
                ("tls_root_certs", tls_root_certs),
                ("tls_client_cert", tls_client_cert),
                ("tls_client_key", tls_client_key),
                ("tls_server_name", tls_server_name),
            )
            if value is not None
        ]
        if tls is False and given:
            raise ValueError(f"tls=False contradicts {', '.join(given)}")
        self.tls = bool(tls) or bool(given)
        if (tls_client_cert is None) != (tls_client_key is None):
            raise ValueError("tls_client_cert and tls_client_key go together (mTLS)")
        if token is not None and token_file is not None:
            raise ValueError("pass token or token_file, not both")
        given_token = token is not None or token_file is not None
        self.token = TokenSource(token, token_file) if given_token else None
        self.options: list[tuple[str, str]] = []
        self.channel_credentials: grpc.ChannelCredentials | None = None
        if not self.tls:
            return
        if tls_server_name is None:
            kind, names = parse_target(target)
            if kind == "dns":
                tls_server_name = names[0].rpartition(":")[0].strip("[]")
        if tls_server_name:
            self.options.append(("grpc.ssl_target_name_override", tls_server_name))
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem(tls_root_certs, "tls_root_certs") if tls_root_certs else None,
            private_key=_pem(tls_client_key, "tls_client_key") if tls_client_key else None,
            certificate_chain=_pem(tls_client_cert, "tls_client_cert") if tls_client_cert else None,
        )
        if self.token is not None:
            call = (
                grpc.access_token_call_credentials(self.token.value())
                if self.token.path is None
                else grpc.metadata_call_credentials(_TokenPlugin(self.token))
            )
            creds = grpc.composite_channel_credentials(creds, call)
        self.channel_credentials = creds

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Per-call metadata: the token on a plaintext channel (over TLS the call credentials
        carry it)."""
        if self.token is None or self.tls:
            return None
        return (("authorization", f"Bearer {self.token.value()}"),)

    def channel(self, addr: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if self.channel_credentials is None:
            return grpc.insecure_channel(addr, options=options)
        return grpc.secure_channel(addr, self.channel_credentials, options=options + self.options)

    def aio_channel(self, addr: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.channel_credentials is None:
            return grpc.aio.insecure_channel(addr, options=options)
        return grpc.aio.secure_channel(
            addr, self.channel_credentials, options=options + self.options
        )
