"""A real gRPC server in front of a real tokenfeed server, for the states that are hard to hold
still in a real one: a subclass's `_gate` runs before each GetBatch and StreamBatches call is
forwarded and may answer it otherwise (abort, hold); the other calls are forwarded as they
are."""

from __future__ import annotations

import grpc
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc


class Forwarder(pb_grpc.TokenFeedServicer):
    """Forwards every call to `upstream` ("host:port" of a tokenfeed server)."""

    def __init__(self, upstream: str):
        self._channel = grpc.insecure_channel(
            upstream, options=[("grpc.max_receive_message_length", 1 << 30)]
        )
        self._stub = pb_grpc.TokenFeedStub(self._channel)

    def _gate(self, context) -> None:
        """Before a GetBatch or StreamBatches call is forwarded: nothing here."""

    def GetBatch(self, request, context):
        self._gate(context)
        return self._stub.GetBatch(request)

    def StreamBatches(self, request, context):
        self._gate(context)
        yield from self._stub.StreamBatches(request)

    def DescribeJob(self, request, context):
        return self._stub.DescribeJob(request)

    def ListJobs(self, request, context):
        return self._stub.ListJobs(request)

    def Explain(self, request, context):
        return self._stub.Explain(request)

    def GetPlan(self, request, context):
        return self._stub.GetPlan(request)

    def AmendPlan(self, request, context):
        return self._stub.AmendPlan(request)

    def close_upstream(self) -> None:
        self._channel.close()
