"""The wire benchmark's servers (bench/wire.py): the config of a case's server, starting it (or
an earlier commit's) and the bare transport's, and what is asked of them before the rounds: a
job's steps per epoch, a batch message's size, the node's shared row-buffer counts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import yaml
from tokenfeed.v1 import tokenfeed_pb2 as pb

from bench import child_env
from bench.procs import ROOT, ServerProcess

SHAPES = ((8, 2048), (32, 4096))  # (rows, seq_len) of one consumer: the two shapes
RANK_SHAPE = (8, 2048)  # each rank's batch of the ranks' job
CHUNK_BYTES = "2MiB"  # the corpus in about 16 chunks (window_chunks: the default 8)
START_TIMEOUT = 60.0
SIZING_STEPS = 16  # steps streamed to learn a case's message size


def job_name(rows: int, seq_len: int) -> str:
    return f"w{rows}x{seq_len}"


def job_shapes(ranks: int) -> tuple[tuple[int, int], ...]:
    """(global batch rows, seq_len) of every job: the two shapes, and the ranks' job."""
    return (*SHAPES, (ranks * RANK_SHAPE[0], RANK_SHAPE[1]))


def write_config(
    path: Path,
    corpus: Path,
    tokenizer: Path,
    cache: Path,
    workers: int,
    ranks: int,
    metrics: bool = False,
) -> None:
    jobs = {
        job_name(r, s): {
            "sources": [str(corpus / "*.jsonl")],
            "tokenizer": str(tokenizer),
            "seq_len": s,
            "global_batch_size": r,
            "seed": 1,
            "chunk_bytes": CHUNK_BYTES,
        }
        for r, s in job_shapes(ranks)
    }
    server = {"listen": "127.0.0.1:0", "cache_dir": str(cache), "grace_seconds": 2.0}
    if workers > 1:
        server["workers"] = workers
    if metrics:  # /metrics on a port of its own (the ready file names it)
        server["metrics_listen"] = "127.0.0.1:0"
    path.write_text(yaml.safe_dump({"server": server, "jobs": jobs}, sort_keys=False))


def shares_rows(tree: Path) -> bool:
    """Whether a tree's server counts its workers' shared row buffers on /metrics."""
    found = tree / "server/tokenfeed/server/telemetry/metrics.py"
    return found.exists() and "tokenfeed_row_buffers_total" in found.read_text()


def row_buffers(server: ServerProcess) -> str:
    """The node's shared row buffers so far by outcome (laid out, mapped from another
    process, unshared: laid out apart), from the supervisor's /metrics; '' where it has none.
    A growing `unshared` means the workers lay the same buffers out each for itself."""
    address = json.loads(server.ready_file.read_text()).get("metrics", "")
    if not address:
        return ""
    time.sleep(1.5)  # the workers send their counters every second
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as got:
        text = got.read().decode()
    found = dict(re.findall(r'^tokenfeed_row_buffers_total\{outcome="(\w+)"\} (\S+)$', text, re.M))
    return ", ".join(
        f"{k} {float(found.get(k, 0)):.0f}" for k in ("laid_out", "mapped", "unshared")
    )


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


def bare_server(work: Path, size: int, procs: int) -> ServerProcess:
    argv = [sys.executable, "-m", "bench.transport", "serve", "--bytes", str(size)]
    proc = ServerProcess(f"bare-{size}-{procs}", [*argv, "--procs", str(procs)], work)
    proc.start(START_TIMEOUT)
    return proc


def describe(address: str, job: str, env: dict | None) -> tuple[int, str]:
    """(steps per epoch, state) of a job, asked by a client of the server's own tree."""
    code = (
        "from tokenfeed.client import Client; "
        f"i = Client({address!r}, job={job!r}).describe(); "
        "print(i['steps_per_epoch'], i['state'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env() if env is None else env,
        cwd=ROOT,
    ).stdout.split()
    return (int(out[0]), out[1]) if len(out) == 2 else (0, "")


def message_bytes(address: str, job: str, start: int, rank: int, world: int) -> int:
    """The mean serialized size of a job's batch messages of one rank (SIZING_STEPS steps)."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as ch:
        call = ch.unary_stream(
            "/tokenfeed.v1.TokenFeed/StreamBatches",
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
        )
        request = pb.StreamBatchesRequest(
            job=job, start_step=start, end_step=start + SIZING_STEPS, rank=rank, world_size=world
        )
        sizes = [len(m) for m in call(request)]
    return round(sum(sizes) / len(sizes))


def before_tree(work: Path, rev: str) -> tuple[Path, dict]:
    """A worktree of commit `rev` and the environment that runs its server and client."""
    tree = work / f"before-{rev}"
    if not tree.exists():
        # A worktree whose folder was deleted (bench/out cleared) stays registered: forget it.
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), rev],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    env = child_env({"PYTHONPATH": f"{tree / 'server'}:{tree / 'client'}:{ROOT}"})
    return tree, env
