"""The sync client's channels: how a stream's batches reach the thread that reads them."""

from __future__ import annotations

from tokenfeed.client import Client
from tokenfeed.v1 import tokenfeed_pb2 as pb


def test_sync_streams_are_read_on_the_reading_thread_itself():
    """StreamBatches is read by the thread that iterates it (the prefetch thread), not handed
    over from gRPC's channel-spin thread: one thread hop less per batch (a third of the
    client's CPU per [8, 2048] batch, bench/ wire section)."""
    with Client("127.0.0.1:1", job="j") as client:
        call = client.stub("127.0.0.1:1").StreamBatches(pb.StreamBatchesRequest(job="j"))
        try:
            # grpc's iterator that polls the call's own completion queue on the caller's thread
            assert type(call).__name__ == "_SingleThreadedRendezvous", type(call)
        finally:
            call.cancel()
