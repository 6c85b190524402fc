"""Who may call: TLS credentials for the gRPC port, and bearer tokens checked by an interceptor.

A call must carry `authorization: Bearer <token>` metadata with one of the server's tokens,
except the health checks (`grpc.health.v1.Health/Check` and `Watch`), which probes and load
balancers make without one. Server reflection needs a token like the TokenFeed API.

Tokens come from `server.auth.tokens_file` (re-read when its modification time, size or inode
changes, looked at no more than once a second, so a rotated file takes effect without a
restart) and `server.auth.tokens_env` (read once, at start). A line `token:job1,job2` limits a
token to those jobs: its calls for any other job get PERMISSION_DENIED. The scope `+admin`
(`token:+admin`, or `token:job1,+admin`) lets a token change a job's data plan (AmendPlan);
without it that call gets PERMISSION_DENIED.

Tokens are compared as SHA-256 digests with `hmac.compare_digest`, against every token each
time: neither the content nor the length of a configured token shows in the time a refusal
takes.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import AuthSpec, TlsSpec

log = logging.getLogger(__name__)

# Reachable without a token: the kubelet's gRPC probes and load balancers send none.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Calls that change what is served: a token needs the admin scope for them.
ADMIN_METHODS = frozenset({"/tokenfeed.v1.TokenFeed/AmendPlan"})
ADMIN = "+admin"
# A rotated file is seen within this long; a stat() per second costs nothing measurable.
RELOAD_SECONDS = 1.0
# Refusals are logged at most this often (with a count), so a misconfigured client cannot
# flood the log.
LOG_EVERY_SECONDS = 10.0
# Visible ASCII without the separators of the file format (`:`, `,`, `#`).
_TOKEN_RE = re.compile(r"[!-~]+")
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HOW_TO = (
    "send metadata 'authorization: Bearer <token>' with a token from the server's "
    "server.auth (tokenfeed.client: Client(..., token=...) or token_file=...)"
)


# ---------------------------------------------------------------- TLS


def _read_pem(path: str, key: str, origin: str, marker: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{origin}: {key}: cannot read {path!r}: {e.strerror}") from None
    if marker.encode() not in data:
        raise ConfigError(f"{origin}: {key}: {path!r} holds no PEM {marker.strip('-')}")
    return data


def server_credentials(tls: TlsSpec, origin: str = "<config>") -> grpc.ServerCredentials:
    """The gRPC port's credentials; mTLS when `client_ca_file` is set. The files are checked
    here (readable, PEM, the key matching the certificate) because grpc reports any problem
    with them as a failure to bind."""
    cert = _read_pem(tls.cert_file, "server.tls.cert_file", origin, "-----BEGIN CERTIFICATE")
    key = _read_pem(tls.key_file, "server.tls.key_file", origin, "PRIVATE KEY-----")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # The password callback refuses encrypted keys instead of prompting on a terminal.
        context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
    except ssl.SSLError as e:
        raise ConfigError(
            f"{origin}: server.tls.key_file: {tls.key_file!r} is not an unencrypted private key "
            f"of the certificate in server.tls.cert_file {tls.cert_file!r} ({e.reason or e})"
        ) from None
    ca = None
    if tls.client_ca_file:
        key_path = "server.tls.client_ca_file"
        ca = _read_pem(tls.client_ca_file, key_path, origin, "-----BEGIN CERTIFICATE")
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"{origin}: {key_path}: {tls.client_ca_file!r} is not a PEM CA "
                f"bundle ({e.reason or e})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    digest: bytes  # SHA-256 of the token: only digests are kept and compared
    jobs: frozenset[str] | None = None  # None: every job
    admin: bool = False  # may change a job's data plan

    def allows(self, job: str) -> bool:
        return self.jobs is None or job in self.jobs


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, where: str) -> list[Token]:
    """The tokens of a file (or variable): one per line, `token` or `token:job1,job2`; `#`
    starts a comment; blank lines are skipped. Errors name the line, never the token."""
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        secret, sep, scope = line.partition(":")
        if not _TOKEN_RE.fullmatch(secret) or "," in secret:
            raise ConfigError(
                f"{where} line {n}: expected a token of visible ASCII "
                "characters without ':', ',' or '#', then optionally "
                ":job1,job2"
            )
        jobs, admin = None, False
        if sep:
            items = [j.strip() for j in scope.split(",")]
            admin = ADMIN in items
            names = [j for j in items if j != ADMIN]
            bad = [j for j in names if not _JOB_RE.fullmatch(j)]
            if bad:
                raise ConfigError(
                    f"{where} line {n}: expected job names (or {ADMIN}) after ':', got {bad[0]!r}"
                )
            jobs = frozenset(names) if names else None
        tokens.append(Token(digest(secret), jobs, admin))
    return tokens


def match(tokens: list[Token], presented: str) -> Token | None:
    """The token equal to `presented`, comparing against every token (no early exit)."""
    wanted = digest(presented)
    found = None
    for token in tokens:
        if hmac.compare_digest(token.digest, wanted) and found is None:
            found = token
    return found


class TokenSet:
    """The accepted tokens: the file's, re-read when it changes, plus the variable's."""

    def __init__(
        self,
        spec: AuthSpec,
        environ: Mapping[str, str],
        origin: str = "<config>",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = spec.tokens_file
        self._clock = clock
        self._static: list[Token] = []
        self._file: list[Token] = []
        if spec.tokens_env:
            value = environ.get(spec.tokens_env, "")
            where = f"{origin}: server.auth.tokens_env: ${spec.tokens_env}"
            # A variable holds one token per line, or several on one line separated by spaces.
            self._static = parse_tokens("\n".join(value.split()), where)
            if not self._static:
                raise ConfigError(f"{where}: not set or holds no token")
        self._stamp: tuple | None = None
        self._checked = -float("inf")
        if self.path:
            try:
                self._stamp, self._file = self._read()
            except OSError as e:
                raise ConfigError(
                    f"{origin}: server.auth.tokens_file: cannot read {self.path!r}: {e.strerror}"
                ) from None
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
            if not self._file and not self._static:
                raise ConfigError(
                    f"{origin}: server.auth.tokens_file: {self.path!r} holds "
                    "no token: every call would be refused"
                )
            self._checked = clock()

    def _read(self) -> tuple[tuple, list[Token]]:
        st = os.stat(self.path)
        text = Path(self.path).read_text(encoding="utf-8", errors="replace")
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
        return stamp, parse_tokens(text, f"server.auth.tokens_file {self.path}")

    def _refresh(self) -> None:
        now = self._clock()
        if not self.path or now - self._checked < RELOAD_SECONDS:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            if (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev) == self._stamp:
                return
            stamp, tokens = self._read()
        except (OSError, ConfigError) as e:
            # Mid-rotation (a file briefly missing or half written): keep the tokens we have.
            log.warning("server.auth.tokens_file: keeping the previous tokens: %s", e)
            return
        if not tokens:
            log.warning(
                "server.auth.tokens_file: %s holds no token; keeping the previous "
                "tokens (taken for a partly written file)",
                self.path,
            )
            return
        self._stamp, self._file = stamp, tokens
        log.info("server.auth.tokens_file: loaded %d token(s) from %s", len(tokens), self.path)

    def __len__(self) -> int:
        return len(self._static) + len(self._file)

    def check(self, presented: str) -> Token | None:
        self._refresh()
        return match(self._static + self._file, presented)


# ---------------------------------------------------------------- the interceptor


def _bearer(metadata) -> tuple[str | None, str]:
    """(the presented token, "") or (None, why it is refused)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return None, f"missing credentials: {HOW_TO}"
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(values) > 1:
        return None, f"malformed authorization metadata: {HOW_TO}"
    return token, ""


