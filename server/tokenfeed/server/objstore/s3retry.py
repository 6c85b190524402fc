"""Every S3 request retried with exponential backoff and full jitter: on throttling (503
SlowDown, 429), other 5xx, timeouts, resets and short bodies. Other errors raise at once, as
domain errors: a changed or gone object `SourceChangedError`, the rest `SourceError`. Each
attempt is timed and counted once, with its outcome and, when it failed, its reason.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import botocore.exceptions as bce
from tokenfeed.server.errors import ObjectStoreError, SourceChangedError, SourceError
from tokenfeed.server.settings.config import ObjectStoreSpec
from tokenfeed.server.telemetry import metrics
from urllib3.exceptions import HTTPError as Urllib3Error

log = logging.getLogger(__name__)

T = TypeVar("T")

_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "503",
    "429",
}
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "500",
    "502",
    "503",
    "504",
}
_NETWORK_ERRORS = (
    bce.ConnectionError,
    bce.HTTPClientError,
    bce.ReadTimeoutError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    Urllib3Error,
    ConnectionError,
    TimeoutError,
)


def network_reason(e: BaseException) -> str:
    """A body cut short surfaces as a streaming or incomplete-read error (from botocore or
    urllib3, possibly chained); a timeout names itself; the rest are resets and refusals."""
    chain: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(chain) < 5:
        chain.append(type(cause).__name__.lower())
        cause = cause.__cause__ or cause.__context__
    if any("incompleteread" in n or "streaming" in n for n in chain):
        return "short_body"
    return "timeout" if any("timeout" in n for n in chain) else "reset"


class Retry(Exception):
    """Raised by an attempt for a failure worth another attempt (a short body, say)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class RetryPolicy:
    """`object_store`'s retry settings, applied to one request at a time (thread-safe)."""

    def __init__(self, spec: ObjectStoreSpec):
        self.spec = spec
        self._random = random.Random()
        self._random_lock = threading.Lock()

    def call(self, op: str, what: str, attempt: Callable[[], T]) -> T:
        """Run one request with our retry policy; `what` names the object for errors."""
        spec = self.spec
        for n in range(1, spec.max_attempts + 1):
            start = time.monotonic()
            try:
                result = attempt()
            except Retry as e:
                reason, detail = e.reason, str(e)
            except bce.ClientError as e:
                reason, detail = classify(e, what)
            except _NETWORK_ERRORS as e:
                reason, detail = network_reason(e), f"{type(e).__name__}: {e}"
            else:
                metrics.OBJECT_SECONDS.labels(op).observe(time.monotonic() - start)
                metrics.OBJECT_REQUESTS.labels(op, "ok").inc()
                return result
            metrics.OBJECT_SECONDS.labels(op).observe(time.monotonic() - start)
            if n == spec.max_attempts:
                metrics.OBJECT_REQUESTS.labels(op, "error").inc()
                metrics.OBJECT_ERRORS.labels(reason).inc()
                raise ObjectStoreError(
                    f"{op} {what} failed {n} times, last: {reason} ({detail}); "
                    f"object_store.max_attempts is {spec.max_attempts}"
                )
            metrics.OBJECT_REQUESTS.labels(op, "retried").inc()
            metrics.OBJECT_RETRIES.labels(reason).inc()
            with self._random_lock:
                jitter = self._random.random()
            pause = min(spec.backoff_max_seconds, spec.backoff_base_seconds * 2 ** (n - 1))
            log.info("%s %s: %s (%s); retry %d in %.2fs", op, what, reason, detail, n, pause)
            time.sleep(pause * jitter)
        raise AssertionError("unreachable")


def classify(e: bce.ClientError, what: str) -> tuple[str, str]:
    """(retry reason, detail) for a retryable error; raises for the others."""
    err = e.response.get("Error", {})
    code = str(err.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    detail = f"HTTP {status} {code}: {err.get('Message', '')}".strip()
    if code in _THROTTLED or status in (429, 503):
        return "throttled", detail
    if code in _TRANSIENT_CODES or status >= 500:
        return "server_error", detail
    metrics.OBJECT_ERRORS.labels("client_error").inc()
    if status == 412 or code == "PreconditionFailed":
        raise SourceChangedError(
            f"source {what} changed after it was pinned (its ETag no longer matches); "
            "restart the job on a stable corpus"
        ) from e
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
        raise SourceChangedError(f"source {what} is gone ({detail})") from e
    raise SourceError(f"{what}: {detail}") from e
