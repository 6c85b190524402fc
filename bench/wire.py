"""Serving as training reads: StreamBatches through the project's Client, each row read once
(streaming on through epoch ends), against the bare transport of the same bytes, in one run.

    python -m bench.wire [--quick] [--before REV] [--workers 1,2] [--ranks 8] [--mb 31]
                         [--warm-up-mb 640]

- bare transport (the reference of every ratio): bench/transport.py, a grpc.aio server-stream
  of opaque messages of the same number of bytes as tokenfeed's batch messages of that case
  (measured from the server's own stream first), read by a process that only wraps each
  message with `np.frombuffer`: no tokenfeed code on either side. With `server.workers` N its
  server runs N processes on one port too;
- tokenfeed, each row once: consumer processes (bench/consume.py) stream through the Client
  (decoding, fingerprint check, int32 `input_ids` and `labels`: what a trainer reads), each
  round from steps no process of that server has read, on through epoch ends: every row's
  buffer is laid out by the stream that reads it, as in training;
- tokenfeed, warm re-read (labelled, never the headline): steps of epoch 0 over and over after
  one pass, every row buffer already laid out;
- tokenfeed's server alone (labelled, never the headline; this tree's server, one worker): the
  same fresh steps read by consumers with a bare gRPC stub (protobuf's parse of each message,
  nothing else: bench/consume.py --mode raw, no Client): how much of the gap to the transport
  is the server's, and so how much the Client's decoding;
- 1 consumer at [8, 2048] and [32, 4096], with `server.workers` 1 and 2 (with workers, the
  supervisor lays out the row buffers ahead and the serving worker maps them: jobs/layahead.py);
  8 ranks of one job of [64, 2048] (8 rows a rank) in 8 consumer processes started together,
  with `server.workers` 1 and 2 (aggregate tokens/s: all tokens over the span from the first
  start to the last end);
- warm-up: before its rounds, each server streams WARM_UP_BYTES of tokens of every job, more
  than its row cache holds, so the rounds measure it in the steady state of a run (its row
  buffers' memory reused, not faulted in new);
- server CPU: user + system seconds of the server's processes over the measured streams, per
  million tokens, tokenfeed's and the bare server's;
- the bare transport again with its readers given the Client's gRPC setting (GRPC_EXPERIMENTS,
  tokenfeed/client/_grpcsetting.py; the reference above keeps gRPC's defaults): a second ratio
  that says how much of a row's ratio that setting makes, which the reference could have too;
- `--before REV`: the same rows for the server and client of an earlier commit (a git worktree
  under bench/out, its own cache), with their own bare references in the same run.
Every side alternates with its reference round by round; ratios are medians of the rounds'
ratios. The corpus is bench/corpus.py's (code the project was never tuned on, short and long
documents), tokenized with a tokenizer trained on it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenfeed.client._grpcsetting import POLLING_CLIENT

from bench import child_env
from bench import corpus as corpusmod
from bench.procs import ROOT, ServerProcess
from bench.stats import median
from bench.streams import busiest, consume_argv, loadavg, pids_of, read_argv, together
from bench.wireservers import (
    CHUNK_BYTES,
    RANK_SHAPE,
    SHAPES,
    bare_server,
    before_tree,
    describe,
    job_name,
    job_shapes,
    message_bytes,
    row_buffers,
    serve,
    shares_rows,
    write_config,
)
from bench.wiretable import table

TARGETS = {(8, 2048): 0.6, (32, 4096): 0.8}  # tokenfeed, each row once / bare transport
RANKS = 8  # one job of 8 ranks of RANK_SHAPE: global batch 64 rows
RANKS_TARGET = 0.6
READY_TIMEOUT = 600.0
SIZING_START = 10**9  # an epoch that no measurement reaches
# Before the rounds, each job streams this many bytes of tokens (uint16 here) from steps no
# round reads: more than the server's row buffers hold (`server.stream_cache_bytes`, 512 MiB),
# so its row cache is full and evicting, as in any run past its first seconds. Until then every
# row buffer a process lays out is memory new to it, which the kernel faults in page by page
# (about half the layout threads' CPU at [32, 4096]); after it, freed buffers' memory is reused.
WARM_UP_BYTES = 640 * 2**20
WARM_UP_START = 2 * 10**9


@dataclass(frozen=True)
class WireSizes:
    tokens: int  # per measured stream, all consumers of a case together
    rounds: int
    mb: float  # of text in the corpus


QUICK = WireSizes(tokens=8_000_000, rounds=2, mb=31)
# A round streams FULL.tokens per row of the table, long enough to measure streams as training
# runs them, for minutes: past their start. A stream's first few hundred MB run slower than
# the rest on either side (HTTP/2 windows and socket buffers grow to the rate; a new process's
# code is cold), most of all the bare transport's at [32, 4096]: on a quiet 2-core machine,
# rounds of 40 M tokens (305 [32, 4096] messages) had it at 500-620 M tokens/s and a ratio of
# 0.49-0.65, rounds of 200 M tokens at 660-820 M and 0.47-0.57, and of 800 M tokens at 740-830 M
# and 0.46-0.55 (4 alternating rounds each; tokenfeed ran at 306-406 M throughout). Rounds of
# 40 M tokens, this table's before, flattered tokenfeed there.
FULL = WireSizes(tokens=320_000_000, rounds=5, mb=31)


@dataclass
class Case:
    """One row of the table: a server, its workers, how many consumers read what."""

    server: str  # "now", or "before <rev>"
    workers: int
    consumers: int
    rows: int  # of one consumer's batches
    seq_len: int
    # "once" (training), "warm" (epoch 0 re-read), or "server": each row once, read by the
    # bare transport's reader (bench/consume.py --mode raw: no Client), the server's share
    reads: str
    message_bytes: int = 0
    tokenfeed: list[float] = field(default_factory=list)  # aggregate tokens/s per round
    bare: list[float] = field(default_factory=list)
    # The bare transport again, its readers with the Client's gRPC setting (GRPC_EXPERIMENTS,
    # tokenfeed/client/_grpcsetting.py): what the same setting gives the reference.
    bare_tuned: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # server CPU s per M tokens, per round
    bare_cpu: list[float] = field(default_factory=list)
    reader_cpu: list[float] = field(default_factory=list)  # consumers' CPU s per M tokens
    bare_reader_cpu: list[float] = field(default_factory=list)
    busiest: list[float] = field(default_factory=list)  # streams.busiest, per round
    bare_busiest: list[float] = field(default_factory=list)

    @property
    def job(self) -> str:
        return job_name(self.rows * self.consumers, self.seq_len)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.seq_len

    def ratios(self) -> list[float]:
        """Each round's tokenfeed / bare, in the rounds' order."""
        return [a / b for a, b in zip(self.tokenfeed, self.bare, strict=True)]

    def ratio(self) -> float:
        return median(self.ratios())

    def ratio_tuned(self) -> float:
        """The median of the rounds' tokenfeed / bare with the Client's gRPC setting."""
        return median([a / b for a, b in zip(self.tokenfeed, self.bare_tuned, strict=True)])

    @property
    def target(self) -> float | None:
        if self.reads != "once":
            return None
        return RANKS_TARGET if self.consumers > 1 else TARGETS[self.shape]


@dataclass
class WireResult:
    corpus: corpusmod.Corpus
    cases: list[Case] = field(default_factory=list)
    ranks: int = RANKS
    chunk_bytes: str = CHUNK_BYTES
    tokens_per_epoch: int = 0
    steps_per_epoch: dict = field(default_factory=dict)  # job -> steps
    warm_up_bytes: int = WARM_UP_BYTES  # of uint16 tokens per job before the rounds
    warm_up_tokens: int = 0  # streamed per job before the rounds (`warm_up`)
    round_tokens: int = 0  # streamed per row of the table in each round (WireSizes.tokens)


def wait_ready(address: str, env: dict | None, result: WireResult) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    for rows, seq_len in job_shapes(result.ranks):
        job = job_name(rows, seq_len)
        while True:
            steps, state = describe(address, job, env)
            if state.endswith("READY"):
                result.steps_per_epoch[job] = steps
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address}: job {job} not ready ({state})")
            time.sleep(0.5)


class Steps:
    """Fresh steps of each job, from past its epoch 0 (which the warm re-read reads): a server
    never reads a step twice, but in the warm re-read."""

    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    def take(self, job: str, steps: int, result: WireResult) -> int:
        start = self.next.get(job, result.steps_per_epoch[job] + 1)
        self.next[job] = start + steps
        return start


def measure_server(
    work: Path,
    label: str,
    config_of,
    workers: tuple[int, ...],
    sizes: WireSizes,
    result: WireResult,
    env: dict | None = None,
    tree: Path = ROOT,
) -> None:
    """Every case of one server (this tree's or an earlier commit's), each with its bare
    transport in the same rounds."""
    fresh = Steps()
    for n in workers:
        server = serve(work, f"{label.replace(' ', '-')}-w{n}", config_of(n), env, tree)
        bares: dict[tuple[int, int], ServerProcess] = {}
        try:
            wait_ready(server.address, env, result)
            pids = pids_of(server)
            warm_up(server.address, env, pids, result)
            cases = []
            diagnose = n == 1 and tree == ROOT  # where the gap lies: the server's share
            for rows, seq_len in SHAPES:  # one consumer: also with workers, each row once
                for reads in ("once", "warm") if n == 1 else ("once",):
                    cases.append(Case(label, n, 1, rows, seq_len, reads))
                    if reads == "once" and diagnose and (rows, seq_len) == SHAPES[0]:
                        cases.append(Case(label, n, 1, rows, seq_len, "server"))
            cases.append(Case(label, n, result.ranks, *RANK_SHAPE, "once"))
            if diagnose:
                cases.append(Case(label, n, result.ranks, *RANK_SHAPE, "server"))
            for case in cases:
                # Sizing reads steps of an epoch no measurement reaches.
                case.message_bytes = message_bytes(
                    server.address, case.job, SIZING_START, 0, case.consumers
                )
                key = (case.message_bytes, n)
                if key not in bares:
                    bares[key] = bare_server(work, case.message_bytes, n)
            for case in cases:
                if case.reads == "warm":  # one pass over epoch 0 first: then all laid out
                    e = result.steps_per_epoch[case.job]
                    together([consume_argv(server.address, case.job, 0, e, 0, 1)], env, pids)
            for r in range(sizes.rounds):
                for case in cases if r % 2 == 0 else cases[::-1]:
                    run_round(case, server, bares, pids, sizes, fresh, result, env, r)
            result.cases += cases
            counted = row_buffers(server) if n > 1 else ""
            if counted:
                print(
                    f"{label} workers={n} row buffers (warm-up and rounds): {counted}",
                    file=sys.stderr,
                    flush=True,
                )
            for case in cases:  # as it goes, on stderr: a run stopped early keeps these
                print(
                    f"{label} workers={n} consumers={case.consumers} "
                    f"[{case.rows}, {case.seq_len}] {case.reads}: tokenfeed "
                    f"{median(case.tokenfeed) / 1e6:.1f} M/s, bare {median(case.bare) / 1e6:.1f} "
                    f"M/s, ratio {case.ratio():.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            server.stop(15)
            for b in bares.values():
                b.stop(15)


def warm_up(address: str, env: dict | None, pids: list[int], result: WireResult) -> None:
    """Each job streams `result.warm_up_bytes` of tokens (one raw reader, world size 1) from
    steps no round reads, so the rounds measure a server whose row cache is full and turning
    over."""
    tokens = result.warm_up_bytes // 2
    if not tokens:
        return
    for rows, seq_len in job_shapes(result.ranks):
        job, steps = job_name(rows, seq_len), max(1, tokens // (rows * seq_len))
        argv = [*consume_argv(address, job, WARM_UP_START, steps, 0, 1), "--mode", "raw"]
        began = time.monotonic()
        got, _ = together([argv], env, pids)
        result.warm_up_tokens = got["tokens"]
        seconds = time.monotonic() - began
        print(
            f"warm-up {job}: {got['tokens'] / 1e6:.0f} M tokens in {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def run_round(
    case: Case,
    server: ServerProcess,
    bares: dict,
    pids: list[int],
    sizes: WireSizes,
    fresh: Steps,
    result: WireResult,
    env: dict | None,
    r: int,
) -> None:
    per_message = case.rows * case.seq_len
    steps = max(sizes.tokens // (per_message * case.consumers), 10)
    bare = bares[(case.message_bytes, case.workers)]
    sides = ["tokenfeed", "bare", "tuned"] if r % 2 == 0 else ["tuned", "bare", "tokenfeed"]
    for side in sides:
        if side == "tuned":
            argv = read_argv(bare.address, steps, per_message)
            tuned = child_env({"GRPC_EXPERIMENTS": POLLING_CLIENT})
            got, _ = together([argv] * case.consumers, tuned, pids_of(bare))
            case.bare_tuned.append(got["rate"])
            continue
        if side == "bare":
            argv = read_argv(bare.address, steps, per_message)
            got, cpu = together([argv] * case.consumers, None, pids_of(bare))
            case.bare.append(got["rate"])
            case.bare_cpu.append(cpu / (got["tokens"] / 1e6))
            case.bare_reader_cpu.append(got["cpu"] / (got["tokens"] / 1e6))
            if (spread := busiest(got["by_process"])) is not None:  # each process serves
                case.bare_busiest.append(spread)
            continue
        if case.reads == "warm":
            wrap = result.steps_per_epoch[case.job]
            argvs = [consume_argv(server.address, case.job, 0, steps, 0, 1, wrap)]
        else:
            start = fresh.take(case.job, steps, result)
            raw = ["--mode", "raw"] if case.reads == "server" else []
            argvs = [
                [*consume_argv(server.address, case.job, start, steps, k, case.consumers), *raw]
                for k in range(case.consumers)
            ]
        got, cpu = together(argvs, env, pids)
        case.tokenfeed.append(got["rate"])
        case.cpu.append(cpu / (got["tokens"] / 1e6))
        case.reader_cpu.append(got["cpu"] / (got["tokens"] / 1e6))
        if (spread := busiest(got["by_process"][1:])) is not None:  # after the supervisor
            case.busiest.append(spread)


def run(
    sizes: WireSizes,
    out: Path,
    before: str = "",
    workers: tuple[int, ...] = (1, 2),
    ranks: int = RANKS,
    warm_up_bytes: int = WARM_UP_BYTES,
) -> WireResult:
    c = corpusmod.prepare(sizes.mb, out)
    work = out / "wire"
    work.mkdir(parents=True, exist_ok=True)
    result = WireResult(c, ranks=ranks, warm_up_bytes=warm_up_bytes, round_tokens=sizes.tokens)

    def configs(cache: Path, tag: str, tree: Path = ROOT):
        def config_of(n: int) -> Path:
            path = work / f"{tag}-workers-{n}.yaml"
            counted = n > 1 and shares_rows(tree)
            write_config(path, c.root, c.tokenizer, cache, n, ranks, counted)
            return path

        return config_of

    shutil.rmtree(work / "cache", ignore_errors=True)
    measure_server(work, "now", configs(work / "cache", "now"), workers, sizes, result)
    if before:
        tree, env = before_tree(work, before)
        shutil.rmtree(work / "before-cache", ignore_errors=True)
        config_of = configs(work / "before-cache", "before", tree)
        measure_server(work, f"before {before}", config_of, workers, sizes, result, env, tree)
    spe = result.steps_per_epoch[job_name(*SHAPES[0])]
    result.tokens_per_epoch = spe * SHAPES[0][0] * SHAPES[0][1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--before", default="", help="also measure this earlier commit")
    parser.add_argument("--workers", default="1,2", help="server.workers values (8 ranks)")
    parser.add_argument("--ranks", type=int, default=RANKS, help="consumer processes of a job")
    parser.add_argument("--mb", type=float, default=0.0, help="corpus MB (default: the size's)")
    parser.add_argument("--tokens", type=int, default=0, help="tokens per measured stream")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument(
        "--warm-up-mb",
        type=float,
        default=WARM_UP_BYTES / 2**20,
        help="MiB of tokens each job streams before the rounds (0: measure from a cold start)",
    )
    a = parser.parse_args()
    sizes = QUICK if a.quick else FULL
    sizes = WireSizes(a.tokens or sizes.tokens, a.rounds or sizes.rounds, a.mb or sizes.mb)
    counts = tuple(int(n) for n in a.workers.split(","))
    out = Path(__file__).resolve().parent / "out"
    load = loadavg()
    result = run(sizes, out, a.before, counts, a.ranks, int(a.warm_up_mb * 2**20))
    print(table(result, f"{load} at the start, {loadavg()} at the end"))


if __name__ == "__main__":
    main()
