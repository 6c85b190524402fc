"""Domain errors as gRPC statuses, mapped once, here; requests whose bytes are not their
message; names as error messages quote them."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError
from tokenfeed.server import errors

log = logging.getLogger(__name__)

STATUS = {
    errors.RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownJobError: grpc.StatusCode.NOT_FOUND,
    errors.NotReadyError: grpc.StatusCode.UNAVAILABLE,
    errors.JobFailedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SourceError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.BadRecordError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.CacheTooSmallError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PlanFrozenError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PlanChangedError: grpc.StatusCode.ABORTED,
    errors.StoreCorruptError: grpc.StatusCode.UNAVAILABLE,
    errors.LocalError: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, exc: Exception, method: str):
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        message = str(exc)
    retry_after = getattr(exc, "retry_after", 0.0)
    if retry_after:  # the standard hint gRPC's own retry policy honours
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(int(retry_after * 1000))),))
    await context.abort(code, message)


class Malformed:
    """A request whose bytes are not the message (truncated, mutated, invalid UTF-8 in a
    string): deserialized as this, so the servicer answers INVALID_ARGUMENT saying so."""

    job = None  # what the auth interceptor's job check reads

    def __init__(self, what: str, error: Exception):
        self.why = f"malformed {what}: {str(error)[:200]}"


def parse_request(message):
    def parse(data: bytes):
        try:
            return message.FromString(data)
        except DecodeError as e:
            return Malformed(message.DESCRIPTOR.name, e)

    return parse


def well_formed(request) -> None:
    if isinstance(request, Malformed):
        raise errors.RequestError(request.why)


MAX_NAME_IN_MESSAGES = 64


def shown(name: str) -> str:
    """A name as error messages quote it: cut when long, so no message echoes a huge input."""
    if len(name) <= MAX_NAME_IN_MESSAGES:
        return repr(name)
    return f"{name[:MAX_NAME_IN_MESSAGES]!r}… ({len(name)} characters)"