def _rebuilt(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (same (de)serializers) running `behaviour`."""
    if handler.unary_unary:
        make = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        make = grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.stream_stream_rpc_method_handler
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without a valid token (health checks exempt), and
    PERMISSION_DENIED for a job-limited token asking for another job."""

    def __init__(self, tokens: TokenSet, clock: Callable[[], float] = time.monotonic):
        self.tokens = tokens
        self._clock = clock
        self._refused = 0
        self._logged = -float("inf")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        presented, why = _bearer(handler_call_details.invocation_metadata)
        token = self.tokens.check(presented) if presented is not None else None
        if token is None:
            why = why or f"invalid bearer token: not one of this server's tokens; {HOW_TO}"
            return _rebuilt(handler, self._refuse(handler_call_details.method, why))
        method = handler_call_details.method
        if method in ADMIN_METHODS and not token.admin:
            why = (
                f"{method.rsplit('/', 1)[-1]} changes a job's data plan: it needs a token with "
                f"the admin scope (a line `<token>:{ADMIN}` in server.auth.tokens_file)"
            )
            return _rebuilt(handler, _denied(why))
        if token.jobs is not None and (handler.unary_unary or handler.unary_stream):
            return _rebuilt(
                handler, _scoped(handler.unary_unary or handler.unary_stream, token.jobs)
            )
        return handler

    def _refuse(self, method: str, why: str):
        async def refuse(request, context: grpc.aio.ServicerContext):
            self._refused += 1
            now = self._clock()
            if now - self._logged >= LOG_EVERY_SECONDS:
                log.warning(
                    "refused %d unauthenticated call(s); the latest: %s from %s: %s",
                    self._refused,
                    method,
                    context.peer(),
                    why.split(":")[0],
                )
                self._refused, self._logged = 0, now
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return refuse


def _denied(why: str):
    async def deny(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    return deny


def _scoped(behaviour, jobs: frozenset[str]):
    """`behaviour` behind a check of the request's `job` field (requests without one, such as
    ListJobs, pass)."""

    async def check(request, context: grpc.aio.ServicerContext) -> None:
        job = getattr(request, "job", None)
        if job is not None and job not in jobs:
            why = f"this token may read jobs {sorted(jobs)}, not {job!r}"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if inspect.isasyncgenfunction(behaviour):

        async def stream(request, context):
            await check(request, context)
            async for message in behaviour(request, context):
                yield message

        return stream

    async def unary(request, context):
        await check(request, context)
        return await behaviour(request, context)

    return unary
