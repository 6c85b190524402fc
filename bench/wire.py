"""Serving at wire speed: StreamBatches against the raw gRPC stream of the same tokens, against
an in-process memmap loader over the same rows, the server's CPU per million tokens, and the
aggregate rate of 1 and 2 serving workers with 2 consumer processes.

    python -m bench.wire [--quick] [--before REV]

- ceiling: `bench.ceiling` streams one canned message holding the same token count as raw int32
  bytes, consumed by the same client (decoding and fingerprint checks included);
- memmap: the same rows' tokens in one file, read as [rows, seq_len + 1] slices with numpy and
  widened to int32 `input_ids` and `labels` (what an in-process loader does, no network);
- CPU: user + system seconds of the server's processes over a measured stream, per million
  tokens; `--before REV` also runs the server and client of an earlier commit (a git worktree
  under bench/out) on the same corpus, for the before/after pair;
- workers: `server.workers` 1 and 2, two consumer processes streaming different ranks.
Streams read the first epoch's steps over and over (warm serving: the demo corpus is small,
and a corpus of production size turns epochs rarely).
Every consumer is its own process (bench/consume.py), so no GIL is shared with a server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus

from bench.procs import ROOT, ServerProcess
from bench.stats import median
from bench.table import number, render

SHAPES = ((8, 2048), (32, 4096))  # (rows, seq_len): the two batch shapes
TARGETS = {(8, 2048): 0.5, (32, 4096): 0.8}
COPIES = 16  # of the demo corpus: about 5 M tokens, 37 steps of [32, 4096] per epoch
START_TIMEOUT, READY_TIMEOUT = 60.0, 600.0


@dataclass(frozen=True)
class WireSizes:
    tokens: int  # per measured stream
    rounds: int


QUICK = WireSizes(tokens=8_000_000, rounds=2)
FULL = WireSizes(tokens=40_000_000, rounds=5)


@dataclass
class WireResult:
    docs: int
    tokenfeed: dict = field(default_factory=dict)  # shape -> [tokens/s per round]
    ceiling: dict = field(default_factory=dict)
    memmap: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)  # shape -> [server CPU s per M tokens]
    before: dict = field(default_factory=dict)  # shape -> (tokens/s, CPU s per M tokens)
    workers: dict = field(default_factory=dict)  # workers -> [aggregate tokens/s per round]
    before_rev: str = ""
    readers: int = 2


def job_name(rows: int, seq_len: int) -> str:
    return f"w{rows}x{seq_len}"


def write_config(path: Path, corpus: Path, tokenizer: Path, cache: Path, workers: int) -> None:
    jobs = {
        job_name(r, s): {
            "sources": [str(corpus / "*")],
            "tokenizer": str(tokenizer),
            "seq_len": s,
            "global_batch_size": r,
            "seed": 1,
            "chunk_bytes": "256KiB",
            "window_chunks": 4,
        }
        for r, s in SHAPES
    }
    server = {"listen": "127.0.0.1:0", "cache_dir": str(cache), "grace_seconds": 2.0}
    if workers > 1:
        server["workers"] = workers
    path.write_text(yaml.safe_dump({"server": server, "jobs": jobs}, sort_keys=False))


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def consumers(
    target: str,
    job: str,
    steps: int,
    count: int = 1,
    env: dict | None = None,
    mode: str = "stream",
    wrap: int = 0,
) -> list[dict]:
    """`count` consumer processes, each streaming `steps` steps of its own rank (within the
    first `wrap` steps, over and over: warm serving on a small corpus)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.consume",
                "--target",
                target,
                "--job",
                job,
                "--steps",
                str(steps),
                "--mode",
                mode,
                "--rank",
                str(r),
                "--world",
                str(count),
                "--wrap",
                str(wrap),
            ],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        for r in range(count)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"consumer exited with {p.returncode}")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def serve(
    work: Path, name: str, config: Path, env: dict | None = None, tree: Path = ROOT
) -> ServerProcess:
    """A server of this tree (or of an earlier commit's, whose CLI may live elsewhere)."""
    packaged = (tree / "server/tokenfeed/server/commands/cli.py").exists()
    module = "tokenfeed.server.commands.cli" if packaged else "tokenfeed.server.cli"
    argv = [sys.executable, "-m", module, "serve", "--config", str(config)]
    proc = ServerProcess(name, argv, work)
    if env is not None:
        proc.env = env
    proc.start(START_TIMEOUT)
    return proc


def pids_of(proc: ServerProcess) -> list[int]:
    info = json.loads(proc.ready_file.read_text())
    return [info["pid"], *info.get("workers", [])]


EPOCH_STEPS: dict[tuple[int, int], int] = {}  # shape -> steps of one epoch (warm, wrapped)


def wait_ready(address: str, env: dict | None = None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    for rows, seq_len in SHAPES:
        while True:
            code = (
                "import sys; from tokenfeed.client import Client; "
                f"c = Client({address!r}, job={job_name(rows, seq_len)!r}); "
                "i = c.describe(); print(i['steps_per_epoch'], i['state'])"
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
            ).stdout.strip()
            state = out.split()[-1] if out else ""
            if state.endswith("READY"):
                EPOCH_STEPS[(rows, seq_len)] = int(out.split()[0])
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address}: job not ready ({state})")
            time.sleep(0.5)


