"""Many small source objects against a few large ones: `tokenfeed build` of the same documents
laid out as thousands of small .jsonl.gz objects and as 10 large ones, from local files and from
S3 (moto on loopback, tests/s3env.py).

A chunk has fixed costs (four store files and their fsyncs, a manifest, its bookkeeping, at least
one GET), so chunks.py groups consecutive small objects into chunks of up to `chunk_bytes`.
`chunk_bytes` here is the size of the largest large object, so both layouts make about 10
chunks: what differs is only the number of objects behind them. The rate is MB of document text
per second of the whole command (listing, planning, worker start-up, tokenizing, storing), an
empty cache each round; the two layouts alternate so noise falls on both. On S3 the small
layout also pays a LIST page per 1,000 objects and a GET per object (8 in flight per group,
`object_store.max_concurrency`): moto serves them from the same cores the build tokenizes on,
at a few ms of its own CPU each, so each round also times bare boto3 GETs of every small
object, 8 in flight, as the floor any reader of that layout pays on this server.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import yaml
from tokenfeed.server.commands import democorpus

from bench.objstore import CREDENTIALS, from_tests

BUCKET = "tokenfeed-bench-small"
LARGE_OBJECTS = 10
LAYOUTS = ("small", "large")
BACKENDS = ("local", "s3")
UPLOAD_THREADS = 8
GETS_IN_FLIGHT = 8  # object_store.max_concurrency's default: the parts a group reads at once


@dataclass(frozen=True)
class SmallObjectsSizes:
    objects: int  # small objects (the large layout is always LARGE_OBJECTS)
    copies: int  # the demo documents, replicated
    rounds: int


@dataclass
class SmallObjectsResult:
    docs: int
    text_bytes: int
    objects: dict[str, int]  # layout -> objects
    source_bytes: dict[str, int]  # layout -> bytes of its objects (compressed)
    chunk_bytes: int
    chunks: dict[tuple[str, str], int] = field(default_factory=dict)  # (backend, layout)
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    bare_gets: list[float] = field(default_factory=list)  # seconds to GET every small object

    def rate(self, seconds: float) -> float:
        """MB of document text per second."""
        return self.text_bytes / seconds / 1e6


def _gz(texts: list[str]) -> bytes:
    # mtime 0: the same documents give the same bytes (and ETags) every run
    return gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode(), mtime=0)


def _split(texts: list[str], parts: int) -> list[list[str]]:
    """`parts` runs of consecutive documents, as even in count as can be."""
    return [texts[len(texts) * k // parts : len(texts) * (k + 1) // parts] for k in range(parts)]


def write_layouts(root: Path, texts: list[str], objects: int) -> dict[str, Path]:
    dirs = {}
    for layout, n in (("small", objects), ("large", LARGE_OBJECTS)):
        d = dirs[layout] = root / layout
        d.mkdir(parents=True)
        for k, part in enumerate(_split(texts, n)):
            (d / f"part-{k:06d}.jsonl.gz").write_bytes(_gz(part))
    return dirs


def upload(s3, dirs: dict[str, Path]) -> None:
    s3.create_bucket(Bucket=BUCKET)
    jobs = [(f"{layout}/{p.name}", p) for layout, d in dirs.items() for p in sorted(d.iterdir())]
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(
            pool.map(
                lambda kp: s3.put_object(Bucket=BUCKET, Key=kp[0], Body=kp[1].read_bytes()), jobs
            )
        )


def bare_gets(s3, objects: list[str]) -> float:
    """Seconds to GET every one of `objects` once with boto3, GETS_IN_FLIGHT at a time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(GETS_IN_FLIGHT) as pool:
        list(pool.map(lambda key: s3.get_object(Bucket=BUCKET, Key=key)["Body"].read(), objects))
    return time.perf_counter() - started


def write_config(
    path: Path, source: str, tokenizer: Path, cache: Path, chunk_bytes: int, endpoint: str | None
) -> Path:
    config = {
        "server": {"cache_dir": str(cache)},
        "jobs": {
            "build": {
                "sources": [source],
                "tokenizer": str(tokenizer),
                "seq_len": 2048,
                "global_batch_size": 8,
                "chunk_bytes": chunk_bytes,
            }
        },
    }
    if endpoint is not None:
        config["object_store"] = {
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "addressing_style": "path",
        }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def build(config: Path, cache: Path, workers: int) -> tuple[float, int]:
    """(wall seconds of the whole command, chunks built) of `tokenfeed build`, empty cache."""
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "tokenfeed.server.commands.cli",
        "build",
        "--config",
        str(config),
        "--workers",
        str(workers),
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    found = re.search(r"tokenized (\d+) chunks, 0 were already in the store", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"tokenfeed build failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return seconds, int(found.group(1))


def run(sizes: SmallObjectsSizes, out: Path, threads: int) -> SmallObjectsResult:
    _, tokenizer, _ = democorpus.prepare(out.resolve() / "democorpus")
    work = out.resolve() / "smallobjects"
    shutil.rmtree(work, ignore_errors=True)
    texts = democorpus.documents() * sizes.copies
    if len(texts) < sizes.objects:
        raise ValueError(f"{len(texts)} documents cannot fill {sizes.objects} objects")
    dirs = write_layouts(work / "corpus", texts, sizes.objects)
    sizes_of = {layout: [p.stat().st_size for p in d.iterdir()] for layout, d in dirs.items()}
    # Both layouts in about LARGE_OBJECTS chunks: one large object per chunk.
    chunk_bytes = max(sizes_of["large"])
    result = SmallObjectsResult(
        docs=len(texts),
        text_bytes=sum(len(t.encode()) for t in texts),
        objects={layout: len(v) for layout, v in sizes_of.items()},
        source_bytes={layout: sum(v) for layout, v in sizes_of.items()},
        chunk_bytes=chunk_bytes,
    )
    s3env, _ = from_tests()
    with s3env.MotoServer(work) as moto, mock.patch.dict(os.environ, CREDENTIALS):
        s3 = s3env.s3_client(moto.endpoint, max_pool_connections=2 * GETS_IN_FLIGHT)
        upload(s3, dirs)
        small_keys = [f"small/{p.name}" for p in sorted(dirs["small"].iterdir())]
        configs = {}
        for backend in BACKENDS:
            for layout in LAYOUTS:
                source = (
                    f"s3://{BUCKET}/{layout}/*.jsonl.gz"
                    if backend == "s3"
                    else str(dirs[layout] / "*.jsonl.gz")
                )
                endpoint = moto.endpoint if backend == "s3" else None
                cache = work / f"cache-{backend}-{layout}"
                configs[backend, layout] = (
                    write_config(
                        work / f"{backend}-{layout}.yaml",
                        source,
                        tokenizer,
                        cache,
                        chunk_bytes,
                        endpoint,
                    ),
                    cache,
                )
                result.seconds[backend, layout] = []
        for r in range(sizes.rounds):
            result.bare_gets.append(bare_gets(s3, small_keys))
            for backend in BACKENDS:
                for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                    config, cache = configs[backend, layout]
                    seconds, chunks = build(config, cache, threads)
                    result.seconds[backend, layout].append(seconds)
                    result.chunks[backend, layout] = chunks
                    shutil.rmtree(cache, ignore_errors=True)
    return result
