"""Chunk planning and reading: every good document exactly once, every bad record located."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.errors import SourceChangedError, SourceError
from tokenfeed.server.objstore.localfiles import LocalBackend
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.settings.config import SourceSpec
from tokenfeed.server.source.chunks import Chunk, plan_chunks
from tokenfeed.server.source.readers import read_documents, read_lines, read_pieces

# One line per bad-record reason, as a producer's bug might write it.
BAD_LINES = {
    "invalid_utf8": b'{"text": "caf\xe9 au lait"}',  # Latin-1, not UTF-8
    "malformed_json": b'{"text": "unterminated',
    "not_an_object": b'["text", "a list"]',
    "missing_field": b'{"body": "no text field here"}',
    "not_text": b'{"text": 42}',
    "empty": b'{"text": ""}',
    "blank": b"",  # a blank line is an empty record too
    "spaces": b"   \t ",
}
REASON = {kind: kind for kind in BAD_LINES} | {"blank": "empty", "spaces": "empty"}


def good(text: str) -> bytes:
    return json.dumps({"text": text}, ensure_ascii=False).encode()


def info_for(path: Path) -> ObjectInfo:
    [info] = LocalBackend().list(str(path))
    return info


def plan(path: Path, chunk_bytes: int = 2**20, **spec) -> list[Chunk]:
    return plan_chunks([(info_for(path), SourceSpec(str(path), **spec))], chunk_bytes)


def read_all(chunks: list[Chunk]) -> tuple[list[str], list[tuple[str, str]], int]:
    """(texts, [(reason, location)], records) over the chunks in order."""
    store = LocalBackend()
    texts, bad, records = [], [], 0
    for chunk in chunks:
        docs = read_documents(store, chunk)
        texts += docs.texts
        bad += [(b.reason, b.location) for b in docs.bad]
        records += docs.records
    return texts, bad, records


def write_lines(path: Path, lines: list[bytes], trailing_newline: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing_newline else b""))
    return path


def mixed_lines(n_repeats: int) -> tuple[list[bytes], list[str], list[tuple[str, int]]]:
    """Every bad kind between good lines: (lines, good texts, [(reason, 1-based line)])."""
    lines, texts, bad = [], [], []
    for rep in range(n_repeats):
        for kind, line in BAD_LINES.items():
            text = f"doc {rep} before {kind}: \u00e9\u4e2d"
            lines.append(good(text))
            texts.append(text)
            lines.append(line)
            bad.append((REASON[kind], len(lines)))
    return lines, texts, bad


# -- plain JSONL in byte ranges --------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 2, 7, 33, 100, 2**20])
def test_bad_records_are_located_by_line_in_every_chunk(tmp_path, chunk_bytes):
    lines, texts, bad = mixed_lines(3)
    path = write_lines(tmp_path / "s.jsonl", lines)
    chunks = plan(path, chunk_bytes)
    got_texts, got_bad, records = read_all(chunks)
    uri = info_for(path).uri
    assert got_texts == texts
    # Line numbers count from the start of the file, even for a range chunk far into it.
    assert got_bad == [(reason, f"{uri}:{line}") for reason, line in bad]
    assert records == len(lines)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
@pytest.mark.parametrize("chunk_bytes", [1, 33, 2**20])
def test_lines_parsed_by_the_encoder_give_the_same_records(tmp_path, suffix, chunk_bytes):
    """JsonLines (a build's tiktoken path: each line parsed by the thread that encodes it,
    the records settled after) gives every chunk the texts, record ids, bad records with
    their locations, record count and data start that read_pieces gives."""
    lines, texts, _ = mixed_lines(3)
    path = tmp_path / f"s{suffix}"
    compress = {".jsonl.gz": gzip.compress, ".jsonl.zst": zstandard.ZstdCompressor().compress}
    path.write_bytes(compress.get(suffix, bytes)(jsonl_bytes(lines)))
    store, got_texts = LocalBackend(), []
    for chunk in plan(path, chunk_bytes):
        docs, pieces = read_pieces(store, chunk, 4)
        want_texts = [t for piece in pieces for t in piece]
        parsed = read_lines(store, chunk)
        assert parsed is not None
        found = [parsed.text(line) for line in parsed.lines]
        got = parsed.documents(np.array([t is not None for t in found], dtype=bool))
        assert [t for t in found if t is not None] == want_texts
        assert got == docs  # texts (empty on both), bad records, count, ids, data start
        got_texts += want_texts
    assert got_texts == texts
    parsed = read_lines(store, plan(path)[0])
    with pytest.raises(ValueError, match="answers for"):
        parsed.documents(np.ones(1, dtype=bool))


def test_only_json_lines_chunks_are_read_as_lines(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    [chunk] = plan(path)
    assert read_lines(LocalBackend(), chunk) is None


def test_bad_record_detail_and_str(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [good("a"), b'{"text": 42}'])
    [chunk] = plan(path)
    [bad] = read_documents(LocalBackend(), chunk).bad
    assert str(bad) == f"{info_for(path).uri}:2: not_text ('text' is int)"


line_kind = st.one_of(
    st.text(min_size=1, max_size=12).map(lambda t: ("good", t)),
    st.sampled_from(sorted(BAD_LINES)).map(lambda k: (k, None)),
)


@settings(max_examples=80, deadline=None)
@given(
    kinds=st.lists(line_kind, min_size=1, max_size=25),
    chunk_bytes=st.integers(1, 300),
    trailing_newline=st.booleans(),
)
def test_range_chunks_partition_the_lines(kinds, chunk_bytes, trailing_newline):
    lines = [good(t) if k == "good" else BAD_LINES[k] for k, t in kinds]
    if lines[-1] == b"":
        trailing_newline = True  # otherwise the last blank line does not exist
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1

    with tempfile.TemporaryDirectory() as tmp:
        path = write_lines(Path(tmp) / "s.jsonl", lines, trailing_newline)
        uri = info_for(path).uri
        chunks = plan(path, chunk_bytes)
        size = path.stat().st_size
        # Chunks tile the object: contiguous, in order, none larger than asked.
        assert chunks[0].start == 0 and chunks[-1].end == size
        assert all(a.end == b.start for a, b in zip(chunks, chunks[1:], strict=False))
        assert all(0 < c.end - c.start <= chunk_bytes for c in chunks)

        store = LocalBackend()
        for chunk in chunks:
            # A chunk holds exactly the lines that start inside its byte range.
            mine = [i for i, s in enumerate(starts) if chunk.start <= s < chunk.end]
            docs = read_documents(store, chunk)
            assert docs.records == len(mine)
            assert docs.texts == [kinds[i][1] for i in mine if kinds[i][0] == "good"]
            assert [(b.reason, b.location) for b in docs.bad] == [
                (REASON[kinds[i][0]], f"{uri}:{i + 1}") for i in mine if kinds[i][0] != "good"
            ]


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=30))
def test_every_document_exactly_once_for_any_chunk_size(texts):
    # Multi-byte UTF-8 makes many chunk boundaries fall inside a character.
    with tempfile.TemporaryDirectory() as tmp:
        path = write_lines(Path(tmp) / "s.jsonl", [good(t) for t in texts])
        size = path.stat().st_size
        for chunk_bytes in sorted({1, 3, 16, size // 3 + 1, size - 1 or 1, size, size + 1}):
            got, bad, records = read_all(plan(path, chunk_bytes))
            assert got == texts, chunk_bytes
            assert bad == [] and records == len(texts)


def test_line_longer_than_several_read_blocks(tmp_path):
    # The reader extends a range to the end of its last line in blocks of a few MiB.
    huge = "x" * (9 * 2**20)
    lines = [good("first"), good(huge), b"[]", good("last")]
    path = write_lines(tmp_path / "s.jsonl", lines, trailing_newline=False)
    texts, bad, records = read_all(plan(path, 2**20))
    assert texts == ["first", huge, "last"]
    assert bad == [("not_an_object", f"{info_for(path).uri}:3")]
    assert records == 4


def test_crlf_line_endings(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"text": "a"}\r\n\r\n{"text": "b"}\r\n')
    for chunk_bytes in (1, 5, 100):
        texts, bad, _ = read_all(plan(path, chunk_bytes))
        assert texts == ["a", "b"]
        assert bad == [("empty", f"{info_for(path).uri}:2")]


def test_text_field_is_configurable(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [b'{"content": "yes", "text": "no"}'])
    texts, _, _ = read_all(plan(path, text_field="content"))
    assert texts == ["yes"]


# -- compressed JSONL and Parquet ------------------------------------------------------------


DOCS = [f"document {i}: " + "caf\u00e9 \u4e2d\u6587 " * (i % 5) for i in range(40)]


def jsonl_bytes(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def write_all_formats(root: Path, texts: list[str]) -> dict[str, Path]:
    plain = jsonl_bytes([good(t) for t in texts])
    half = len(plain) // 2
    cut = plain.index(b"\n", half) + 1
    zc = zstandard.ZstdCompressor()
    files = {
        "jsonl": root / "a.jsonl",
        "jsonl.gz": root / "a.jsonl.gz",
        "jsonl.zst": root / "a.jsonl.zst",
        # Concatenated gzip members and zstd frames are valid streams (pigz, pzstd, `cat`).
        "jsonl.gz multi": root / "b.jsonl.gz",
        "jsonl.zst multi": root / "b.jsonl.zst",
        "parquet": root / "a.parquet",
    }
    files["jsonl"].write_bytes(plain)
    files["jsonl.gz"].write_bytes(gzip.compress(plain))
    files["jsonl.zst"].write_bytes(zc.compress(plain))
    files["jsonl.gz multi"].write_bytes(gzip.compress(plain[:cut]) + gzip.compress(plain[cut:]))
    files["jsonl.zst multi"].write_bytes(zc.compress(plain[:cut]) + zc.compress(plain[cut:]))
    pq.write_table(pa.table({"text": texts}), files["parquet"], row_group_size=7)
    return files


@pytest.mark.parametrize(
    "fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "jsonl.gz multi", "jsonl.zst multi", "parquet"]
)
def test_every_format_reads_the_same_documents(tmp_path, fmt):
    path = write_all_formats(tmp_path, DOCS)[fmt]
    chunks = plan(path, chunk_bytes=100)
    texts, bad, records = read_all(chunks)
    assert texts == DOCS
    assert bad == [] and records == len(DOCS)
    kind = fmt.split()[0]
    assert {c.kind for c in chunks} == {kind}
    if kind == "parquet":
        # One chunk per row group, rows numbered across the whole file.
        assert [(c.row_group, c.start, c.end) for c in chunks] == [
            (g, 7 * g, min(7 * g + 7, len(DOCS))) for g in range(6)
        ]
    elif kind != "jsonl":
        # A compressed stream cannot be entered midway: one chunk per object.
        assert [(c.start, c.end) for c in chunks] == [(0, path.stat().st_size)]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_compressed_bad_records_have_line_numbers(tmp_path, suffix):
    lines, texts, bad = mixed_lines(2)
    plain = jsonl_bytes(lines)
    path = tmp_path / f"s{suffix}"
    compress = gzip.compress if suffix.endswith("gz") else zstandard.ZstdCompressor().compress
    path.write_bytes(compress(plain))
    got_texts, got_bad, records = read_all(plan(path))
    assert got_texts == texts
    assert got_bad == [(reason, f"{info_for(path).uri}:{line}") for reason, line in bad]
    assert records == len(lines)


def test_parquet_nulls_empty_and_invalid_utf8_are_counted(tmp_path):
    values = [b"one", None, b"", b"two", b"caf\xe9", b"three", None, b"four", b""]
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": pa.array(values, pa.binary())}), path, row_group_size=4)
    chunks = plan(path)
    assert sum(len(c.pieces) for c in chunks) == 3  # three row groups (grouped: small)
    texts, bad, records = read_all(chunks)
    uri = info_for(path).uri
    assert texts == ["one", "two", "three", "four"]
    # Rows are numbered from 0 across the whole file, not within the row group.
    assert bad == [
        ("missing_field", f"{uri} row 1"),
        ("empty", f"{uri} row 2"),
        ("invalid_utf8", f"{uri} row 4"),
        ("missing_field", f"{uri} row 6"),
        ("empty", f"{uri} row 8"),
    ]
    assert records == len(values)


def test_parquet_string_column_with_nulls_and_other_columns(tmp_path):
    path = tmp_path / "s.parquet"
    table = pa.table({"id": [1, 2, 3], "content": pa.array(["a", None, ""], pa.large_string())})
    pq.write_table(table, path)
    texts, bad, _ = read_all(plan(path, text_field="content"))
    assert texts == ["a"]
    assert [reason for reason, _ in bad] == ["missing_field", "empty"]


# -- planning --------------------------------------------------------------------------------


def test_plan_sorts_by_uri_and_skips_empty_objects(tmp_path):
    paths = [tmp_path / n for n in ("c.jsonl", "a.jsonl", "b.jsonl", "empty.jsonl")]
    for p in paths[:3]:
        write_lines(p, [good(p.name)])
    paths[3].write_bytes(b"")
    pairs = [(info_for(p), SourceSpec(str(p))) for p in paths]
    chunks = plan_chunks(pairs, 2**20)
    # (small objects are grouped into one chunk: its pieces keep the sorted order)
    names = [Path(p.source.uri).name for c in chunks for p in c.pieces]
    assert names == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert plan_chunks(list(reversed(pairs)), 2**20) == chunks


@pytest.mark.parametrize(
    ("name", "fmt", "match"),
    [
        ("s.txt", "auto", "cannot tell the format"),
        ("s.parquet.gz", "auto", "compress internally"),
        ("s.csv.zst", "auto", "cannot tell the format"),
    ],
)
def test_plan_refuses_unknown_formats(tmp_path, name, fmt, match):
    path = tmp_path / name
    path.write_bytes(b"x")
    with pytest.raises(SourceError, match=match):
        plan(path, format=fmt)


def test_declared_format_overrides_the_suffix(tmp_path):
    path = write_lines(tmp_path / "s.txt", [good("a")])
    [chunk] = plan(path, format="jsonl")
    assert chunk.kind == "jsonl"


def test_plan_refuses_parquet_without_a_text_column(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(SourceError, match="expected a string"):
        plan(path)
    with pytest.raises(SourceError, match="no column 'body'"):
        plan(path, text_field="body")


# -- refusing bad objects --------------------------------------------------------------------


def test_object_changed_after_listing_is_refused(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [good("a"), good("b")])
    chunks = plan(path)
    write_lines(path, [good("a"), good("b"), good("c")])
    with pytest.raises(SourceChangedError, match="changed after it was pinned"):
        read_all(chunks)


def test_object_with_new_mtime_is_refused(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [good("a")])
    chunks = plan(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(SourceChangedError):
        read_all(chunks)


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_corrupt_compressed_object_is_a_source_error(tmp_path, suffix):
    path = tmp_path / f"s{suffix}"
    path.write_bytes(b"\x1f\x8b\x08\x00 definitely not a valid stream" * 3)
    with pytest.raises(SourceError, match="cannot decompress"):
        read_all(plan(path))


def test_truncated_zstd_is_refused_not_read_short(tmp_path):
    lines = "".join(f'{{"text": "document number {i} with some words"}}\n' for i in range(400))
    whole = zstandard.ZstdCompressor().compress(lines.encode())
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(whole[: len(whole) // 2])
    store = LocalBackend()
    (chunk,) = plan_chunks([(store.list(str(path))[0], SourceSpec(str(path)))], 2**20)
    with pytest.raises(SourceError, match="truncated"):
        read_documents(store, chunk)
