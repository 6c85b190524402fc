"""The synchronous client: one job, batches as numpy arrays.

Retries: only UNAVAILABLE (a server restarting, draining, or a job still indexing) is retried,
with exponential backoff and jitter, until the call's overall timeout. A stream that breaks with
a retryable status resumes at the next step it has not yet delivered: batches are a pure
function of the step, so the resumed stream is the same stream.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping

import grpc
import numpy as np
from google.protobuf import json_format
from tokenfeed.client.errors import TokenfeedClientError, from_rpc_error
from tokenfeed.client.wire import decode_tensors
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
]


class Batch(Mapping[str, np.ndarray]):
    """One rank's slice of a step: read-only numpy arrays of shape [rows, seq_len], int32."""

    __slots__ = ("_arrays", "job", "step", "rank", "world_size", "epoch", "fingerprint")

    def __init__(self, msg: pb.Batch, verify: bool):
        self._arrays = decode_tensors(msg.tensors, msg.fingerprint if verify else None)
        self.job, self.step, self.rank = msg.job, msg.step, msg.rank
        self.world_size, self.epoch, self.fingerprint = msg.world_size, msg.epoch, msg.fingerprint

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self._arrays.items()}
        return f"Batch(job={self.job!r}, step={self.step}, rank={self.rank}, shapes={shapes})"


class Client:
    """`Client("host:port", job="name")`; the target is any gRPC target string."""

    def __init__(
        self,
        target: str,
        job: str | None = None,
        *,
        timeout: float = 60.0,
        verify: bool = True,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
    ):
        self.target, self.job, self.timeout, self.verify = target, job, timeout, verify
        self._backoff, self._max_backoff = backoff, max_backoff
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.TokenFeedStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _job(self, job: str | None) -> str:
        name = job or self.job
        if not name:
            raise ValueError("no job: pass job= to Client(...) or to the call")
        return name

    def _call(self, method, request, timeout: float | None):
        deadline = time.monotonic() + (timeout or self.timeout)
        delay = self._backoff
        while True:
            remaining = deadline - time.monotonic()
            try:
                return method(request, timeout=max(remaining, 0.001))
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if not err.retryable or time.monotonic() + delay >= deadline:
                    raise err from None
            time.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self._max_backoff)

    def get_batch(
        self, step: int, rank: int = 0, world_size: int = 1, *, job: str | None = None,
        timeout: float | None = None,
    ) -> Batch:  # fmt: skip
        request = pb.GetBatchRequest(job=self._job(job), step=step, rank=rank,
                                     world_size=world_size)  # fmt: skip
        return Batch(self._call(self._stub.GetBatch, request, timeout), self.verify)

    def iter_batches(
        self, start_step: int = 0, end_step: int | None = None, rank: int = 0,
        world_size: int = 1, *, job: str | None = None, max_resumes: int = 10,
    ) -> Iterator[Batch]:  # fmt: skip
        """Steps [start_step, end_step) over one pipelined server stream (None: unbounded)."""
        step, resumes = start_step, 0
        while end_step is None or step < end_step:
            request = pb.StreamBatchesRequest(job=self._job(job), start_step=step,
                                              end_step=end_step or 0, rank=rank,
                                              world_size=world_size)  # fmt: skip
            stream = self._stub.StreamBatches(request)
            try:
                for msg in stream:
                    yield Batch(msg, self.verify)
                    step = msg.step + 1
                return
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                resumes += 1
                if not err.retryable or resumes > max_resumes:
                    raise err from None
                time.sleep(min(self._backoff * 2**resumes, self._max_backoff))
            finally:
                stream.cancel()

    def describe(self, job: str | None = None) -> dict:
        info = self._call(self._stub.DescribeJob, pb.DescribeJobRequest(job=self._job(job)), None)
        return _to_dict(info)

    def list_jobs(self) -> list[dict]:
        return [
            _to_dict(j) for j in self._call(self._stub.ListJobs, pb.ListJobsRequest(), None).jobs
        ]


def _to_dict(msg) -> dict:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


__all__ = ["Batch", "Client", "TokenfeedClientError"]
