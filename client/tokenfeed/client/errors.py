"""The client's exceptions, mapped back from gRPC status codes.

TokenfeedClientError            (.code: the grpc.StatusCode, .retryable)
├── InvalidRequest              INVALID_ARGUMENT: fix the request (message says how)
├── JobNotFound                 NOT_FOUND
├── JobFailed                   FAILED_PRECONDITION: the job cannot serve (bad data, strict)
├── Unavailable                 UNAVAILABLE: server down, draining, or job still indexing
└── DeadlineExceeded            DEADLINE_EXCEEDED
"""

from __future__ import annotations

import grpc


class TokenfeedClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable = False

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after: float = 0.0):
        super().__init__(message)
        if code is not None:
            self.code = code
        # Seconds the server asked us to wait before asking it again (its
        # grpc-retry-pushback-ms trailer, e.g. while the step's chunks are being built).
        self.retry_after = retry_after


class InvalidRequest(TokenfeedClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class JobNotFound(TokenfeedClientError):
    code = grpc.StatusCode.NOT_FOUND


class JobFailed(TokenfeedClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(TokenfeedClientError):
    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DeadlineExceeded(TokenfeedClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class JobMismatch(TokenfeedClientError):
    """Batches of one job came with two different job fingerprints: the servers' configs (or
    the checkpoint and the servers) define the job differently. Never retried: mixing them
    would silently change the data."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE = {
    cls.code: cls for cls in (InvalidRequest, JobNotFound, JobFailed, Unavailable, DeadlineExceeded)
}


def from_rpc_error(err: grpc.RpcError, server: str = "") -> TokenfeedClientError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, TokenfeedClientError)
    where = f" (from {server})" if server else ""
    return cls(f"{code.name}: {details}{where}", code, pushback(err))


PUSHBACK_KEY = "grpc-retry-pushback-ms"


def pushback(err: grpc.RpcError) -> float:
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
