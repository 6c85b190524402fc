"""The synchronous client.

`get_batch` is one unary call; `iter_batches` reads a server stream (StreamBatches,
_prefetch.py): on the trainer's thread by default, while gRPC receives the next batches, or
with `prefetch` N by a thread that keeps up to N decoded batches ready; `warm` starts a stream
before the trainer asks (while it restores a checkpoint). Both fail over along the rendezvous
ranking on UNAVAILABLE or DEADLINE_EXCEEDED and continue from the same step (the policy:
_attempts.py): batches are a pure function of the step, so the sequence is the same whichever
server sends it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import grpc
import grpc.experimental
from google.protobuf import json_format
from tokenfeed.client._attempts import Attempts
from tokenfeed.client._base import ClientBase
from tokenfeed.client._comeback import pause
from tokenfeed.client._plans import check_agreed, check_resume, held, held_too_long, links_of
from tokenfeed.client._prefetch import WARM_STEPS, Prefetcher, Warmed
from tokenfeed.client._session import batch_stub, channel_options
from tokenfeed.client.batch import Batch
from tokenfeed.client.moves import retire
from tokenfeed.v1 import tokenfeed_pb2 as pb
from tokenfeed.v1 import tokenfeed_pb2_grpc as pb_grpc


class Client(ClientBase):
    """`Client("host:port" | "h1:p,h2:p" | "dns:///name:port", job="name", **typed options)`
    (the options: `ClientBase.__init__`)."""

    def _open(self) -> None:
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.TokenFeedStub]] = {}
        self._retired: list[tuple[float, grpc.Channel]] = []  # replaced by `reconnect`
        self._streams: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
        self._warm: dict[tuple[str, int, int], Warmed] = {}
        self._closed = False
        self._lock = threading.Lock()
        # StreamBatches read on the prefetch thread itself, not handed over from gRPC's
        # channel-spin thread: one thread hop less per batch.
        self._channel_options: list[tuple[str, Any]] = [
            *channel_options(self.session.policy),
            (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
        ]

    def stub(self, addr: str) -> pb_grpc.TokenFeedStub:
        with self._lock:
            if self._closed:
                raise ValueError("this Client is closed")
            if addr not in self._stubs:
                channel = self.credentials.channel(addr, self._channel_options)
                self._stubs[addr] = (channel, batch_stub(channel))
            return self._stubs[addr][1]

    def pause(
        self, seconds: float, wake_on: tuple[str, ...], stop: threading.Event | None = None
    ) -> bool:
        """A retry's pause, ended early once one of `wake_on`'s channels comes back
        (_comeback.py); True if `stop` was set meanwhile."""
        with self._lock:
            channels = [self._stubs[a][0] for a in wake_on if a in self._stubs]
        return pause(channels, seconds, stop)

    def reconnect(self, addr: str, stub: pb_grpc.TokenFeedStub) -> None:
        """A new channel to `addr` for the calls that follow, where `stub` is still its stub
        (another thread may have reconnected first): a crowded serving worker asked a stream
        to move (moves.py), and only a new connection reaches another worker. The old channel
        is closed once RETIRE_SECONDS have passed, or with the client: calls on it go on."""
        with self._lock:
            found = self._stubs.get(addr)
            if self._closed or found is None or found[1] is not stub:
                return
            channel = self.credentials.channel(addr, self._channel_options)
            self._stubs[addr] = (channel, batch_stub(channel))
            for old in retire(self._retired, found[0], time.monotonic()):
                old.close()

    def close(self) -> None:
        """Stop every open `iter_batches` stream and warm start, and close the channels."""
        with self._lock:
            self._closed = True
            streams = list(self._streams)
            self._warm.clear()
        for stream in streams:
            stream.close()
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            for _, channel in self._retired:
                channel.close()
            self._stubs.clear()
            self._retired.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(
        self,
        method: str,
        request: Any,
        job: str,
        rank: int,
        timeout: float | None,
        waits: bool = False,
    ) -> tuple[str, Any]:
        metadata = self.credentials.metadata
        attempts = Attempts(self.session, job, rank, metadata, timeout=timeout, waits=waits)
        for action in attempts:
            if isinstance(action, float):
                self.pause(action, attempts.wake_on)
                continue
            try:
                call = getattr(self.stub(action.addr), method)
                return action.addr, call(request, timeout=action.timeout, metadata=action.metadata)
            except grpc.RpcError as e:
                attempts.failed(action, e)
        raise attempts.error()

    def _stream(self, job: str, start: int, end: int | None, rank: int, world: int, depth: int):
        stream = Prefetcher(self, job, start, end, rank, world, depth)
        with self._lock:
            self._streams.add(stream)
        return stream

    def warm(
        self,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        steps: int | None = None,
    ) -> None:
        """Start fetching steps [step, step + steps) (default: `prefetch` steps) in the
        background and return at once: call it as soon as the resume step is known, before
        restoring the checkpoint, and the first `get_batch(step)` or `iter_batches(step)` of
        the same job, rank and world size takes the batches already here."""
        name, count = self._job(job), steps or self.prefetch or WARM_STEPS
        if count < 1:
            raise ValueError(f"steps must be >= 1, got {count}")
        stream = self._stream(name, step, step + count, rank, world_size, count)
        warmed = Warmed(stream, step, step + count)
        with self._lock:
            old = self._warm.pop((name, rank, world_size), None)
            self._warm[(name, rank, world_size)] = warmed
        if old is not None:
            old.close()

    def _warmed(self, job: str, rank: int, world: int, step: int) -> Warmed | None:
        """The warm start of (job, rank, world) if it is at `step`; one at another step is
        dropped (the trainer went elsewhere)."""
        with self._lock:
            warmed = self._warm.pop((job, rank, world), None)
        if warmed is not None and warmed.next_step != step:
            warmed.close()
            return None
        return warmed

    def get_batch(
        self,
        step: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        timeout: float | None = None,
    ) -> Batch:
        name = self._job(job)
        warmed = self._warmed(name, rank, world_size, step)
        if warmed is not None:
            try:
                batch = warmed.take()  # its wait is counted by the stream
            except Exception:  # the warm stream failed: the call's own retries decide
                warmed.close()
            else:
                if warmed.exhausted:
                    warmed.close()
                else:
                    with self._lock:
                        self._warm.setdefault((name, rank, world_size), warmed)
                return self._admit(batch)
        self._hold(name, step)
        asked = time.perf_counter()
        request = pb.GetBatchRequest(job=name, step=step, rank=rank, world_size=world_size)
        addr, msg = self._unary("GetBatch", request, name, rank, timeout, waits=True)
        batch = self._admit(self.session.batch(msg, addr, expected_step=step))
        if self.session.report_waits:
            self.session.waits(name, rank).record(time.perf_counter() - asked)
        return batch

    # ---------------------------------------------------------------- the data plan

    def plan(self, *, job: str | None = None, step: int = 0) -> dict:
        """The job's data plan as a server holds it (GetPlan): its phases with their
        fingerprints, version, frozen horizon, and what each dataset gave the steps before
        `step` (0: before the furthest step its trainers asked for, plus one)."""
        name = self._job(job)
        _, info = self._unary("GetPlan", pb.GetPlanRequest(job=name, step=step), name, 0, None)
        return _to_dict(info)

    def amend_plan(
        self,
        start_step: int,
        *,
        weights: Mapping[str, object] | None = None,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        add: Sequence[Mapping[str, Any]] | None = None,
        expected_version: int = 0,
        job: str | None = None,
        packing: str | None = None,
    ) -> dict:
        """Append a phase to the job's data plan from `start_step` on (AmendPlan; an admin
        token when the servers check tokens): what it leaves out carries over from the phase
        before it (`packing`: "concat" or "best_fit", with or without another `seq_len`).
        Through one server: with a shared store every server follows; without one,
        `tokenfeed plan append` applies a change to each server of a target."""
        name = self._job(job)
        request = self._amend_request(
            name, start_step, weights, global_batch_size, seq_len, add, expected_version, packing
        )
        _, info = self._unary("AmendPlan", request, name, 0, None)
        return _to_dict(info)

    def check_plan(
        self, links: Sequence[tuple[int, str]], next_step: int, *, job: str | None = None
    ) -> None:
        """A checkpoint's plan links (the phases of the steps it read, before `next_step`)
        against a server's plan: PlanRewritten naming the first of those steps it decides
        otherwise; an amendment of later steps is accepted."""
        name = self._job(job)
        info = self.plan(job=name)
        server = tuple((p["start_step"], p["fingerprint"]) for p in info["phases"])
        check_resume(name, tuple(links), next_step, server)

    def plan_links(self, next_step: int, *, job: str | None = None) -> list[list]:
        """The plan links of the steps before `next_step` this client has read, for a
        checkpoint ([[start step, fingerprint], ...])."""
        return [list(link) for link in self.session.plans.links(self._job(job), next_step)]

    def _chains(self, job: str) -> dict[str, tuple[tuple[int, str], ...]]:
        """The plan of each log the servers keep (servers sharing a store keep one: its
        freshest copy speaks for it, a lagging copy is a stale read, not another plan);
        servers that do not answer are left out."""
        newest: dict[str, tuple[int, tuple[tuple[int, str], ...]]] = {}
        for addr in self.session.fleet.addresses():
            try:
                info = self.stub(addr).GetPlan(
                    pb.GetPlanRequest(job=job),
                    timeout=self.session.silence_limit,
                    metadata=self.credentials.metadata(),
                )
            except grpc.RpcError:
                continue
            key = info.log or addr
            if key not in newest or info.version > newest[key][0]:
                newest[key] = (info.version, links_of(info.phases))
        out = {key: chain for key, (_, chain) in newest.items()}
        return out

    def _admit(self, batch: Batch) -> Batch:
        """A batch handed to the trainer only if no two servers of the target hold different
        plans for its step: compared when due (plans.py); held back while they differ, until
        they agree (a rolling change) or the call's timeout passes (PlanConflict)."""
        job = batch.job
        if self.session.plan_check_due(job, self.plan_check_seconds):
            self.session.plans.compare(job, self._chains(job))
        self._hold(job, batch.step, batch)
        return batch

    def _hold(self, job: str, step: int, batch: Batch | None = None) -> None:
        """Returns once no known disagreement of the servers covers `step`. Asked before a
        step is fetched too: a lagging server asked for it would freeze it under its old
        plan, and the change could then never be made there."""
        watch = self.session.plans
        if held(watch, job, step) is None:  # every batch but those of a change under way
            return
        deadline = time.monotonic() + self.session.policy.timeout
        while (conflict := held(watch, job, step)) is not None:
            if time.monotonic() >= deadline or conflict[0] == 0:  # step 0: not a rolling change
                raise held_too_long(job, step, conflict)
            time.sleep(min(1.0, self.session.policy.max_backoff))
            chains = self._chains(job)
            if watch.compare(job, chains) is None and batch is not None:
                check_agreed(job, step, batch.plan_fingerprint, batch.server, chains)

    def iter_batches(
        self,
        start_step: int = 0,
        end_step: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        job: str | None = None,
        prefetch: int | None = None,
    ) -> Generator[Batch, None, None]:
        """Steps [start_step, end_step) in order (end None: until the caller stops)."""
        name, depth = self._job(job), prefetch if prefetch is not None else self.prefetch or 0
        if depth < 0:
            raise ValueError(f"prefetch must be >= 0, got {depth}")
        step = start_step
        warmed = self._warmed(name, rank, world_size, step)
        stream = None
        try:
            if warmed is not None:
                # The rest streams while the warm batches are handed over.
                if end_step is None or warmed.end < end_step:
                    stream = self._stream(name, warmed.end, end_step, rank, world_size, depth)
                while not warmed.exhausted and (end_step is None or step < end_step):
                    try:
                        batch = warmed.take()
                    except Exception:  # the warm stream failed: a stream of our own goes on
                        if stream is not None:
                            stream.close()
                        stream = None
                        break
                    yield self._admit(batch)
                    step += 1
                warmed.close()
            if end_step is not None and step >= end_step:
                return
            if stream is None:
                stream = self._stream(name, step, end_step, rank, world_size, depth)
            for batch in stream:
                yield self._admit(batch)
        finally:
            if warmed is not None:
                warmed.close()
            if stream is not None:
                stream.close()

    def describe(self, job: str | None = None) -> dict:
        name = self._job(job)
        _, info = self._unary("DescribeJob", pb.DescribeJobRequest(job=name), name, 0, None)
        return _to_dict(info)

    def explain(
        self, step: int, rank: int = 0, world_size: int = 1, *, job: str | None = None
    ) -> dict:
        """Where each row of the batch comes from: dataset, source, record, token ranges."""
        name = self._job(job)
        request = pb.GetBatchRequest(job=name, step=step, rank=rank, world_size=world_size)
        _, explanation = self._unary("Explain", request, name, rank, None)
        return _to_dict(explanation)

    def list_jobs(self) -> list[dict]:
        _, resp = self._unary("ListJobs", pb.ListJobsRequest(), "", 0, None)
        return [_to_dict(j) for j in resp.jobs]


def _to_dict(msg) -> dict:
    """The message as a dict, with 64-bit integers as ints (JSON mapping makes them strings)."""
    out = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for field in msg.DESCRIPTOR.fields:
        value = out.get(field.name)
        if field.message_type is not None and value is not None:
            items = getattr(msg, field.name)
            if field.is_repeated:
                out[field.name] = [_to_dict(m) for m in items]
            else:
                out[field.name] = _to_dict(items)
        elif field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64) and value is not None:
            out[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return out
