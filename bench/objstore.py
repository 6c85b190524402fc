"""Object storage and the disk cache: a cold start from S3, what it fetches, a warm restart.

The S3-compatible server is moto's, on loopback in a child process (tests/s3env.py), so what is
measured is tokenfeed's own work around object storage: listing, ranged GETs of aligned blocks,
slivers fetched alone, the block and token caches. moto reads the whole object for every ranged
GET, so the objects are kept small (at most about 2.5 MiB) lest moto's costs swamp tokenfeed's.

Each round starts real `tokenfeed serve` processes on one corpus, in a bucket and as local files:
one of each on a fresh cache (cold), then one of each on the cache its cold run left (warm).
Starts are one at a time, each timed to its first batch. Then the two servers of a pair serve the
rest of the epoch, which touches every chunk, step by step in turn: a slow spell of a noisy
machine hits both sides alike, and so does the ratio of their rates. After the epoch the cold S3
server's metrics count every byte the epoch needed; the warm ones show what a restart costs once
the disk cache holds the tokens. Which side starts first alternates by round.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
import zstandard
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus

from bench.procs import ROOT, ServerProcess, Stopped
from bench.serving import GLOBAL_BATCH, SEQ_LEN

JOB = "objstore"
BUCKET = "tokenfeed-bench"
PREFIX = "corpus"
# The daemon's defaults (8 MiB blocks, 64 MiB chunks) scaled down to a corpus of a few MB, so
# that objects span several chunks and chunks several blocks.
BLOCK_BYTES = 256 * 2**10
CHUNK_BYTES = 4 * BLOCK_BYTES  # a multiple of the block: a chunk's middle is whole blocks
OBJECT_BYTES = 5 * CHUNK_BYTES // 2  # JSON Lines objects are cut at about this size, mid-chunk
PARQUET_ROW_GROUPS = 4
GRACE_SECONDS = 5.0
START_TIMEOUT = 60.0
# The first GetBatch waits for the whole index; the server answers UNAVAILABLE after its
# max_wait_seconds and the client retries until this.
FIRST_BATCH_TIMEOUT = 120.0
# moto takes any credentials; these keep boto3 in the servers away from real ones.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SIDES = ("s3", "local")
OPS = ("get", "head", "list")


@dataclass(frozen=True)
class ObjstoreSizes:
    copies: int  # the demo documents, replicated, so the corpus spans several objects
    rounds: int  # each figure is the median over rounds


@dataclass
class Start:
    """One server process: from launch to the end of its first epoch."""

    first_batch: float  # seconds from launching the process to step 0's batch
    fingerprints: list[str]  # of every step of the epoch
    num_chunks: int = 0
    # GetBatch calls of the rest of the epoch (steps 1 to the last): time in them, tokens got
    seconds: float = 0.0
    tokens: int = 0
    # From the process's metrics after the epoch, so over its whole life: bytes received from
    # object storage, and requests (attempts, whatever their outcome) by operation.
    fetched_bytes: float = 0.0
    requests: dict[str, float] = field(default_factory=dict)
    stopped: Stopped | None = None

    @property
    def gets(self) -> float:
        return self.requests.get("get", 0.0)

    @property
    def rate(self) -> float:
        """GetBatch tokens/s over the epoch after step 0."""
        return self.tokens / self.seconds if self.seconds else float("nan")


@dataclass
class Corpus:
    paths: list[Path]  # the local copies of the objects, in URI order
    docs: int
    jsonl: int  # objects of each format
    zst: int
    parquet: int

    @property
    def source_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


@dataclass
class ObjstoreResult:
    corpus: Corpus
    tokenizer_bytes: int
    steps_per_epoch: int
    # side -> one Start per round
    cold: dict[str, list[Start]] = field(default_factory=lambda: {s: [] for s in SIDES})
    warm: dict[str, list[Start]] = field(default_factory=lambda: {s: [] for s in SIDES})

    @property
    def needed_bytes(self) -> int:
        """What serving an epoch must read at least once: every source object and the
        tokenizer."""
        return self.corpus.source_bytes + self.tokenizer_bytes

    def mismatches(self) -> int:
        """Steps whose batch from S3 differs from local files' in the same round."""
        pairs = [
            (s3.fingerprints, local.fingerprints)
            for kind in (self.cold, self.warm)
            for s3, local in zip(kind["s3"], kind["local"], strict=True)
        ]
        return sum(
            abs(len(a) - len(b)) + sum(x != y for x, y in zip(a, b, strict=False)) for a, b in pairs
        )

    def stops(self) -> list[Stopped]:
        return [
            s.stopped
            for kind in (self.cold, self.warm)
            for side in SIDES
            for s in kind[side]
            if s.stopped is not None
        ]


