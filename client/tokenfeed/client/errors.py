"""The client's exceptions: mapped back from gRPC status codes, or raised by the client itself.

TokenfeedClientError            (.code: the grpc.StatusCode, .retryable, .retry_after)
├── InvalidRequest              INVALID_ARGUMENT: fix the request (message says how)
├── JobNotFound                 NOT_FOUND
├── JobFailed                   FAILED_PRECONDITION: the job cannot serve (bad data, strict)
├── JobMismatch                 FAILED_PRECONDITION: two definitions of one job (never retried)
│   ├── PlanRewritten           a checkpoint's steps decided otherwise by the plan now (.step)
│   └── PlanConflict            servers of one target hold two plans for a step (.step)
├── Unavailable                 UNAVAILABLE: server down, draining, or job still indexing
├── DeadlineExceeded            DEADLINE_EXCEEDED
└── WireError (+ ValueError)    DATA_LOSS: a batch message that does not decode

This module imports no gRPC: the wire format (wire.py, shared with the server and part of the
pure core) raises WireError without pulling the transport in. Codes are kept by name and turned
into grpc.StatusCode when asked for (by then the caller has grpc loaded anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc


class TokenfeedClientError(Exception):
    status = "UNKNOWN"  # the grpc.StatusCode's name
    retryable = False

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after: float = 0.0):
        super().__init__(message)
        if code is not None:
            self.status = code.name
        # Seconds the server asked us to wait before asking it again (its
        # grpc-retry-pushback-ms trailer, e.g. while the step's chunks are being built).
        self.retry_after = retry_after

    @property
    def code(self) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[self.status]


class InvalidRequest(TokenfeedClientError):
    status = "INVALID_ARGUMENT"


class JobNotFound(TokenfeedClientError):
    status = "NOT_FOUND"


class JobFailed(TokenfeedClientError):
    status = "FAILED_PRECONDITION"


class JobMismatch(TokenfeedClientError):
    """Batches of one job came with two different job fingerprints: the servers' configs (or
    the checkpoint and the servers) define the job differently. Never retried: mixing them
    would silently change the data."""

    status = "FAILED_PRECONDITION"


class PlanRewritten(JobMismatch):
    """A plan that decides a step this run has read otherwise than when it was read: an edited
    past phase, another seed, other sources. `step` is the first such step."""

    def __init__(self, message: str, step: int = -1):
        super().__init__(message)
        self.step = step


class PlanConflict(JobMismatch):
    """Servers of one target hold two plans for a step (their logs differ): `step` is the
    first such step."""

    def __init__(self, message: str, step: int = -1):
        super().__init__(message)
        self.step = step


class Unavailable(TokenfeedClientError):
    status = "UNAVAILABLE"
    retryable = True


class DeadlineExceeded(TokenfeedClientError):
    status = "DEADLINE_EXCEEDED"
    retryable = True


class WireError(TokenfeedClientError, ValueError):
    """A message that does not decode: wrong sizes, unknown dtype, bad fingerprint. Also a
    ValueError, as it was before it joined this hierarchy."""

    status = "DATA_LOSS"


_BY_STATUS: dict[str, type[TokenfeedClientError]] = {
    cls.status: cls
    for cls in (InvalidRequest, JobNotFound, JobFailed, Unavailable, DeadlineExceeded)
}


def from_rpc_error(err: Any, server: str = "") -> TokenfeedClientError:
    """The domain error of a grpc.RpcError (duck-typed: its code(), details() and trailers)."""
    code = err.code() if hasattr(err, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_STATUS.get(name, TokenfeedClientError)
    where = f" (from {server})" if server else ""
    return cls(f"{name}: {details}{where}", code, pushback(err))


PUSHBACK_KEY = "grpc-retry-pushback-ms"


def pushback(err: Any) -> float:
    """The server's retry pushback in seconds (0 when it sent none, or sent garbage)."""
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if trailing else None) or ():
        if key == PUSHBACK_KEY:
            try:
                ms = int(value)
            except ValueError:
                return 0.0
            return max(ms, 0) / 1000
    return 0.0