def measure_memmap(work: Path, address: str, rows: int, seq_len: int, steps: int) -> float:
    """tokens/s of an in-process loader over the same rows: the tokens of `steps` batches
    (fetched once from the server) in one file, memory-mapped, sliced and widened."""
    path = work / f"memmap-{rows}x{seq_len}.u2"
    with Client(address, job=job_name(rows, seq_len)) as c:
        with open(path, "wb") as f:
            for s in range(min(steps, 64)):
                f.write(np.ascontiguousarray(c.get_batch(s).compact.tokens).tobytes())
    table = np.memmap(path, dtype="<u2", mode="r").reshape(-1, seq_len + 1)
    batches, tokens = len(table) // rows, 0
    began = time.perf_counter()
    for i in range(steps):
        block = table[(i % batches) * rows : (i % batches + 1) * rows]
        ids = block[:, :seq_len].astype(np.int32)
        labels = block[:, 1:].astype(np.int32)
        tokens += ids.size + 0 * labels.size
    return tokens / (time.perf_counter() - began)


def rate(results: list[dict]) -> float:
    """Aggregate tokens/s of consumers that ran at once."""
    return sum(r["tokens"] for r in results) / max(r["seconds"] for r in results)


def measure_current(work: Path, config: Path, sizes: WireSizes, result: WireResult) -> None:
    server = serve(work, "tokenfeed", config)
    ceilings = {
        shape: ServerProcess(
            f"ceiling-{shape[0]}x{shape[1]}",
            [
                sys.executable,
                "-m",
                "bench.ceiling",
                "--rows",
                str(shape[0]),
                "--seq-len",
                str(shape[1]),
            ],
            work,
        )
        for shape in SHAPES
    }
    try:
        wait_ready(server.address)
        for c in ceilings.values():
            c.start(START_TIMEOUT)
        pids = pids_of(server)
        for rows, seq_len in SHAPES:
            steps = max(sizes.tokens // (rows * seq_len), 10)
            job = job_name(rows, seq_len)
            wrap = EPOCH_STEPS[(rows, seq_len)]
            consumers(server.address, job, wrap, wrap=wrap)  # warm: every chunk opened once
            for _ in range(sizes.rounds):
                before = cpu_seconds(pids)
                [r] = consumers(server.address, job, steps, wrap=wrap)
                used = cpu_seconds(pids) - before
                result.tokenfeed.setdefault((rows, seq_len), []).append(rate([r]))
                result.cpu.setdefault((rows, seq_len), []).append(used / (r["tokens"] / 1e6))
                [c] = consumers(ceilings[(rows, seq_len)].address, "ceiling", steps, wrap=wrap)
                result.ceiling.setdefault((rows, seq_len), []).append(rate([c]))
                result.memmap.setdefault((rows, seq_len), []).append(
                    measure_memmap(work, server.address, rows, seq_len, steps)
                )
    finally:
        server.stop(15)
        for c in ceilings.values():
            if c.address:
                c.stop(15)


def measure_workers(
    work: Path,
    corpus: Path,
    tokenizer: Path,
    sizes: WireSizes,
    result: WireResult,
    counts: tuple[int, ...] = (1, 2),
    readers: int = 2,
) -> None:
    rows, seq_len = SHAPES[0]
    steps = max(sizes.tokens // (rows * seq_len), 10)
    result.readers = readers
    for n in counts:
        config = work / f"workers-{n}.yaml"
        write_config(config, corpus, tokenizer, work / "cache", n)  # built already: warm
        server = serve(work, f"workers-{n}", config)
        try:
            wait_ready(server.address)
            wrap = EPOCH_STEPS[(rows, seq_len)]
            consumers(server.address, job_name(rows, seq_len), wrap, count=readers, wrap=wrap)
            for _ in range(sizes.rounds):
                got = consumers(
                    server.address, job_name(rows, seq_len), steps, count=readers, wrap=wrap
                )
                result.workers.setdefault(n, []).append(rate(got))
        finally:
            server.stop(15)


def measure_before(
    work: Path, rev: str, corpus: Path, tokenizer: Path, sizes: WireSizes, result: WireResult
) -> None:
    """The same stream from the server and client of commit `rev` (its own cache)."""
    tree = work / "before"
    if not tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    env = {**os.environ, "PYTHONPATH": f"{tree / 'server'}:{tree / 'client'}:{ROOT}"}
    config = work / "before.yaml"
    write_config(config, corpus, tokenizer, work / "before-cache", 1)
    server = serve(work, "before", config, env, tree)
    try:
        wait_ready(server.address, env)
        pids = pids_of(server)
        for rows, seq_len in SHAPES:
            steps = max(sizes.tokens // (rows * seq_len), 10)
            job = job_name(rows, seq_len)
            wrap = EPOCH_STEPS[(rows, seq_len)]
            consumers(server.address, job, wrap, env=env, wrap=wrap)
            rates, cpus = [], []
            for _ in range(sizes.rounds):
                used = cpu_seconds(pids)
                [r] = consumers(server.address, job, steps, env=env, wrap=wrap)
                cpus.append((cpu_seconds(pids) - used) / (r["tokens"] / 1e6))
                rates.append(rate([r]))
            result.before[(rows, seq_len)] = (median(rates), median(cpus))
    finally:
        server.stop(15)


def corpus_of(work: Path) -> tuple[Path, int]:
    """The demo documents COPIES times over (made once): epochs long enough that a stream
    of [32, 4096] batches runs for many steps between epoch turns, as on a real corpus."""
    corpus, marker = work / "corpus", work / "corpus.done"
    docs = democorpus.documents() * COPIES
    if not marker.exists():
        shutil.rmtree(corpus, ignore_errors=True)
        democorpus.write_corpus(corpus, docs)
        marker.write_text(str(len(docs)))
    return corpus, len(docs)


def run(
    sizes: WireSizes,
    out: Path,
    before: str = "",
    workers: tuple[int, ...] = (1, 2),
    readers: int = 2,
) -> WireResult:
    _, tokenizer, _ = democorpus.prepare(out / "democorpus")
    work = out / "wire"
    work.mkdir(parents=True, exist_ok=True)
    corpus, docs = corpus_of(work)
    for stale in ("cache", "before-cache"):
        shutil.rmtree(work / stale, ignore_errors=True)
    result = WireResult(docs, before_rev=before)
    config = work / "tokenfeed.yaml"
    write_config(config, corpus, tokenizer, work / "cache", 1)
    measure_current(work, config, sizes, result)
    measure_workers(work, corpus, tokenizer, sizes, result, workers, readers)
    if before:
        measure_before(work, before, corpus, tokenizer, sizes, result)
    return result


def table(r: WireResult) -> str:
    rows = []
    for shape in SHAPES:
        tf, cl, mm = median(r.tokenfeed[shape]), median(r.ceiling[shape]), median(r.memmap[shape])
        ratio = median([a / b for a, b in zip(r.tokenfeed[shape], r.ceiling[shape], strict=True)])
        goal = TARGETS[shape]
        rows.append(
            [
                f"[{shape[0]}, {shape[1]}] StreamBatches",
                number(tf / 1e6, 1),
                number(cl / 1e6, 1),
                f"{ratio:.2f}",
                f">= {goal:.2f} ({'met' if ratio >= goal else 'missed'})",
                number(mm / 1e6, 1),
                f"{tf / mm:.3f}",
            ]
        )
    main = render(
        f"Wire: StreamBatches to one consumer process, M tokens/s (median of "
        f"{len(r.tokenfeed[SHAPES[0]])} rounds; {r.docs:,} docs)",
        ["batch", "tokenfeed", "raw gRPC int32", "ratio", "target", "memmap loader", "vs memmap"],
        rows,
    )
    cpu_rows = []
    for shape in SHAPES:
        after = median(r.cpu[shape])
        if shape in r.before:
            b_rate, b_cpu = r.before[shape]
            cpu_rows.append(
                [
                    f"[{shape[0]}, {shape[1]}]",
                    f"{b_cpu:.3f}",
                    f"{after:.3f}",
                    f"{b_cpu / after:.1f}x",
                    number(b_rate / 1e6, 1),
                    number(median(r.tokenfeed[shape]) / 1e6, 1),
                ]
            )
        else:
            cpu_rows.append(
                [
                    f"[{shape[0]}, {shape[1]}]",
                    "-",
                    f"{after:.3f}",
                    "-",
                    "-",
                    number(median(r.tokenfeed[shape]) / 1e6, 1),
                ]
            )
    before = f"before: commit {r.before_rev}" if r.before_rev else "before: not run (--before REV)"
    cpu = render(
        f"Server CPU seconds per million tokens streamed ({before})",
        ["batch", "CPU s/M before", "CPU s/M now", "less", "M tok/s before", "M tok/s now"],
        cpu_rows,
    )
    w = {n: median(v) for n, v in r.workers.items()}
    workers = render(
        f"Serving workers, {r.readers} consumer processes streaming ranks 0..{r.readers - 1} of "
        f"[{SHAPES[0][0]}, {SHAPES[0][1]}] (cores here: {len(os.sched_getaffinity(0))})",
        ["server.workers", "aggregate M tokens/s", "vs the first"],
        [[str(n), number(v / 1e6, 1), f"{v / w[min(w)]:.2f}"] for n, v in sorted(w.items())],
    )
    return "\n\n".join([main, cpu, workers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--before", default="", help="also measure this earlier commit")
    parser.add_argument("--workers", default="1,2", help="server.workers values to compare")
    parser.add_argument("--readers", type=int, default=2, help="consumer processes")
    a = parser.parse_args()
    out = Path(__file__).resolve().parent / "out"
    counts = tuple(int(n) for n in a.workers.split(","))
    print(table(run(QUICK if a.quick else FULL, out, a.before, counts, a.readers)))


if __name__ == "__main__":
    main()
