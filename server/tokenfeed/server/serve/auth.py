"""Who may call: bearer tokens (authtokens.py) checked by an interceptor on every call.

A call must carry `authorization: Bearer <token>` metadata with one of the server's tokens,
except the health checks (`grpc.health.v1.Health/Check` and `Watch`), which probes and load
balancers make without one. Server reflection needs a token like the TokenFeed API. A token
limited to some jobs gets PERMISSION_DENIED for any other job; AmendPlan needs a token with the
`+admin` scope, and gets PERMISSION_DENIED without it. The port's TLS credentials are
tlscreds.py's (`server_credentials`, importable from here too).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable

import grpc
from tokenfeed.server.serve.authtokens import ADMIN, TokenSet
from tokenfeed.server.serve.tlscreds import server_credentials

__all__ = ["AuthInterceptor", "TokenSet", "server_credentials"]

log = logging.getLogger(__name__)

# Reachable without a token: the kubelet's gRPC probes and load balancers send none.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Calls that change what is served: a token needs the admin scope for them.
ADMIN_METHODS = frozenset({"/tokenfeed.v1.TokenFeed/AmendPlan"})
# Refusals are logged at most this often (with a count), so a misconfigured client cannot
# flood the log.
LOG_EVERY_SECONDS = 10.0
HOW_TO = (
    "send metadata 'authorization: Bearer <token>' with a token from the server's "
    "server.auth (tokenfeed.client: Client(..., token=...) or token_file=...)"
)


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
