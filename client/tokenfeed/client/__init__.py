"""tokenfeed's client: deterministic token batches as numpy arrays, over gRPC.

Light by design: imports grpcio, protobuf and numpy only, never the server's dependencies.

    from tokenfeed.client import Client
    feed = Client("localhost:50051", job="demo")
    batch = feed.get_batch(step, rank=rank, world_size=world_size)
"""

from tokenfeed.client._client import Batch, Client
from tokenfeed.client.errors import (
    DeadlineExceeded,
    InvalidRequest,
    JobFailed,
    JobNotFound,
    TokenfeedClientError,
    Unavailable,
)
from tokenfeed.client.wire import WireError

__all__ = [
    "Batch", "Client", "DeadlineExceeded", "InvalidRequest", "JobFailed", "JobNotFound",
    "TokenfeedClientError", "Unavailable", "WireError",
]  # fmt: skip
