"""tokenfeed's client: deterministic token batches as numpy arrays, over gRPC.

Light by design: imports grpcio, protobuf, numpy and xxhash only, never the server's dependencies
(`tokenfeed.client.torch` and `tokenfeed.client.jax` import their frameworks when used).

    from tokenfeed.client import Client
    feed = Client("dns:///tokenfeed.data.svc:50051", job="run3")
    batch = feed.get_batch(step, rank=rank, world_size=world_size)
"""

# Before anything imports grpc: how grpc reads this process's sockets (_grpcsetting.py).
from tokenfeed.client._grpcsetting import choose as _choose_grpc_setting
from tokenfeed.client._grpcsetting import grpc_setting

_choose_grpc_setting()

from tokenfeed.client._aio import AsyncClient
from tokenfeed.client._client import Client
from tokenfeed.client.batch import Batch, microbatches, varlen
from tokenfeed.client.errors import (
    DeadlineExceeded,
    InvalidRequest,
    JobFailed,
    JobMismatch,
    JobNotFound,
    PlanConflict,
    PlanRewritten,
    TokenfeedClientError,
    Unavailable,
    WireError,
)
from tokenfeed.client.memory import keep_freed_memory

__all__ = [
    "AsyncClient",
    "Batch",
    "Client",
    "DeadlineExceeded",
    "InvalidRequest",
    "JobFailed",
    "JobMismatch",
    "JobNotFound",
    "PlanConflict",
    "PlanRewritten",
    "TokenfeedClientError",
    "Unavailable",
    "WireError",
    "grpc_setting",
    "keep_freed_memory",
    "microbatches",
    "varlen",
]
