"""Consumer processes of the wire benchmark started together, and the CPU the servers spend
meanwhile: bench/consume.py (tokenfeed's Client) and bench/transport.py's reader (the bare
transport) print the same JSON figures, so either side's processes run the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import child_env
from bench.procs import ROOT, ServerProcess


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_each(pids))


def cpu_each(pids: list[int]) -> list[float]:
    """Each process's user + system CPU seconds (0 for one that is gone)."""
    out = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            out.append(0.0)
            continue
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def pids_of(proc: ServerProcess) -> list[int]:
    info = json.loads(proc.ready_file.read_text())
    return [info["pid"], *info.get("workers", [])]


def together(argvs: list[list[str]], env: dict | None, pids: list[int]) -> tuple[dict, float]:
    """Start the consumer processes, let them connect, start them at once; (their figures
    added up, server CPU seconds over the measured span)."""
    procs = [
        subprocess.Popen(
            [*argv, "--sync"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=child_env() if env is None else env,
        )
        for argv in argvs
    ]
    try:
        for p in procs:
            line = p.stdout.readline().decode().strip()
            if line != "ready":
                raise RuntimeError(f"consumer did not connect: {line!r} (exit {p.wait(60)})")
        each = cpu_each(pids)
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, _ = p.communicate(timeout=900)
            if p.returncode:
                raise RuntimeError(f"consumer exited with {p.returncode}")
            out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
        spent = [a - b for a, b in zip(cpu_each(pids), each, strict=True)]
        cpu = sum(spent)
        if len(pids) > 1:  # where a server's CPU went: its supervisor, then each worker
            print(
                f"server CPU s by process: {' '.join(f'{x:.2f}' for x in spent)}", file=sys.stderr
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    tokens = sum(r["tokens"] for r in out)
    span = max(r["ended"] for r in out) - min(r["began"] for r in out)
    mine = sum(r.get("cpu", 0.0) for r in out)  # the consumers' own CPU seconds
    got = {"tokens": tokens, "seconds": span, "rate": tokens / span, "cpu": mine}
    return {**got, "by_process": spent}, cpu


def busiest(serving: list[float]) -> float | None:
    """The busiest serving process's CPU over their mean (1.00: the streams spread evenly;
    the kernel spreads connections over SO_REUSEPORT sockets by a hash of their addresses, not
    by load), from the serving processes' CPU seconds; None for fewer than two."""
    if len(serving) < 2 or sum(serving) <= 0:
        return None
    return max(serving) / (sum(serving) / len(serving))


def consume_argv(
    address: str, job: str, start: int, steps: int, rank: int, world: int, wrap: int = 0
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.consume",
        *("--target", address, "--job", job, "--start", str(start), "--steps", str(steps)),
        *("--rank", str(rank), "--world", str(world), "--wrap", str(wrap)),
    ]


def read_argv(address: str, messages: int, tokens: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.transport",
        "read",
        *("--target", address, "--messages", str(messages)),
        *("--tokens-per-message", str(tokens)),
    ]


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())
