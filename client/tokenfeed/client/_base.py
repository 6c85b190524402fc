"""What the sync and asyncio clients share: every option, typed and named once, and the job.

Both clients take exactly these keyword arguments (docs/client.md describes each); `Client` and
`AsyncClient` add only their own I/O.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenfeed.client._credentials import Credentials, Pem
from tokenfeed.client._session import Policy, Session
from tokenfeed.v1 import tokenfeed_pb2 as pb

# A stream is reopened (at the step it reached) about this often, so the trainer's wait report
# reaches a server while it trains (waits.py): Prometheus scrapes every 15-30 s, and reopening
# costs one round trip that the prefetched batches hide.
REPORT_SECONDS = 10.0
# How often the client compares the data plans of the servers of its target (and whenever a
# rank reaches a new phase): a change of plan must be made at least this long before its
# first step for a client of servers without a shared store to hold its batches back in time
# (docs/data-plan.md); one GetPlan per server per interval.
PLAN_CHECK_SECONDS = 30.0


class ClientBase:
    def __init__(
        self,
        target: str,
        job: str | None = None,
        *,
        timeout: float = Policy.timeout,
        attempt_timeout: float | None = Policy.attempt_timeout,
        prefetch: int | None = None,
        verify: bool = Policy.verify,
        backoff: float = Policy.backoff,
        max_backoff: float = Policy.max_backoff,
        suspect_seconds: float = Policy.suspect_seconds,
        max_pushback: float = Policy.max_pushback,
        keepalive_seconds: float = Policy.keepalive_seconds,
        keepalive_timeout_seconds: float = Policy.keepalive_timeout_seconds,
        dns_refresh_seconds: float = 30.0,
        resolver: Callable[[str], list[str]] | None = None,
        report_waits: bool = True,
        report_seconds: float = REPORT_SECONDS,
        plan_check_seconds: float = PLAN_CHECK_SECONDS,
        tls: bool | None = None,
        tls_root_certs: Pem | None = None,
        tls_client_cert: Pem | None = None,
        tls_client_key: Pem | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
    ):
        """`target`: "host:port", "h1:p,h2:p" or "dns:///name:port"; `job`: the default job
        of every call. `timeout`: overall seconds per call (or per stream without progress);
        `attempt_timeout`: per server, and the longest a stream may stay silent (None: a third
        of `timeout`); `prefetch`: decoded batches a stream reads ahead (None or 0:
        read on the trainer's thread or task, as the trainer asks, while gRPC receives ahead;
        N >= 1: a thread, or a task, keeps N decoded); `verify`: check each batch's
        fingerprint; `backoff`/`max_backoff`: seconds between rounds of servers;
        `suspect_seconds`: how long a failed server goes to the back of the ranking;
        `max_pushback`: the longest a server's retry pushback is obeyed; `keepalive_seconds`
        (0: off) and `keepalive_timeout_seconds`: pings that find a hung server;
        `dns_refresh_seconds`: how often a dns:/// target is resolved again; `resolver`:
        name:port -> addresses, in place of DNS; `report_waits`: send the trainer's data waits
        to the servers (waits.py); `report_seconds`: how often a long stream reports them;
        `plan_check_seconds`: how often the servers' data plans are compared (0: only the
        batches' own checks; enough where the servers share a store); `tls*`, `token`,
        `token_file`: credentials (docs/client.md)."""
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if not report_seconds > 0:
            raise ValueError(f"report_seconds must be > 0, got {report_seconds}")
        if not plan_check_seconds >= 0:
            raise ValueError(f"plan_check_seconds must be >= 0, got {plan_check_seconds}")
        self.credentials = Credentials(
            target,
            tls=tls,
            tls_root_certs=tls_root_certs,
            tls_client_cert=tls_client_cert,
            tls_client_key=tls_client_key,
            tls_server_name=tls_server_name,
            token=token,
            token_file=token_file,
        )
        policy = Policy(
            timeout=timeout,
            attempt_timeout=attempt_timeout,
            backoff=backoff,
            max_backoff=max_backoff,
            suspect_seconds=suspect_seconds,
            verify=verify,
            max_pushback=max_pushback,
            keepalive_seconds=keepalive_seconds,
            keepalive_timeout_seconds=keepalive_timeout_seconds,
        )
        self.session = Session(target, policy, dns_refresh_seconds, resolver, report_waits)
        self.target, self.job, self.prefetch = target, job, prefetch
        self.report_seconds = report_seconds
        self.plan_check_seconds = plan_check_seconds
        self._open()

    def _open(self) -> None:
        """The client's own state (channels, streams), made once the options are checked."""

    @staticmethod
    def _amend_request(
        job: str,
        start_step: int,
        weights: Mapping[str, object] | None,
        global_batch_size: int | None,
        seq_len: int | None,
        add: Sequence[Mapping[str, Any]] | None,
        expected_version: int,
        packing: str | None = None,
    ) -> pb.AmendPlanRequest:
        """AmendPlan's request (docs/data-plan.md): weights by dataset name (numbers or
        rationals as strings: "1/3"), new datasets as {name, sources: [path | {path, format,
        text_field, token_field}], chunk_bytes}."""
        new = []
        for d in add or []:
            sources = [
                pb.NewDatasetSource(path=src)
                if isinstance(src, str)
                else pb.NewDatasetSource(**{k: str(v) for k, v in src.items()})
                for src in d.get("sources", [])
            ]
            new.append(
                pb.NewDataset(
                    name=str(d["name"]), sources=sources, chunk_bytes=int(d.get("chunk_bytes", 0))
                )
            )
        return pb.AmendPlanRequest(
            job=job,
            start_step=start_step,
            global_batch_size=global_batch_size or 0,
            seq_len=seq_len or 0,
            weights=[
                pb.DatasetWeight(dataset=k, weight=str(v)) for k, v in (weights or {}).items()
            ],
            add=new,
            expected_version=expected_version,
            packing=packing or "",
        )

    def _job(self, job: str | None) -> str:
        name = job or self.job
        if not name:
            raise ValueError(f"no job: pass job= to {type(self).__name__}(...) or to the call")
        return name
