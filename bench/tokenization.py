"""Tokenization at the tokenizer's own speed: every way tokenfeed tokenizes a corpus against the
bare engines, on the same documents and the same cores.

Sides, in one table (MB of text and tokens per second, per core):
- bare `tokenizers`: `encode_batch_fast` over the texts, ENCODE_BATCH_DOCS at a time, all
  threads, in this process: the reference of every hf side;
- bare tiktoken: the `tiktoken.Encoding` that tokenizer/fasttok.py derives from the
  tokenizer.json, its own `encode_to_numpy` over every text on a thread per core, no tokenfeed
  code while timed, each thread with an Encoding of its own (all built before the clock starts):
  the engine at its best, the reference of every tiktoken side ("n/a" where fasttok.py or
  tiktoken is missing or cannot reproduce the tokenizer);
- shared bare tiktoken: the same with one Encoding for every thread, as FastEngine leaves its
  own (settled: its regex caches owned by a thread that has ended), where the threads share its
  regex caches' pools;
- cold bare tiktoken: one Encoding as tiktoken leaves it, one of the timed threads its first
  user (the owner of its regex caches, which slows every thread beside it): what a plain user
  of tiktoken's threads gets;
- fasttok engine: tokenfeed's FastEngine.encode (the same Encoding, HF ids, one array) over all
  the texts at once;
- `tokenfeed build --workers N` with `tokenizer.backend` hf and tiktoken: a new process, as an
  operator runs it; its own elapsed time (build.Progress: from handing out the first chunk to
  the last chunk stored: reading, parsing, tokenizing, writing, worker start-up);
- a server's cold index with each backend: the job's `build_index` in a new process, as a
  server runs it on its `tokenize` pool (`server.tokenize_threads`), from an empty cache;
- `tokenfeed build --ray` on a local cluster of N CPUs (bench/raybuild.py), into a shared store
  (a directory) as Ray builds always do; Ray's own start-up is timed once and left out.

The corpus is bench/corpus.py's: code the project was never tuned on, mostly short documents
(sections of a few KB, as documentation or code corpora are cut) and some long ones, with a
tokenizer trained on it; every side sees the same texts.
Each round runs every side once, from an empty cache and store, in an order that reverses
from one round to the next, so noise falls on all of them; ratios are medians of the rounds'
ratios (time of the bare tokenizer / time of the side: same work on both).

    python -m bench.tokenization [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod

from bench import corpus as corpusmod
from bench import raybuild
from bench.engines import bare_hf, bare_tiktoken, cores, fast_engine, fasttok_engine
from bench.stats import median, paired_ratio
from bench.table import number, render

ROOT = Path(__file__).resolve().parent.parent
JOB = "build"
FILES = 4
BACKENDS = ("hf", "tiktoken")
BUILD_TARGET = 0.90  # tokenfeed build (hf) / bare tokenizers, per core
FAST_TARGET = 0.90  # tokenfeed build (tiktoken) / bare tiktoken, per core
TIKTOKEN_ENGINES = ("bare tiktoken", "shared tiktoken", "cold tiktoken", "fasttok engine")
SIDES = (
    "bare hf",
    "bare tiktoken",
    "shared tiktoken",
    "cold tiktoken",
    "fasttok engine",
    "build hf",
    "build tiktoken",
    "server hf",
    "server tiktoken",
    "ray hf",
    "ray tiktoken",
)


@dataclass(frozen=True)
class TokenizationSizes:
    mb: float  # of text (bench/corpus.py)
    rounds: int
    chunk_bytes: str  # several chunks per process, so that processes overlap
    ray: bool = True


QUICK = TokenizationSizes(mb=10, rounds=2, chunk_bytes="1MiB")
FULL = TokenizationSizes(mb=31, rounds=5, chunk_bytes="4MiB")


@dataclass
class TokenizationResult:
    cores: int
    docs: int
    text_bytes: int
    source_bytes: int
    tokens: int
    chunks: int
    tokenize_threads: int
    chunk_bytes: str
    fast: str  # why bare tiktoken is n/a, or ""
    short_docs: int = 0
    long_docs: int = 0
    seconds: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    command: dict[str, list[float]] = field(default_factory=dict)  # wall of the builds' commands
    ray_start: float = float("nan")

    def per_core(self, side: str, amount: float) -> float:
        seconds = self.seconds[side]
        return amount / median(seconds) / self.cores if seconds else float("nan")

    def ratio(self, side: str, reference: str = "") -> float:
        reference = reference or engine_of(side)
        if not self.seconds[side] or not self.seconds[reference]:
            return float("nan")
        return paired_ratio(self.seconds[reference], self.seconds[side])


def engine_of(side: str) -> str:
    """The bare engine a side is measured against: its own backend's."""
    return "bare tiktoken" if side.endswith("tiktoken") or side == "fasttok engine" else "bare hf"


