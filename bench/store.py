"""The token store at corpus scale: a server's memory and step-lookup cost over a synthetic
300,000-chunk index. (How fast the store is built, against the bare tokenizer: section 2,
bench/tokenization.py.)

A child process (a clean RSS) plans a job over 300,000 chunks of 128 MiB (32M tokens each:
about 10 trillion tokens) in 37,500 objects of 1 GiB, with rows per chunk set as the build
would, and looks up random steps at every order of magnitude across the first epochs. The index
is what a server holds for such a corpus: chunk bodies are opened per batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokenfeed.server.commands import democorpus

from bench.stats import median

INDEX_CHUNKS = 300_000
CHUNKS_PER_OBJECT = 8
TOKENS_PER_CHUNK = 32_000_000
SEQ_LEN, BATCH = 4096, 1024
MAGNITUDES = (0, 10**3, 10**4, 10**5, 10**6, 2 * 10**6, 10**7, 10**8)


@dataclass(frozen=True)
class StoreSizes:
    lookups: int  # random steps per order of magnitude


@dataclass
class StoreResult:
    index: dict


def _index(lookups: int) -> dict:
    code = f"from bench.store import index_child; index_child({lookups})"
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def index_child(lookups: int) -> None:
    """In a fresh process: a 300k-chunk index, random step lookups; prints JSON figures."""
    import numpy as np
    from tokenfeed.server.indexing.index import READY
    from tokenfeed.server.jobs.stack import build_jobs
    from tokenfeed.server.objstore.objects import ObjectInfo
    from tokenfeed.server.settings import config as configmod
    from tokenfeed.server.source.chunks import Chunk

    base = _status_mb("VmRSS")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenfeed-bench-index-{os.getpid()}"
    tok = democorpus.prepare(Path(__file__).resolve().parent / "out" / "democorpus")[1]
    raw = {
        "server": {"cache_dir": str(work)},
        "jobs": {
            "big": {
                "sources": ["s3://bench/*.jsonl"],
                "tokenizer": str(tok),
                "seq_len": SEQ_LEN,
                "global_batch_size": BATCH,
                "chunk_bytes": "128MiB",
                "window_chunks": 8,
            }
        },
    }
    job = build_jobs(configmod.from_dict(raw))["big"]
    size = 128 * 2**20
    started = time.perf_counter()
    chunks = []
    for o in range(INDEX_CHUNKS // CHUNKS_PER_OBJECT):
        obj = ObjectInfo(
            f"s3://bench/corpus/shard-{o:06d}.jsonl", size * CHUNKS_PER_OBJECT, f'"{o:032x}"'
        )
        chunks += [
            Chunk(obj, "jsonl", "text", k * size, (k + 1) * size) for k in range(CHUNKS_PER_OBJECT)
        ]
    idx = job.index
    idx.adopt(chunks)
    rng = np.random.default_rng(0)
    n = len(chunks)
    idx.num_docs[:] = 8000  # what the build records for each chunk, without tokenizing
    idx.num_tokens[:] = TOKENS_PER_CHUNK + rng.integers(-(10**6), 10**6, n)
    idx.units_per_chunk[:] = idx.num_tokens + idx.num_docs  # each document ends with EOS
    idx.units_per_epoch = int(idx.units_per_chunk.sum())
    idx.state = READY
    planned = time.perf_counter() - started
    after_index = _status_mb("VmRSS")
    steps_per_epoch = idx.rows_per_epoch // BATCH
    cold, warm = {}, {}
    for m in MAGNITUDES:
        steps = [m + int(s) for s in rng.integers(0, max(m, 10), lookups)]
        first, again = [], []
        for s in steps:
            t = time.perf_counter()
            job.plan(s, 0, 1)
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            job.plan(s, 0, 1)
            again.append(time.perf_counter() - t)
        cold[m], warm[m] = median(first), median(again)
    shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "chunks": n,
                "objects": n // CHUNKS_PER_OBJECT,
                "tokens": int(idx.num_tokens.sum()),
                "steps_per_epoch": steps_per_epoch,
                "rss_base_mb": base,
                "rss_index_mb": after_index,
                "rss_end_mb": _status_mb("VmRSS"),
                "hwm_mb": _status_mb("VmHWM"),
                "plan_seconds": planned,
                "cold": {str(k): v for k, v in cold.items()},
                "warm": {str(k): v for k, v in warm.items()},
            }
        )
    )


def run(sizes: StoreSizes, out: Path) -> StoreResult:
    democorpus.prepare(out / "democorpus")  # the index's job names the demo tokenizer
    return StoreResult(_index(sizes.lookups))
