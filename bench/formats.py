"""Build rate of the same text in each layout tokenfeed reads, against the same text as JSON
Lines: `tokenfeed build` of the demo documents stored as plain JSON Lines (the reference), an
MDS directory (MDSWriter), a save_to_disk directory (Arrow streams), Parquet (pyarrow, row
groups of 1,000 rows) and WebDataset tars (TarWriter), each written by its real writer
(tests/formats.py).

Every layout is cut into chunks of the same `chunk_bytes`, so all build about the same number
of chunks and what differs is only how the text is laid out and read. The rate is MB of
document text per second of the whole command (listing, planning, walking the tar and Arrow
headers, worker start-up, tokenizing, storing), an empty cache each round; the layouts take
turns within each round, so noise falls on all of them.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenfeed.server.commands import democorpus

from bench.smallobjects import build, write_config
from bench.stats import median, paired_ratio
from bench.table import number, render

TARGET = 0.90  # build rate of a layout / of the same text as JSON Lines, at least
CHUNK_BYTES = 2**20
LAYOUTS = ("jsonl", "mds", "arrow", "parquet", "tar")


@dataclass(frozen=True)
class FormatsSizes:
    copies: int  # the demo documents, replicated
    rounds: int


QUICK = FormatsSizes(copies=6, rounds=2)
FULL = FormatsSizes(copies=12, rounds=5)


@dataclass
class FormatsResult:
    docs: int
    text_bytes: int
    source_bytes: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def rate(self, seconds: float) -> float:
        return self.text_bytes / seconds / 1e6


def write_layouts(root: Path, texts: list[str]) -> dict[str, str]:
    """Each layout of `texts` under `root`; layout -> the source path a config names."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import formats

    root.mkdir(parents=True)
    from support import write_jsonl

    (root / "jsonl").mkdir()
    write_jsonl(root / "jsonl" / "corpus.jsonl", texts)
    formats.write_mds(root / "mds", texts, size_limit=16 * 2**20)
    formats.write_saved(root / "arrow", texts, shards=2, batch_rows=1000)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts}), root / "parquet" / "c.parquet", row_group_size=1000)
    (root / "tar").mkdir()
    half = len(texts) // 2
    formats.write_tar(root / "tar" / "shard-0.tar", texts[:half], extra=False)
    formats.write_tar(root / "tar" / "shard-1.tar", texts[half:], extra=False)
    return {layout: str(root / layout) for layout in LAYOUTS}


def run(sizes: FormatsSizes, out: Path, workers: int) -> FormatsResult:
    _, tokenizer, _ = democorpus.prepare(out.resolve() / "democorpus")
    work = out.resolve() / "formats"
    shutil.rmtree(work, ignore_errors=True)
    texts = democorpus.documents() * sizes.copies
    sources = write_layouts(work / "corpus", texts)
    result = FormatsResult(len(texts), sum(len(t.encode()) for t in texts))
    configs = {}
    for layout, source in sources.items():
        cache = work / f"cache-{layout}"
        path = work / f"{layout}.yaml"
        configs[layout] = (write_config(path, source, tokenizer, cache, CHUNK_BYTES, None), cache)
        result.source_bytes[layout] = sum(
            p.stat().st_size for p in Path(source).rglob("*") if p.is_file()
        )
        result.seconds[layout] = []
    for r in range(sizes.rounds):
        order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
        for layout in order:
            seconds, chunks = build(*configs[layout], workers)
            result.seconds[layout].append(seconds)
            result.chunks[layout] = chunks
    return result


def table(r: FormatsResult, workers: int) -> str:
    base = r.seconds["jsonl"]
    rows = []
    for layout in LAYOUTS:
        s = r.seconds[layout]
        ratio = paired_ratio([1 / x for x in s], [1 / x for x in base])
        rows.append(
            [
                layout,
                number(r.source_bytes[layout] / 1e6, 1),
                str(r.chunks[layout]),
                number(median(s), 2),
                number(r.rate(median(s)), 2),
                number(ratio, 2),
                ""
                if layout == "jsonl"
                else ("met" if ratio >= TARGET else "MISSED") + f" (>= {TARGET})",
            ]
        )
    title = (
        f"13. Layouts: `tokenfeed build --workers {workers}` of the same {r.docs:,} docs "
        f"({r.text_bytes / 1e6:.2f} MB of text) in each layout, chunk_bytes {CHUNK_BYTES:,}\n"
        f"   an empty cache per build; medians of {len(r.seconds['jsonl'])} rounds; ratio: "
        "median of the rounds' ratios to JSON Lines"
    )
    header = ["layout", "MB stored", "chunks", "build s", "MB/s of text", "/ jsonl", "target"]
    notes = (
        "jsonl: one plain file; mds: MDSWriter, 16 MiB shards; arrow: save_to_disk, 2 files, "
        "1,000-row batches; parquet: 1,000-row groups; tar: TarWriter, 2 shards, a .txt member "
        "per sample"
    )
    return f"{render(title, header, rows)}\n{notes}"
