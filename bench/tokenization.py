"""Tokenization: tokenfeed's index build against a bare `encode_batch_fast` loop, same tokenizer.

The bare loop is the floor of what any indexer must spend: the Rust tokenizer over the same texts,
in the same batches of documents. The index build adds everything tokenfeed does around it:
reading and parsing JSONL chunks, flattening ids into numpy, writing and fsyncing the token store.
Each repeat starts from a freshly loaded tokenizer (its word cache cold) and, for the index, an
empty cache directory; the two sides alternate so noise falls on both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from tokenfeed.server import config as configmod
from tokenfeed.server import democorpus
from tokenfeed.server.app import build_jobs
from tokenfeed.server.tokenize import ENCODE_BATCH_DOCS
from tokenizers import Tokenizer

from bench.stats import median

JOB = "tokenize"
CHUNK_BYTES = "1MiB"


@dataclass(frozen=True)
class TokenizationSizes:
    copies: int  # the demo documents, replicated, so timings are long enough to be stable
    repeats: int  # each figure is the median over repeats


@dataclass
class TokenizationResult:
    docs: int
    text_bytes: int
    chunks: int
    threads: int
    bare_seconds: list[float]
    index_seconds: list[float]

    def docs_per_second(self, seconds: list[float]) -> float:
        return self.docs / median(seconds)

    def mb_per_second(self, seconds: list[float]) -> float:
        return self.text_bytes / 1e6 / median(seconds)


def write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def write_config(path: Path, corpus: Path, tokenizer: Path, threads: int) -> None:
    config = {
        "server": {"cache_dir": str(path.parent / "cache"), "tokenize_threads": threads},
        "jobs": {
            JOB: {
                "sources": [str(corpus)],
                "tokenizer": str(tokenizer),
                "seq_len": 2048,
                "global_batch_size": 8,
                "seed": 1,
                "chunk_bytes": CHUNK_BYTES,
            }
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def time_bare(tokenizer: Path, texts: list[str]) -> float:
    tok = Tokenizer.from_file(str(tokenizer))
    start = time.perf_counter()
    for i in range(0, len(texts), ENCODE_BATCH_DOCS):
        tok.encode_batch_fast(texts[i : i + ENCODE_BATCH_DOCS], add_special_tokens=False)
    return time.perf_counter() - start


def time_index(cfg: configmod.Config, cache: Path, expected_docs: int) -> tuple[float, int]:
    """Seconds to build the job's index from an empty cache, as `tokenfeed inspect` does."""
    shutil.rmtree(cache, ignore_errors=True)
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, cache_dir=str(cache)))
    threads = cfg.server.tokenize_threads
    job = build_jobs(cfg)[JOB]  # lists and plans the chunks, loads the tokenizer: not timed

    async def build() -> None:
        with ThreadPoolExecutor(threads) as pool:
            await job.build_index(pool, threads)

    start = time.perf_counter()
    asyncio.run(build())
    seconds = time.perf_counter() - start
    docs = int(job.index.num_docs.sum())
    if job.state != "ready" or docs != expected_docs:
        raise RuntimeError(
            f"index build: state {job.state} ({job.error or 'no error'}), "
            f"{docs} documents indexed of {expected_docs}"
        )
    return seconds, len(job.index.chunks)


def run(sizes: TokenizationSizes, out: Path, threads: int) -> TokenizationResult:
    _, tokenizer, _ = democorpus.prepare(out / "democorpus")
    texts = democorpus.documents() * sizes.copies
    work = out / "tokenization"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    write_jsonl(corpus, texts)
    config = work / "tokenfeed.yaml"
    write_config(config, corpus, tokenizer, threads)
    cfg = configmod.load(config)

    bare, index, chunks = [], [], 0
    for _ in range(sizes.repeats):
        bare.append(time_bare(tokenizer, texts))
        seconds, chunks = time_index(cfg, work / "cache", len(texts))
        index.append(seconds)
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return TokenizationResult(len(texts), text_bytes, chunks, threads, bare, index)
