"""The Ray build against the one-machine build: `tokenfeed build --ray ADDRESS` on a local Ray
cluster (`ray start --head` on loopback, one CPU per core) against `tokenfeed build --workers N`
(N = cores), on the same corpus (the demo documents, replicated) into the same kind of shared
store (a directory, so that the figures are tokenization and orchestration, not S3).

Figures are MB of source and tokens per second of the build itself (build.Progress's last line
in both: from handing out the first chunk, after planning and listing, to the last chunk done,
worker start-up included) and of the whole command (Python and Ray start-up, connecting,
planning), divided by the cores.
Every round starts from an empty store and cache; the two builders alternate so noise falls on
both. The cluster's own start-up (`ray start`) is timed once and counted in neither.

    python -m bench.raybuild [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tokenfeed.server.commands import democorpus

from bench.stats import median, paired_ratio
from bench.table import number, render

OUT = Path(__file__).resolve().parent / "out"
CHUNK_BYTES = "512KiB"  # small, so that a small corpus still has chunks for every core
FILES = 8
# Ray on loopback only, with a token of this run's: see tests/integration/test_ray_build.py.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": uuid.uuid4().hex,
}
BUILDERS = ("workers", "ray")
# Both builders end with build.Progress's line: rates since the chunks were handed out.
FINAL = re.compile(
    r"\[100\.0%\] (\d+)/\d+ chunks, [\d,]+ docs, ([\d,]+) tokens, "
    r"([\d.]+) MB/s"
)


@dataclass(frozen=True)
class RayBuildSizes:
    copies: int  # the demo documents, replicated
    rounds: int


QUICK, FULL = RayBuildSizes(copies=8, rounds=1), RayBuildSizes(copies=24, rounds=3)


@dataclass
class RayBuildResult:
    cores: int
    mb: float  # of source per build
    tokens: int
    chunks: int
    cluster_start: float  # seconds of `ray start --head`
    build: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BUILDERS})
    wall: dict[str, list[float]] = field(default_factory=lambda: {b: [] for b in BUILDERS})


class Cluster:
    """`ray start --head --block` on loopback in its own session; stop() ends all of it."""

    def __init__(self, temp: Path, cpus: int):
        self.temp, self.env = temp, {**os.environ, **RAY_ENV}
        self.log = temp / "ray-start.log"
        ray = Path(sys.executable).parent / "ray"
        cmd = [
            str(ray),
            "start",
            "--head",
            "--block",
            "--port=0",
            f"--num-cpus={cpus}",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ]
        started = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        while b"Ray runtime started" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.perf_counter() - started > 120:
                self.stop()
                raise RuntimeError(f"ray start failed:\n{self.log.read_text(errors='replace')}")
            time.sleep(0.05)
        self.seconds = time.perf_counter() - started
        self.address = (temp / "ray_current_cluster").read_text().strip()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def write_corpus(root: Path, copies: int) -> tuple[float, int]:
    """(MB, documents) of JSON Lines in FILES files."""
    texts = democorpus.documents() * copies
    root.mkdir(parents=True)
    for k in range(FILES):
        part = texts[len(texts) * k // FILES : len(texts) * (k + 1) // FILES]
        (root / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return sum(p.stat().st_size for p in root.iterdir()) / 1e6, len(texts)


def write_config(path: Path, corpus: Path, tokenizer: Path, store: Path) -> Path:
    config = {
        "server": {"cache_dir": str(path.parent / "cache")},
        "jobs": {
            "build": {
                "sources": [str(corpus / "*.jsonl")],
                "tokenizer": str(tokenizer),
                "seq_len": 2048,
                "global_batch_size": 8,
                "chunk_bytes": CHUNK_BYTES,
            }
        },
        "store": {"uri": str(store), "node": "bench"},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def build(config: Path, args: list[str], env: dict) -> tuple[float, float, int, int]:
    """(MB/s while building, wall seconds, chunks, tokens) of one build into an empty store."""
    work = config.parent
    shutil.rmtree(work / "cache", ignore_errors=True)
    shutil.rmtree(work / "store", ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "tokenfeed.server.commands.cli",
        "build",
        "--config",
        str(config),
        *args,
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    found = FINAL.findall(done.stderr)
    if done.returncode != 0 or not found or "tokenized 0" in done.stderr:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    chunks, tokens, rate = found[-1]
    return float(rate), wall, int(chunks), int(tokens.replace(",", ""))


def measure(sizes: RayBuildSizes, out: Path) -> RayBuildResult:
    _, tokenizer, _ = democorpus.prepare(out.resolve() / "democorpus")
    work = out.resolve() / "raybuild"
    shutil.rmtree(work, ignore_errors=True)
    mb, _ = write_corpus(work / "corpus", sizes.copies)
    config = write_config(work / "tf.yaml", work / "corpus", tokenizer, work / "store")
    cores = os.cpu_count() or 1
    temp = Path(tempfile.mkdtemp(prefix="tfray-", dir="/tmp"))  # Ray's socket paths are short
    cluster = Cluster(temp, cores)
    try:
        result = RayBuildResult(cores, mb, 0, 0, cluster.seconds)
        runs = {"workers": ["--workers", str(cores)], "ray": ["--ray", cluster.address]}
        for r in range(sizes.rounds):
            for builder in BUILDERS if r % 2 == 0 else BUILDERS[::-1]:
                rate, wall, chunks, tokens = build(config, runs[builder], cluster.env)
                result.build[builder].append(mb / rate)
                result.wall[builder].append(wall)
                result.chunks, result.tokens = chunks, tokens
    finally:
        cluster.stop()
        shutil.rmtree(temp, ignore_errors=True)
    return result


def table(r: RayBuildResult) -> str:
    rows = []
    labels = {
        "workers": f"tokenfeed build --workers {r.cores}",
        "ray": f"tokenfeed build --ray (local cluster, {r.cores} CPUs)",
    }
    for builder, label in labels.items():
        build_s, wall_s = median(r.build[builder]), median(r.wall[builder])
        per_core = r.cores * build_s
        rows.append(
            [
                label,
                number(r.mb / per_core, 2),
                number(r.tokens / per_core / 1e6, 2),
                number(r.mb / wall_s / r.cores, 2),
                number(build_s, 1),
                number(wall_s, 1),
            ]
        )
    ratio = paired_ratio(r.build["workers"], r.build["ray"])
    wall_ratio = paired_ratio(r.wall["workers"], r.wall["ray"])
    rows.append(
        [
            "ray / workers (paired, per core)",
            number(ratio, 2),
            number(ratio, 2),
            number(wall_ratio, 2),
            "",
            "",
        ]
    )
    rounds = len(r.build["ray"])
    title = (
        f"Ray build vs one-machine build: {r.mb:.1f} MB of JSON Lines, {r.chunks} "
        f"chunks of {CHUNK_BYTES}, {r.tokens:,} tokens, {r.cores} cores; medians of "
        f"{rounds} round(s); `ray start` took {r.cluster_start:.1f}s"
    )
    header = [
        "builder",
        "MB/s per core",
        "M tokens/s per core",
        "MB/s per core (command)",
        "build s",
        "command s",
    ]
    return render(title, header, rows)


def run(quick: bool) -> str:
    return table(measure(QUICK if quick else FULL, OUT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus, one round")
    print(run(parser.parse_args().quick))


if __name__ == "__main__":
    main()
