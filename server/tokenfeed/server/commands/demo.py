"""`make demo`: the whole serving path on local files, end to end, with no external service.

Prepares a small real-text corpus and a tokenizer (democorpus.py), writes a config, starts
`tokenfeed serve` as a real process on a loopback port, pulls batches with the client, prints
decoded rows and a throughput line, then stops the server with SIGTERM (graceful drain).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tokenfeed.client import Client
from tokenfeed.server.commands import democorpus
from tokenfeed.server.settings.config import TokenizerSpec
from tokenfeed.server.tokenizer.tokenize import TextTokenizer

CONFIG = """\
# tokenfeed demo config: one job over the local demo corpus.
server:
  listen: 127.0.0.1:0
  cache_dir: cache
  tokenize_threads: 2
jobs:
  demo:
    sources:
      - corpus/*.jsonl
      - corpus/*.jsonl.zst
      - corpus/*.jsonl.gz
      - corpus/*.parquet
    tokenizer: tokenizer.json
    seq_len: {seq_len}
    global_batch_size: {batch}
    seed: 2024
    packing: concat
    chunk_bytes: 128KiB
    window_chunks: 4
"""


def start_server(config: Path, ready: Path) -> tuple[subprocess.Popen, str]:
    ready.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tokenfeed.server.commands.cli",
        "serve",
        "--config",
        str(config),
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


def wait_built(feed: Client, timeout: float) -> dict:
    """The job's description once its index is built (sizes and steps per epoch are the whole
    corpus's only then), with a progress line a second while it builds; the description as it
    stands if `timeout` passes first."""
    deadline = time.monotonic() + timeout
    info, said = feed.describe(), 0.0
    while info["state"] == "JOB_STATE_INDEXING" and time.monotonic() < deadline:
        if time.monotonic() - said >= 1.0:
            print(f"job demo: building, {info['chunks_indexed']}/{info['num_chunks']} chunks")
            said = time.monotonic()
        time.sleep(0.1)
        info = feed.describe()
    return info


def describe(info: dict) -> str:
    if info["state"] == "JOB_STATE_READY":
        return (
            f"job demo: {info['num_chunks']} chunks, {info['num_documents']} documents, "
            f"{info['num_tokens']} tokens, {info['steps_per_epoch']} steps per epoch, "
            f"fingerprint {info['fingerprint']}"
        )
    return (  # still building (or failed): only what is known so far, said as such
        f"job demo: {info['state'].removeprefix('JOB_STATE_').lower()}, "
        f"{info['chunks_indexed']}/{info['num_chunks']} chunks indexed so far"
        + (f": {info['error']}" if info["error"] else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".demo", help="working directory")
    parser.add_argument("--steps", type=int, default=200, help="steps to stream for throughput")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus, tok_path, n_docs = democorpus.prepare(out)
    size = sum(p.stat().st_size for p in corpus.iterdir())
    print(
        f"corpus: {n_docs} documents, {size / 1e6:.2f} MB in {corpus} "
        f"(prepared in {time.perf_counter() - t0:.1f}s)"
    )
    config = out / "tokenfeed.yaml"
    config.write_text(CONFIG.format(seq_len=args.seq_len, batch=args.batch))

    proc, address = start_server(config, out / "ready.json")
    print(f"server: pid {proc.pid} on {address}")
    try:
        with Client(address, job="demo", timeout=120) as feed:
            batch = feed.get_batch(0, rank=0, world_size=2)  # served while the index builds
            print(describe(wait_built(feed, 120)))
            tok = TextTokenizer(TokenizerSpec(path=str(tok_path)))
            print(f"step 0, rank 0 of 2: {dict((k, v.shape) for k, v in batch.items())}")
            for r in range(2):
                text = tok.decode(batch["input_ids"][r])[:300].replace("\n", " ")
                pieces = int(batch["segment_ids"][r].max())
                print(f"  row {r} ({pieces} document piece(s)): {text!r}...")
            again = feed.get_batch(0, rank=0, world_size=2)
            print(f"same request again, same bytes: {again.fingerprint == batch.fingerprint}")

            start = time.perf_counter()
            tokens = sum(b["input_ids"].size for b in feed.iter_batches(0, args.steps))
            elapsed = time.perf_counter() - start
            print(
                f"streamed {args.steps} steps: {tokens / elapsed / 1e6:.2f} M tokens/s, "
                f"{args.steps / elapsed:.0f} steps/s over loopback"
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    print(f"server drained and exited with code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
