"""The wire benchmark's tables (bench/wire.py): one row per case, and the serving workers'
aggregate against linear from one worker."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from bench.stats import median
from bench.table import number, render

if TYPE_CHECKING:
    from bench.wire import WireResult

LINEAR_TARGET = 0.7  # aggregate at 8 workers / (8 x at 1 worker), where cores allow
READS = {
    "once": "each row once",
    "warm": "warm re-read of epoch 0 (not training)",
    "server": "each row once, no Client (the server's share)",
}


def table(r: WireResult, load: str = "") -> str:
    rows = []
    for case in r.cases:
        goal = case.target
        ratio, spread = case.ratio(), case.ratios()
        reads = READS[case.reads]
        who = (
            f"{case.consumers} ranks of [{case.rows * case.consumers}, {case.seq_len}]"
            if case.consumers > 1
            else "1 consumer"
        )
        rows.append(
            [
                case.server,
                str(case.workers),
                f"[{case.rows}, {case.seq_len}]",
                who,
                reads,
                number(case.message_bytes),
                number(median(case.bare) / 1e6, 1),
                number(median(case.tokenfeed) / 1e6, 1),
                f"{ratio:.2f}",
                f"{min(spread):.2f}-{max(spread):.2f}",
                "" if goal is None else f">= {goal:.2f} ({'met' if ratio >= goal else 'missed'})",
                number(median(case.bare_tuned) / 1e6, 1),
                f"{case.ratio_tuned():.2f}",
                f"{median(case.cpu):.4f}",
                f"{median(case.bare_cpu):.4f}",
                f"{median(case.reader_cpu):.4f}",
                f"{median(case.bare_reader_cpu):.4f}",
            ]
        )
    c = r.corpus
    spe = ", ".join(f"{j}: {s:,}" for j, s in r.steps_per_epoch.items())
    title = (
        "Serving as training reads it, against the bare transport (grpc.aio stream of the same "
        "bytes, read with np.frombuffer)\n"
        f"   corpus: {c.docs:,} documents of code ({c.short_docs:,} short, {c.long_docs:,} "
        f"long), {c.text_bytes / 1e6:.1f} MB, about {r.tokens_per_epoch / 1e6:.1f} M tokens; "
        f"chunk_bytes {r.chunk_bytes}; steps per epoch: {spe}\n"
        f"   M tokens/s: medians of {len(r.cases[0].tokenfeed)} rounds of about "
        f"{r.round_tokens / 1e6:,.0f} M tokens a row on each side (all consumers of a row "
        "together); ratio: median of the rounds' tokenfeed/bare; cores here: "
        f"{len(os.sched_getaffinity(0))}{'; load ' + load if load else ''}"
    )
    header = [
        "server",
        "workers",
        "batch",
        "consumers",
        "reads",
        "message B",
        "bare M tok/s",
        "tokenfeed M tok/s",
        "ratio",
        "rounds",
        "target",
        "bare, grpc setting",
        "ratio to it",
        "server CPU s/M",
        "bare server",
        "consumers CPU s/M",
        "bare readers",
    ]
    notes = (
        "bare, grpc setting: the bare transport again, its readers started with the Client's "
        "gRPC setting (GRPC_EXPERIMENTS=-event_engine_client, which the Client makes where it "
        "is imported first: tokenfeed/client/_grpcsetting.py), M tokens/s; ratio to it: "
        "tokenfeed's against that; the ratio and target columns are against the reference as "
        "gRPC leaves it\n"
        "rounds: the lowest and highest of the rounds' ratios, how far one round moved from "
        "another on this machine\n"
        "server CPU s/M: user + system seconds of the server's processes (supervisor and "
        "workers) per million tokens streamed; bare server: the bare transport server's\n"
        "consumers CPU s/M: the consumer processes' own CPU seconds per million tokens (the "
        "Client's decoding, fingerprint check and int32 widening); bare readers: "
        "np.frombuffer's\n"
        "each row once: every round reads steps no process of that server read before, on "
        "through epoch ends; the warm row re-reads epoch 0's steps after one pass; no Client: "
        "the same fresh steps read by a bare gRPC stub (protobuf's parse, nothing else), so "
        "the ratio is nearly the server's alone, and the step from the row above it (the same "
        "case through the Client) is the Client's decoding\n"
        + (
            f"warm-up: before the rounds each job streamed about {r.warm_up_tokens / 1e6:.0f} M "
            "tokens (one raw reader) from steps no round reads, so every server's row cache "
            "(512 MiB) is full and turning over, as in a run past its first seconds"
            if r.warm_up_tokens
            else "no warm-up (--warm-up-mb 0): the rounds begin with each server's row cache "
            "empty, so its first 512 MiB of row buffers are memory new to the process"
        )
    )
    return f"{render(title, header, rows)}\n{notes}{scaling(r)}"


def scaling(r: WireResult) -> str:
    """The ranks' aggregate by server.workers, against linear from one worker."""
    out = []
    for server in dict.fromkeys(c.server for c in r.cases):
        ranks = {
            c.workers: c
            for c in r.cases
            if c.server == server and c.consumers > 1 and c.reads == "once"
        }
        if len(ranks) < 2 or 1 not in ranks:
            continue
        one, bare_one = median(ranks[1].tokenfeed), median(ranks[1].bare)
        rows = []
        for n, case in sorted(ranks.items()):
            linear = median(case.tokenfeed) / (n * one)
            goal = ""
            if n == 8:
                ok = "met" if linear >= LINEAR_TARGET else "missed"
                goal = f">= {LINEAR_TARGET:.2f} ({ok})"
            rows.append(
                [
                    str(n),
                    number(median(case.tokenfeed) / 1e6, 1),
                    number(median(case.bare) / 1e6, 1),
                    f"{case.ratio():.2f}",
                    f"{median(case.tokenfeed) / one:.2f}",
                    f"{linear:.2f}",
                    f"{median(case.bare) / bare_one:.2f}",
                    f"{median(case.busiest):.2f}" if case.busiest else "",
                    f"{median(case.bare_busiest):.2f}" if case.bare_busiest else "",
                    goal,
                ]
            )
        out.append(
            render(
                f"server.workers ({server}): {r.ranks} consumer processes, ranks of one job, "
                f"each row once; cores here: {len(os.sched_getaffinity(0))}",
                [
                    "workers",
                    "tokenfeed M tok/s",
                    "bare M tok/s",
                    "ratio",
                    "vs 1 worker",
                    "of linear",
                    "bare vs 1",
                    "busiest",
                    "bare busiest",
                    "target",
                ],
                rows,
            )
            + "\nbare vs 1: the bare transport's own aggregate against one serving process; "
            "busiest: the busiest serving process's CPU over their mean (1.00: the streams "
            "spread evenly; the kernel spreads connections over SO_REUSEPORT sockets by a hash "
            "of their addresses, not by load), tokenfeed's workers and the bare servers"
        )
    return "".join(f"\n\n{t}" for t in out)