def write_corpus(root: Path, texts: list[str]) -> int:
    """FILES JSON Lines files; returns their bytes."""
    root.mkdir(parents=True)
    for k in range(FILES):
        part = texts[len(texts) * k // FILES : len(texts) * (k + 1) // FILES]
        (root / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return sum(p.stat().st_size for p in root.iterdir())


def write_config(
    path: Path, corpus: Path, tokenizer: Path, backend: str, chunk_bytes: str, store: Path | None
) -> Path:
    spec = {
        "sources": [str(corpus / "*.jsonl")],
        "tokenizer": {"path": str(tokenizer), "backend": backend},
        "seq_len": 2048,
        "global_batch_size": 8,
        "chunk_bytes": chunk_bytes,
    }
    config: dict = {"server": {"cache_dir": str(path.parent / "cache")}, "jobs": {JOB: spec}}
    if store is not None:
        config["store"] = {"uri": str(store), "node": "bench"}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def server_index(config: Path, expected_docs: int) -> tuple[float, int]:
    """(seconds, tokens) of a server's cold index of the job, in a new process (as a server
    has its own): `server_child`."""
    code = f"from bench.tokenization import server_child; server_child({str(config)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"server index failed ({done.returncode}):\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if figures["state"] != "ready" or figures["docs"] != expected_docs:
        raise RuntimeError(
            f"server index: state {figures['state']} ({figures['error'] or 'no error'}), "
            f"{figures['docs']} documents indexed of {expected_docs}"
        )
    return figures["seconds"], figures["tokens"]


def server_child(config: str) -> None:
    """In a new process: the job's cold index as a server builds it (`build_index` on its
    `tokenize` pool of `server.tokenize_threads`), from an empty cache; prints JSON figures.
    The tokenizer is loaded before the clock starts, as a server loads it on start."""
    cfg = configmod.load(config)
    shutil.rmtree(cfg.server.cache_dir, ignore_errors=True)
    threads = cfg.server.tokenize_threads
    job = build_jobs(cfg)[JOB]

    async def build() -> None:
        with ThreadPoolExecutor(threads, thread_name_prefix="tokenize") as pool:
            await job.build_index(pool, threads, retry=False)

    start = time.perf_counter()
    asyncio.run(build())
    seconds = time.perf_counter() - start
    figures = {
        "seconds": seconds,
        "state": job.state,
        "error": job.error,
        "docs": int(job.index.num_docs.sum()),
        "tokens": int(job.index.num_tokens.sum()),
    }
    print(json.dumps(figures))


def measure(sizes: TokenizationSizes, out: Path) -> TokenizationResult:
    unseen = corpusmod.prepare(sizes.mb, out.resolve())
    tokenizer = unseen.tokenizer
    work = out.resolve() / "tokenization"
    shutil.rmtree(work, ignore_errors=True)
    texts = [
        json.loads(line)["text"]
        for path in sorted(unseen.root.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    source_bytes = write_corpus(work / "corpus", texts)
    n = cores()
    configs = {
        b: write_config(work / f"{b}.yaml", work / "corpus", tokenizer, b, sizes.chunk_bytes, None)
        for b in BACKENDS
    }
    ray_configs = {
        b: write_config(
            work / f"ray-{b}.yaml", work / "corpus", tokenizer, b, sizes.chunk_bytes, work / "store"
        )
        for b in BACKENDS
    }
    _, fast = fast_engine(tokenizer)
    threads = configmod.load(configs["hf"]).server.tokenize_threads
    result = TokenizationResult(
        n,
        len(texts),
        sum(len(t.encode("utf-8")) for t in texts),
        source_bytes,
        0,
        0,
        threads,
        sizes.chunk_bytes,
        fast,
        unseen.short_docs,
        unseen.long_docs,
    )
    source_mb = source_bytes / 1e6
    cluster = None
    temp = Path(tempfile.mkdtemp(prefix="tftok-", dir="/tmp"))  # Ray's socket paths are short
    env = {**os.environ}
    try:
        if sizes.ray:
            cluster = raybuild.Cluster(temp, n)
            result.ray_start, env = cluster.seconds, cluster.env

        def run(side: str) -> float:
            kind, backend = side.split(" ")
            if side == "fasttok engine":
                return fasttok_engine(tokenizer, texts)
            if kind in ("shared", "cold"):
                return bare_tiktoken(tokenizer, texts, "settled" if kind == "shared" else kind)
            if kind == "bare":
                return (
                    bare_hf(tokenizer, texts)
                    if backend == "hf"
                    else bare_tiktoken(tokenizer, texts)
                )
            if kind == "server":
                seconds, tokens = server_index(configs[backend], len(texts))
            else:
                if kind == "build":
                    args, config = ["--workers", str(n)], configs[backend]
                else:
                    args, config = ["--ray", cluster.address], ray_configs[backend]
                rate, wall, result.chunks, tokens = raybuild.build(config, args, env)
                result.command.setdefault(side, []).append(wall)
                seconds = source_mb / rate  # the build's own elapsed time (build.Progress)
            if result.tokens and tokens != result.tokens:  # every side tokenizes the same
                raise RuntimeError(f"{side}: {tokens} tokens, other sides {result.tokens}")
            result.tokens = tokens
            return seconds

        sides = [
            s
            for s in SIDES
            if (sizes.ray or not s.startswith("ray")) and (s not in TIKTOKEN_ENGINES or not fast)
        ]
        for r in range(sizes.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                result.seconds[side].append(run(side))
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(temp, ignore_errors=True)
    return result


def table(r: TokenizationResult) -> str:
    mb, tokens = r.text_bytes / 1e6, r.tokens
    targets = {"build hf": BUILD_TARGET, "build tiktoken": FAST_TARGET}
    labels = {
        "bare hf": f"bare tokenizers (encode_batch_fast, {r.cores} threads)",
        "bare tiktoken": f"bare tiktoken (encode_to_numpy, {r.cores} threads, an Encoding each)",
        "shared tiktoken": "the same, one Encoding for the threads (settled, as FastEngine's)",
        "cold tiktoken": "the same, one Encoding, a timed thread its first user (as tiktoken is)",
        "fasttok engine": "tokenfeed's fasttok engine alone (FastEngine.encode)",
        "build hf": f"tokenfeed build --workers {r.cores}, backend hf",
        "build tiktoken": f"tokenfeed build --workers {r.cores}, backend tiktoken",
        "server hf": f"server cold index, backend hf ({r.tokenize_threads} tokenize threads)",
        "server tiktoken": "server cold index, backend tiktoken",
        "ray hf": f"tokenfeed build --ray ({r.cores} CPUs), backend hf",
        "ray tiktoken": f"tokenfeed build --ray ({r.cores} CPUs), backend tiktoken",
    }
    rows = []
    for side, label in labels.items():
        if side.startswith("ray") and not r.seconds[side]:
            continue
        ratio = r.ratio(side)
        goal = ""
        if side in targets and r.seconds[side]:
            goal = f">= {targets[side]:.2f} ({'met' if ratio >= targets[side] else 'missed'})"
        command = r.command.get(side)
        rows.append(
            [
                label,
                number(r.per_core(side, mb), 2),
                number(r.per_core(side, tokens) / 1e6, 3),
                number(median(r.seconds[side]), 2) if r.seconds[side] else "n/a",
                number(median(command), 2) if command else "",
                number(ratio, 2),
                number(r.ratio(side, "bare hf"), 2),
                goal,
            ]
        )
    rounds = len(r.seconds["bare hf"])
    title = (
        f"2. Tokenization at the tokenizer's speed: {r.docs:,} docs of code ({r.short_docs:,} "
        f"short sections of a few KB, {r.long_docs:,} long modules), {mb:.2f} MB of text "
        f"({r.source_bytes / 1e6:.2f} MB of JSON Lines in {FILES} files, {r.chunks} chunks of "
        f"{r.chunk_bytes}), {tokens:,} tokens; {r.cores} cores\n"
        f"   medians of {rounds} rounds, sides in alternating order; ratios: the median of the "
        "rounds' (bare engine's time / side's time), against the side's own engine (bare "
        "tokenizers for hf, bare tiktoken with an Encoding per thread for tiktoken) and "
        "against bare tokenizers"
    )
    header = [
        "",
        "MB/s/core",
        "M tok/s/core",
        "s",
        "command s",
        "vs own bare engine",
        "vs bare hf",
        "target",
    ]
    notes = [
        "s: the side's own time (builds: from handing out the first chunk to the last chunk "
        "stored, worker start-up included); command s: the whole command (Python start-up, "
        "planning)",
    ]
    if r.fast:
        notes.append(f"bare tiktoken: n/a, {r.fast}")
    notes.append(
        "server cold index / build, per core: "
        f"hf {r.ratio('server hf', 'build hf'):.2f}, "
        f"tiktoken {r.ratio('server tiktoken', 'build tiktoken'):.2f} (>= 1.00: no slower)"
    )
    if r.seconds["ray hf"]:
        notes.append(f"`ray start` took {r.ray_start:.1f}s (in no figure)")
    return render(title, header, rows) + "\n" + "\n".join(notes)


def run(sizes: TokenizationSizes, out: Path) -> str:
    return table(measure(sizes, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus, fewer rounds")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray builds")
    parser.add_argument("--mb", type=float, default=0.0, help="MB of text (default: the size's)")
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.no_ray:
        sizes = dataclasses.replace(sizes, ray=False)
    sizes = dataclasses.replace(sizes, mb=args.mb or sizes.mb, rounds=args.rounds or sizes.rounds)
    print(run(sizes, raybuild.OUT), flush=True)


if __name__ == "__main__":
    main()