def from_tests():
    """tests/s3env.py (moto's server in a child process, a boto3 client for it) and
    tests/support.py (metrics scrapes), imported on first use: they need the dev extras
    (moto, pytest), which the other sections do without."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    import s3env
    import support

    return s3env, support


def _jsonl(docs: list[str], first_id: int) -> bytes:
    return "".join(
        json.dumps({"id": first_id + i, "text": d}) + "\n" for i, d in enumerate(docs)
    ).encode()


def write_corpus(out: Path, copies: int) -> Corpus:
    """The demo documents `copies` times over: half a copy as one .jsonl.zst object (one chunk,
    read whole), half a copy as Parquet (a chunk per row group), the rest as JSON Lines objects
    of about OBJECT_BYTES (byte-range chunks, slivers at their edges)."""
    docs = democorpus.documents()
    texts, half = docs * copies, len(docs) // 2
    zst, parquet, rest = texts[:half], texts[half : 2 * half], texts[2 * half :]
    groups, group, size = [], [], 0
    for text in rest:
        group.append(text)
        size += len(text.encode()) + 30  # the JSON around it, roughly
        if size >= OBJECT_BYTES:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    out.mkdir(parents=True)
    paths, first = [], 2 * half
    for i, group in enumerate(groups):
        paths.append(out / f"docs-{i:03d}.jsonl")
        paths[-1].write_bytes(_jsonl(group, first))
        first += len(group)
    paths.append(out / f"docs-{len(groups):03d}.jsonl.zst")
    paths[-1].write_bytes(zstandard.ZstdCompressor(level=3).compress(_jsonl(zst, 0)))
    paths.append(out / f"docs-{len(groups) + 1:03d}.parquet")
    table = pa.table({"text": parquet})  # only the text: every byte of it is needed
    pq.write_table(table, paths[-1], row_group_size=-(-len(parquet) // PARQUET_ROW_GROUPS))
    return Corpus(paths, len(texts), len(groups), 1, 1)


def upload(s3, corpus: Corpus, tokenizer: Path) -> None:
    """One PUT per object (single-part, so each ETag is the MD5 that whole reads check)."""
    s3.create_bucket(Bucket=BUCKET)
    for path in corpus.paths:
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.name}", Body=path.read_bytes())
    s3.put_object(Bucket=BUCKET, Key="tokenizer.json", Body=tokenizer.read_bytes())


def write_config(
    path: Path, source: str, tokenizer: str, cache: Path, threads: int, endpoint: str | None
) -> None:
    config = {
        "server": {
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "cache_dir": str(cache),
            "tokenize_threads": threads,
            "grace_seconds": GRACE_SECONDS,
        },
        "jobs": {
            JOB: {
                "sources": [source],
                "tokenizer": tokenizer,
                "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH,
                "seed": 1,
                "chunk_bytes": CHUNK_BYTES,
                "window_chunks": 4,
            }
        },
    }
    if endpoint is not None:
        config["object_store"] = {
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "addressing_style": "path",
            "block_bytes": BLOCK_BYTES,
        }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def launch(
    name: str, config: Path, work: Path, stack: ExitStack
) -> tuple[ServerProcess, Client, Start]:
    """Launch a server and time it to its first batch; both are closed with `stack`."""
    argv = [str(Path(sys.executable).parent / "tokenfeed"), "serve", "--config", str(config)]
    proc = stack.enter_context(ServerProcess(name, argv, work))
    begin = time.perf_counter()
    address = proc.start(START_TIMEOUT)
    client = stack.enter_context(Client(address, job=JOB, timeout=FIRST_BATCH_TIMEOUT))
    first = client.get_batch(0)
    return proc, client, Start(time.perf_counter() - begin, [first.fingerprint])


def serve_pair(
    kind: str, order: tuple[str, ...], configs: dict[str, Path], work: Path, support
) -> dict[str, Start]:
    """Start the servers of `order` one after the other, serve the rest of the epoch from both
    in turn, read their metrics, stop them."""
    with ExitStack() as stack:
        running = {side: launch(f"{side}-{kind}", configs[side], work, stack) for side in order}
        steps = {}
        for side, (_, client, result) in running.items():
            info = client.describe()
            steps[side] = int(info["steps_per_epoch"])  # int64 fields arrive as JSON strings
            result.num_chunks = int(info["num_chunks"])
        for step in range(1, min(steps.values())):
            for side in order if step % 2 else order[::-1]:
                _, client, result = running[side]
                begin = time.perf_counter()
                batch = client.get_batch(step)
                result.seconds += time.perf_counter() - begin
                result.tokens += batch["input_ids"].size
                result.fingerprints.append(batch.fingerprint)
        for proc, client, result in running.values():
            client.close()
            samples = support.scrape(json.loads(proc.ready_file.read_text())["metrics"])
            result.fetched_bytes = support.metric(samples, "tokenfeed_object_store_bytes_total")
            result.requests = {
                op: support.metric(samples, "tokenfeed_object_store_requests_total", op=op)
                for op in OPS
            }
            result.stopped = proc.stop(GRACE_SECONDS + 10)
        return {side: result for side, (_, _, result) in running.items()}


def run(sizes: ObjstoreSizes, out: Path, threads: int) -> ObjstoreResult:
    s3env, support = from_tests()
    _, tokenizer, _ = democorpus.prepare(out.resolve() / "democorpus")
    work = out.resolve() / "objstore"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = write_corpus(work / "corpus", sizes.copies)
    result = ObjstoreResult(corpus, tokenizer.stat().st_size, 0)
    caches = {side: work / f"cache-{side}" for side in SIDES}
    configs = {side: work / f"{side}.yaml" for side in SIDES}
    with s3env.MotoServer(work) as moto, mock.patch.dict(os.environ, CREDENTIALS):
        upload(s3env.s3_client(moto.endpoint), corpus, tokenizer)
        write_config(
            configs["s3"],
            f"s3://{BUCKET}/{PREFIX}/*",
            f"s3://{BUCKET}/tokenizer.json",
            caches["s3"],
            threads,
            moto.endpoint,
        )
        write_config(
            configs["local"],
            str(work / "corpus" / "*"),
            str(tokenizer),
            caches["local"],
            threads,
            None,
        )
        for r in range(sizes.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for cache in caches.values():
                shutil.rmtree(cache, ignore_errors=True)  # cold: an empty cache
            for kind, starts in (("cold", result.cold), ("warm", result.warm)):
                # warm: the same configs again, so each server finds the cache its cold run left
                for side, one in serve_pair(f"{kind}-{r}", order, configs, work, support).items():
                    starts[side].append(one)
    result.steps_per_epoch = len(result.cold["s3"][0].fingerprints)
    return result
