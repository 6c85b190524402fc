"""GetBatch latency at corpus scale: a server holding a 300,000-chunk index beside one holding
100 chunks, real batches over gRPC, p50 and p99 of each (target: ratio at most 1.2); and the
same documents cut into 20,000 real chunks of about 1 KB against 100 chunks.

    python -m bench.scale [--quick]

The server (a child process, `python -m bench.scale serve`) serves two jobs over the same real
chunks: `small`, the 100 chunks of a real corpus as built; `large`, an index of 300,000 chunks
(the size of a 10T-token corpus at 32M tokens a chunk) whose first 100 positions in epoch 0's
chunk order are those same real chunks and whose other 299,900 are synthetic entries (counts
only, as the build records them; never read). The steps measured read only the real chunks, so
both jobs do the same data work: the difference is what a request costs at that index size.

The second server (`python -m bench.scale serve-chunks`) builds two jobs over one JSON Lines file
of REAL_CHUNKS documents of about 1 KB (bench/corpus.py's code, cut at line ends): `many`, one
chunk per document (chunk_bytes 1 KiB), and `few`, the same documents in 100 chunks. Every
chunk is real (tokenized, stored, read): a batch of `many` reads its rows from dozens of chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus

from bench.procs import ServerProcess
from bench.stats import median, percentile
from bench.table import render

LARGE_CHUNKS = 300_000
SEQ_LEN, BATCH, WINDOW = 2048, 8, 4
CHUNK_KIB = 7  # the demo corpus in about 100 chunks
TARGET = 1.2


@dataclass(frozen=True)
class ScaleSizes:
    calls: int  # GetBatch calls per job and round
    rounds: int
    real_chunks: int = 20_000  # of about 1 KB, against the same documents in 100 chunks


QUICK = ScaleSizes(calls=200, rounds=3, real_chunks=5_000)
FULL = ScaleSizes(calls=1000, rounds=5)
DOC_CHARS = 1000  # at least, a document of the real-chunk case (at most twice that)


def _config(work: Path, corpus: Path, tokenizer: Path) -> dict:
    spec = {
        "sources": [str(corpus / "*")],
        "tokenizer": str(tokenizer),
        "seq_len": SEQ_LEN,
        "global_batch_size": BATCH,
        "seed": 1,
        "chunk_bytes": f"{CHUNK_KIB}KiB",
        "window_chunks": WINDOW,
    }
    return {
        "server": {"listen": "127.0.0.1:0", "cache_dir": str(work / "cache")},
        "jobs": {"small": dict(spec), "large": dict(spec)},
    }


async def _serve(work: Path, ready_file: str) -> None:
    from tokenfeed.server.indexing.index import READY
    from tokenfeed.server.jobs.stack import build_jobs
    from tokenfeed.server.objstore.objects import ObjectInfo
    from tokenfeed.server.sampling.bijection import permute, round_keys
    from tokenfeed.server.settings import config as configmod
    from tokenfeed.server.source.chunks import Chunk

    corpus, tokenizer, _ = democorpus.prepare(work.parent / "democorpus")
    config = configmod.from_dict(_config(work, corpus, tokenizer))
    jobs = build_jobs(config)
    small, large = jobs["small"], jobs["large"]
    with ThreadPoolExecutor(2) as pool:
        await small.build_index(pool, 2, retry=False)
        await large.plans.open(pool)  # built by hand below: its plan log is opened here
    real = small.index
    n_real = min(100, len(real.chunks))
    # The large index: epoch 0's first n_real positions hold the small job's chunks, in the
    # small job's epoch-0 order; every other position a synthetic chunk of the same sizes.
    name = large.index.dataset.name
    order0 = permute(np.arange(LARGE_CHUNKS), LARGE_CHUNKS, round_keys("chunks", 1, name, 0))
    chunks: list = [None] * LARGE_CHUNKS
    for p in range(n_real):
        chunks[int(order0[p])] = real.chunks[int(real.order0[p])]
    size = CHUNK_KIB * 1024
    fake = ObjectInfo("/synthetic/shard.jsonl", size * LARGE_CHUNKS, "0")
    for i in range(LARGE_CHUNKS):
        if chunks[i] is None:
            chunks[i] = Chunk(fake, "jsonl", "text", i * size, (i + 1) * size)
    idx = large.index
    idx.adopt(chunks)
    mean_docs = int(real.num_docs.mean())
    mean_tokens = int(real.num_tokens.mean())
    idx.num_docs[:], idx.num_tokens[:] = mean_docs, mean_tokens
    for p in range(n_real):
        big, small_id = int(order0[p]), int(real.order0[p])
        idx.num_docs[big], idx.num_tokens[big] = real.num_docs[small_id], real.num_tokens[small_id]
        idx.body_bytes[big] = real.body_bytes[small_id]
    idx.units_per_chunk[:] = idx.num_tokens + idx.num_docs
    idx.units_per_epoch = int(idx.units_per_chunk.sum())
    idx.state = READY
    large._ready.set()
    # Steps whose rows lie in windows made of real chunks only (the last real window's rows
    # read on into the next window: stop one window short).
    real_units = int(idx.units_per_chunk[order0[: (n_real // WINDOW - 1) * WINDOW]].sum())
    steps = real_units // SEQ_LEN // BATCH
    await _front_until_stopped(
        config, jobs, ready_file, steps=steps, real_chunks=n_real, large_chunks=LARGE_CHUNKS
    )


async def _front_until_stopped(config, jobs: dict, ready_file: str, **ready: object) -> None:
    """Serve `jobs` on a front until SIGTERM; the ready file says where, with `ready`."""
    from tokenfeed.server.serve.background import write_ready
    from tokenfeed.server.serve.front import Front

    front = Front(config, jobs, ThreadPoolExecutor(2))
    await front.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    write_ready(ready_file, {"address": front.address, "pid": os.getpid(), **ready})
    await stop.wait()
    await front.drain()


def small_documents(count: int) -> list[str]:
    """`count` documents of about DOC_CHARS characters: bench/corpus.py's code, cut at line
    ends."""
    from bench import corpus as corpusmod

    out: list[str] = []
    for doc in corpusmod.documents(int(count * DOC_CHARS * 1.2))[0]:
        piece: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= DOC_CHARS:  # a JSON line over 1 KiB: one document per chunk
                out.append("".join(piece)[: DOC_CHARS * 2])
                piece, size = [], 0
                if len(out) == count:
                    return out
    return out


async def _serve_chunks(work: Path, ready_file: str, count: int) -> None:
    """Jobs `many` (a chunk per document) and `few` (100 chunks) over the same documents."""
    from tokenfeed.server.jobs.stack import build_jobs
    from tokenfeed.server.settings import config as configmod

    from bench import corpus as corpusmod

    corpus = corpusmod.prepare(31.0, work.parent)
    docs = small_documents(count)
    source = work / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = {
        "sources": [str(source)],
        "tokenizer": str(corpus.tokenizer),
        "seq_len": SEQ_LEN,
        "global_batch_size": BATCH,
        "seed": 1,
    }
    few_bytes = source.stat().st_size // 100 + 1
    raw = {
        "server": {"listen": "127.0.0.1:0", "cache_dir": str(work / "cache-chunks")},
        "jobs": {
            "many": {**spec, "chunk_bytes": "1KiB"},
            "few": {**spec, "chunk_bytes": few_bytes},
        },
    }
    config = configmod.from_dict(raw)
    jobs = build_jobs(config)
    started = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for job in jobs.values():
            await job.build_index(pool, 2, retry=False)
    built = time.perf_counter() - started
    await _front_until_stopped(
        config,
        jobs,
        ready_file,
        chunks={n: len(j.indexes[0].chunks) for n, j in jobs.items()},
        steps=min(j.steps_per_epoch for j in jobs.values()),
        docs=len(docs),
        bytes=source.stat().st_size,
        build_seconds=built,
    )


def measure(client: Client, job: str, steps: int, calls: int) -> list[float]:
    out = []
    for i in range(calls):
        started = time.perf_counter()
        client.get_batch(i % steps, job=job)
        out.append(time.perf_counter() - started)
    return out


def latencies(address: str, jobs: tuple[str, ...], steps: int, sizes: ScaleSizes) -> dict:
    """GetBatch seconds per job: a warm pass over every step first (every chunk opened and
    laid out, layouts made), then rounds in alternating job order."""
    lat: dict[str, list[float]] = {job: [] for job in jobs}
    with Client(address) as c:
        for job in lat:
            measure(c, job, steps, steps)
        for r in range(sizes.rounds):
            for job in jobs if r % 2 == 0 else jobs[::-1]:
                lat[job] += measure(c, job, steps, sizes.calls)
    return lat


def ratio_rows(small: list[float], large: list[float]) -> list[list[str]]:
    rows = []
    for q in (50, 99):
        s, big = percentile(small, q) * 1e3, percentile(large, q) * 1e3
        ok = "met" if big / s <= TARGET else "missed"
        rows.append(
            [
                f"GetBatch p{q} (ms)",
                f"{s:.3f}",
                f"{big:.3f}",
                f"{big / s:.2f}",
                f"<= {TARGET} ({ok})",
            ]
        )
    rows.append(
        [
            "GetBatch median (ms)",
            f"{median(small) * 1e3:.3f}",
            f"{median(large) * 1e3:.3f}",
            "",
            "",
        ]
    )
    return rows


def run_real_chunks(sizes: ScaleSizes, out: Path) -> str:
    work = out / "scale-chunks"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    argv = [sys.executable, "-m", "bench.scale", "serve-chunks", "--work", str(work)]
    server = ServerProcess("scale-chunks", [*argv, "--chunks", str(sizes.real_chunks)], work)
    address = server.start(1800)
    info = json.loads(server.ready_file.read_text())
    try:
        lat = latencies(address, ("few", "many"), info["steps"], sizes)
    finally:
        server.stop(30)
    few, many = info["chunks"]["few"], info["chunks"]["many"]
    return render(
        f"GetBatch over real chunks: {info['docs']:,} documents of about 1 KB "
        f"({info['bytes'] / 1e6:.1f} MB of JSON Lines) in {many:,} chunks against the same in "
        f"{few} chunks; [{BATCH}, {SEQ_LEN}] batches over gRPC, steps 0..{info['steps'] - 1} "
        f"(warm), {len(lat['few'])} calls per job in {sizes.rounds} alternating rounds; both "
        f"built in {info['build_seconds']:.0f}s",
        ["", f"{few} chunks", f"{many:,} chunks", "ratio", "target"],
        ratio_rows(lat["few"], lat["many"]),
    )


def run(sizes: ScaleSizes, out: Path) -> str:
    return f"{run_synthetic(sizes, out)}\n\n{run_real_chunks(sizes, out)}"


def run_synthetic(sizes: ScaleSizes, out: Path) -> str:
    work = out / "scale"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = ServerProcess(
        "scale", [sys.executable, "-m", "bench.scale", "serve", "--work", str(work)], work
    )
    address = server.start(600)
    info = json.loads(server.ready_file.read_text())
    steps = info["steps"]
    lat: dict[str, list[float]] = {"small": [], "large": []}
    try:
        with Client(address) as c:
            for job in lat:  # warm: every step's chunks opened and laid out, layouts made
                measure(c, job, steps, steps)
            for _ in range(sizes.rounds):
                for job in lat:
                    lat[job] += measure(c, job, steps, sizes.calls)
    finally:
        server.stop(30)
    rows = []
    for q in (50, 99):
        s, large = percentile(lat["small"], q) * 1e3, percentile(lat["large"], q) * 1e3
        ok = "met" if large / s <= TARGET else "missed"
        rows.append(
            [
                f"GetBatch p{q} (ms)",
                f"{s:.3f}",
                f"{large:.3f}",
                f"{large / s:.2f}",
                f"<= {TARGET} ({ok})",
            ]
        )
    rows.append(
        [
            "GetBatch median (ms)",
            f"{median(lat['small']) * 1e3:.3f}",
            f"{median(lat['large']) * 1e3:.3f}",
            "",
            "",
        ]
    )
    return render(
        f"GetBatch at corpus scale: {info['real_chunks']} real chunks vs an index of "
        f"{info['large_chunks']:,} chunks whose first {info['real_chunks']} are those; "
        f"[{BATCH}, {SEQ_LEN}] batches over gRPC, steps 0..{steps - 1}, "
        f"{len(lat['small'])} calls per job in {sizes.rounds} alternating rounds",
        ["", f"{info['real_chunks']} chunks", f"{LARGE_CHUNKS:,} chunks", "ratio", "target"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode", nargs="?", default="run", choices=("run", "serve", "serve-chunks", "chunks")
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--work", default="")
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--chunks", type=int, default=FULL.real_chunks)
    a = parser.parse_args()
    if a.mode in ("serve", "serve-chunks"):
        import uvloop

        if a.mode == "serve":
            uvloop.run(_serve(Path(a.work), a.ready_file))
        else:
            uvloop.run(_serve_chunks(Path(a.work), a.ready_file, a.chunks))
        return
    if a.mode == "chunks":  # the real-chunk case alone
        out = Path(__file__).resolve().parent / "out"
        print(run_real_chunks(QUICK if a.quick else FULL, out))
        return
    print(run(QUICK if a.quick else FULL, Path(__file__).resolve().parent / "out"))


if __name__ == "__main__":
    main()
