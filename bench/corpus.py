"""A corpus tokenfeed was never tuned on: the Python sources of the installed packages
(site-packages of this environment, pinned by constraints.txt), as short and long documents, and
a byte-level BPE tokenizer trained on a sample of it.

    python -m bench.corpus [--mb 31]          (writes under bench/out/unseen-<mb>MB/)

The demo corpus (commands/democorpus.py) is Python's own documentation, on which serving and
tokenizing were measured and tuned; this one is code, and mixes the two shapes of documents a
pre-training corpus has:
- short: sections of a module (top-level definitions grouped, SHORT_BYTES each, a few KB: what
  documentation or code corpora cut into),
- long: whole large modules (LONG_MIN_BYTES to LONG_MAX_BYTES), about LONG_SHARE of the bytes.
Files are taken in the order of a hash of their path, so every package contributes, and the
same environment gives the same corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenfeed.server.commands.democorpus import train_tokenizer

SHORT_BYTES = (1024, 6144)  # a short document is cut once it holds at least the first
LONG_MIN_BYTES, LONG_MAX_BYTES = 48 * 1024, 512 * 1024
LONG_SHARE = 0.3
FILES = 8  # JSON Lines files the documents are spread over, in turn
VOCAB = 16384  # ids travel as uint16, as with the demo tokenizer
TRAIN_BYTES = 3_000_000  # of the corpus the tokenizer is trained on
OUT = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Corpus:
    root: Path  # the JSON Lines files
    tokenizer: Path
    docs: int
    text_bytes: int
    short_docs: int
    long_docs: int


def sources() -> list[Path]:
    """The installed packages' .py files, in the order of a hash of their relative path."""
    base = Path(sysconfig.get_paths()["purelib"])
    files = [p for p in base.rglob("*.py") if p.is_file()]
    return sorted(files, key=lambda p: hashlib.blake2b(str(p.relative_to(base)).encode()).digest())


def sections(text: str) -> list[str]:
    """A module cut before each top-level definition, grouped into documents of SHORT_BYTES."""
    out, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        top = line.startswith(("def ", "class ", "async def ", "@"))
        if top and size >= SHORT_BYTES[0]:
            out.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
        if size >= SHORT_BYTES[1]:
            out.append("".join(current))
            current, size = [], 0
    if size >= 200:  # a stub left over is no document
        out.append("".join(current))
    return out


def documents(total_bytes: int) -> tuple[list[str], int]:
    """(documents, how many of them are long) of about `total_bytes` of text."""
    short: list[str] = []
    long: list[str] = []
    short_bytes = long_bytes = 0
    long_goal = total_bytes * LONG_SHARE
    for path in sources():
        if short_bytes + long_bytes >= total_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        size = len(text.encode())
        if size >= LONG_MIN_BYTES:
            if long_bytes < long_goal:
                text = text[:LONG_MAX_BYTES]
                long.append(text)
                long_bytes += len(text.encode())
            continue
        if short_bytes < total_bytes - long_goal:
            for doc in sections(text):
                short.append(doc)
                short_bytes += len(doc.encode())
    # Long documents among the short ones, at even intervals, as a crawl would mix them.
    docs, every = [], max(1, len(short) // max(len(long), 1))
    for i, doc in enumerate(short):
        docs.append(doc)
        if i % every == every - 1 and long:
            docs.append(long.pop())
    return docs + long, len(docs + long) - len(short)


def prepare(mb: float = 31.0, out: Path = OUT) -> Corpus:
    """The corpus of about `mb` MB of text and its tokenizer under `out`, made once."""
    work = out / f"unseen-{mb:g}MB"
    marker = work / "corpus.json"
    if marker.exists():
        info = json.loads(marker.read_text())
        return Corpus(work / "corpus", work / "tokenizer.json", **info)
    docs, long = documents(int(mb * 1e6))
    root = work / "corpus"
    root.mkdir(parents=True, exist_ok=True)
    for k in range(FILES):
        lines = (json.dumps({"text": d}) + "\n" for d in docs[k::FILES])
        (root / f"part-{k:02d}.jsonl").write_text("".join(lines))
    sample, size = [], 0
    for d in docs:  # the first documents, short and long mixed, up to TRAIN_BYTES
        if size >= TRAIN_BYTES:
            break
        sample.append(d)
        size += len(d)
    train_tokenizer(sample, VOCAB).save(str(work / "tokenizer.json"))
    info = {
        "docs": len(docs),
        "text_bytes": sum(len(d.encode()) for d in docs),
        "short_docs": len(docs) - long,
        "long_docs": long,
    }
    marker.write_text(json.dumps(info))
    return Corpus(root, work / "tokenizer.json", **info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=31.0)
    a = parser.parse_args()
    c = prepare(a.mb)
    print(
        f"{c.root}: {c.docs:,} documents ({c.short_docs:,} short, {c.long_docs:,} long), "
        f"{c.text_bytes / 1e6:.1f} MB of text; tokenizer {c.tokenizer}"
    )


if __name__ == "__main__":
    main()
