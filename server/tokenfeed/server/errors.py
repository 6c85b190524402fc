"""Domain errors. The service edge maps each class to one gRPC status code (service.py).

TokenfeedError
├── ConfigError            a config file or value is invalid               (INVALID_ARGUMENT)
│   └── CacheBusyError     the cache directory belongs to another process
├── RequestError           a request cannot be served as asked             (INVALID_ARGUMENT)
├── UnknownJobError        no job of that name                             (NOT_FOUND)
├── NotReadyError          the index a request needs is still being built  (UNAVAILABLE)
├── JobFailedError         the job cannot serve at all; says why           (FAILED_PRECONDITION)
├── SourceError            a source object cannot be listed or read        (FAILED_PRECONDITION)
│   └── SourceChangedError an object changed after its version was pinned
├── BadRecordError         a record is malformed and the policy is strict  (FAILED_PRECONDITION)
├── CacheTooSmallError     the cache budget cannot hold a job's working set (FAILED_PRECONDITION)
├── PlanFrozenError        a plan change at a step the plan is final through (FAILED_PRECONDITION)
├── PlanChangedError       the plan changed since the version a change expected     (ABORTED)
├── StoreCorruptError      a stored token chunk failed verification        (internal: rebuilt)
├── LocalError             this server cannot do it now; another may       (UNAVAILABLE)
│   ├── CacheFullError     pinned entries leave no room under the budget
│   ├── ObjectStoreError   object storage failed after every retry
│   └── SupervisorUnavailable  a serving worker's supervisor does not answer
└── Signal                 inside the server only: caught where it is raised (never a status)
    ├── NotBuiltError      a step's chunks are not built yet (wait, then NotReadyError)
    ├── ChunkMissing       a chunk's body is not in the cache (evicted, never built): build it
    └── BuildCancelled     the server is shutting down; the chunk being made is abandoned

SourceError also has StoreMismatchError: the shared store holds a dataset of the same name made
from other inputs.
"""

from __future__ import annotations


class TokenfeedError(Exception):
    """Base of every error tokenfeed raises on purpose."""


class ConfigError(TokenfeedError):
    pass


class CacheBusyError(ConfigError):
    """Another process owns the cache directory (its lock file names the pid)."""


class RequestError(TokenfeedError):
    pass


class UnknownJobError(TokenfeedError):
    pass


class NotReadyError(TokenfeedError):
    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after  # seconds; sent as the grpc-retry-pushback-ms trailer


class JobFailedError(TokenfeedError):
    pass


class SourceError(TokenfeedError):
    pass


class SourceChangedError(SourceError):
    pass


class StoreMismatchError(SourceError):
    """The shared store holds a dataset of the same name made from other inputs."""


class BadRecordError(TokenfeedError):
    """A malformed record under the `strict` policy; the message carries its location."""


class CacheTooSmallError(TokenfeedError):
    """The message gives the bytes needed and the budget (server.cache_bytes)."""


class PlanFrozenError(TokenfeedError):
    """A change of a job's data plan at a step it can no longer change (served, or frozen
    ahead of what servers serve); the message names the horizon and the furthest step served."""


class PlanChangedError(TokenfeedError):
    """The plan is at another version than the one a change was made against: read it again."""


class StoreCorruptError(TokenfeedError):
    pass


class LocalError(TokenfeedError):
    """A failure of this server (its disk, its network path), retried here while clients are
    sent elsewhere."""


class CacheFullError(LocalError):
    pass


class ObjectStoreError(LocalError):
    pass


class SupervisorUnavailable(LocalError):
    """A serving worker's supervisor cannot do it now (restarting, still listing, its disk):
    UNAVAILABLE to clients, retried by the worker's index build."""


class Signal(TokenfeedError):
    """Control flow inside the server, caught where it is raised; one that escaped would be a
    bug, answered INTERNAL."""


class NotBuiltError(Signal):
    """A step's chunks are not built yet: the request waits, then gets NotReadyError."""

    def __init__(self, why: tuple[str, float]):
        super().__init__(why[0])
        self.retry_after = why[1]


class ChunkMissing(Signal):
    """The chunk's body is not in the cache (evicted, or never built): build it."""


class BuildCancelled(Signal):
    """The server is shutting down; the chunk being tokenized is abandoned (nothing stored)."""
