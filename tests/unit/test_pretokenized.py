"""Pre-tokenized sources: Megatron .bin/.idx pairs and Parquet token columns, planned from the
listing and the .idx header, read with ranged reads, every document once, every fault located.

The Megatron files are written by tests/mmidx.py, from the published format, not by tokenfeed."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from types import SimpleNamespace

import mmidx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.errors import ConfigError, SourceError
from tokenfeed.server.objstore.localfiles import LocalBackend
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.settings.config import SourceSpec, from_dict
from tokenfeed.server.source import pretokenized
from tokenfeed.server.source.chunks import CHUNK_FORMAT_VERSION, Chunk, plan_chunks, source_kind
from tokenfeed.server.store.tokstore import TokenStore

EOS = 0
SMALL = SimpleNamespace(vocab_size=1024, dtype=np.dtype(np.uint16), eos_id=EOS)
LARGE = SimpleNamespace(vocab_size=100_000, dtype=np.dtype(np.int32), eos_id=EOS)


class CountingStore:
    """LocalBackend, recording every read: (uri, start, end) or (uri, "open")."""

    def __init__(self):
        self.inner, self.reads = LocalBackend(), []

    def list(self, pattern):
        return self.inner.list(pattern)

    def read_range(self, obj, start, end):
        self.reads.append((obj.uri, start, min(end, obj.size)))
        return self.inner.read_range(obj, start, end)

    def open(self, obj):
        self.reads.append((obj.uri, "open"))
        return self.inner.open(obj)


class OneStore(ObjectStorage):
    def __init__(self, store):
        super().__init__()
        self.store = store

    def for_uri(self, uri):
        return self.store


def random_docs(n: int, seed: int = 0, high: int = 1024, max_len: int = 90) -> list[np.ndarray]:
    """Documents of 1..max_len ids in [1, high): no EOS (id 0) anywhere."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, high, size=int(rng.integers(1, max_len))) for _ in range(n)]


def plan(idx: Path, chunk_bytes: int, store=None, **spec) -> list[Chunk]:
    store = store or CountingStore()
    [info] = store.list(str(idx))
    return plan_chunks([(info, SourceSpec(str(idx), **spec))], chunk_bytes, OneStore(store))


def read_all(chunks: list[Chunk], tokenizer=SMALL, store=None):
    """(documents, bad records, records) over the chunks in order."""
    store = store or LocalBackend()
    docs, bad, records = [], [], 0
    for chunk in chunks:
        got = pretokenized.read_chunk(store, chunk, tokenizer)
        assert got.tokens.dtype == tokenizer.dtype and got.lengths.dtype == np.int32
        assert len(got.record_ids) == len(got.lengths) and got.data_start == 0
        bounds = np.concatenate([[0], np.cumsum(got.lengths, dtype=np.int64)])
        assert bounds[-1] == len(got.tokens)
        docs += [got.tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        bad += got.bad
        records += got.records
    return docs, bad, records


# -- Megatron: planning --------------------------------------------------------------------


def test_planning_reads_the_header_only_and_cuts_by_the_average_sequence(tmp_path):
    docs = random_docs(300)
    idx = mmidx.write(tmp_path / "d", docs, np.uint16)
    bin_size = (tmp_path / "d.bin").stat().st_size
    store = CountingStore()
    chunks = plan(idx, 4096, store)
    assert store.reads == [(str(idx), 0, 34)]  # not the lengths, pointers or document index
    per = 4096 * 300 // bin_size
    assert [(c.start, c.end) for c in chunks] == [
        (s, min(s + per, 300)) for s in range(0, 300, per)
    ]
    assert len(chunks) > 5
    assert all(c.kind == "megatron" and c.text_field == "" for c in chunks)
    assert {c.companion.uri for c in chunks} == {str(tmp_path / "d.bin")}
    assert chunks[0].companion.size == bin_size
    # at most chunk_bytes of tokens each (by the average sequence), plus 12 bytes of index each
    average = bin_size / 300
    assert all(4096 - average < c.raw_bytes - 12 * per <= 4096 for c in chunks[:-1])
    assert plan(idx, 4096) == chunks  # deterministic


def test_a_chunk_is_two_ranged_reads_of_the_index_and_one_of_the_tokens(tmp_path):
    docs = random_docs(200, seed=1)
    idx = mmidx.write(tmp_path / "d", docs, np.int32)
    chunks = plan(idx, 2048)
    n, bin_uri = 200, str(tmp_path / "d.bin")
    offsets = np.concatenate([[0], np.cumsum([4 * len(d) for d in docs])])
    store = CountingStore()
    expected = [(str(idx), 0, 34)]  # the header, once for all the chunks
    for c in chunks:
        pretokenized.read_chunk(store, c, SMALL)
        a, b = c.start, c.end
        top = b + 1 if b < n else b
        expected += [
            (str(idx), 34 + 4 * a, 34 + 4 * b),
            (str(idx), 34 + 4 * n + 8 * a, 34 + 4 * n + 8 * top),
            (bin_uri, int(offsets[a]), int(offsets[b])),
        ]
    assert store.reads == expected


@pytest.mark.parametrize("source_dtype", [np.uint16, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("tokenizer", [SMALL, LARGE], ids=["uint16-out", "int32-out"])
def test_every_document_is_read_once_in_the_tokenizers_dtype(tmp_path, source_dtype, tokenizer):
    high = 256 if source_dtype is np.uint8 else 1024
    docs = random_docs(250, seed=2, high=high)
    idx = mmidx.write(tmp_path / "d", docs, source_dtype)
    chunks = plan(idx, 1500)
    assert len(chunks) > 3
    got, bad, records = read_all(chunks, tokenizer)
    assert got == [d.tolist() for d in docs]
    assert bad == [] and records == 250


def test_record_ids_count_from_the_chunks_first_sequence(tmp_path):
    docs = random_docs(40, seed=3)
    docs[7] = np.array([2000])  # out of the vocabulary: a bad record, not a document
    idx = mmidx.write(tmp_path / "d", docs, np.uint16)
    [chunk] = plan(idx, 2**20)
    got = pretokenized.read_chunk(LocalBackend(), chunk, SMALL)
    assert got.record_ids == [i for i in range(40) if i != 7]
    assert got.records == 40


def test_the_document_index_is_not_what_packs_each_sequence_is_a_document(tmp_path):
    """`--split-sentences` datasets group sequences into documents; tokenfeed does not."""
    docs = random_docs(30, seed=4)
    idx = mmidx.write(tmp_path / "d", docs, np.uint16, document_index=[0, 4, 11, 30])
    got, bad, _ = read_all(plan(idx, 300))
    assert got == [d.tolist() for d in docs] and not bad


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    chunk_bytes=st.integers(1, 3000),
)
def test_any_chunking_serves_each_sequence_once(lengths, chunk_bytes):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        docs = [np.arange(1, n + 1) % 1000 + 1 for n in lengths]
        idx = mmidx.write(Path(tmp) / "d", docs, np.uint16)
        chunks = plan(idx, chunk_bytes)
        assert [c.start for c in chunks] == sorted({c.start for c in chunks})
        assert chunks[0].start == 0 and chunks[-1].end == len(lengths)
        assert all(a.end == b.start for a, b in zip(chunks, chunks[1:], strict=False))
        got, bad, records = read_all(chunks)
        assert got == [d.tolist() for d in docs if len(d)]
        assert [(b.reason, b.location) for b in bad] == [
            ("empty", f"{idx} document {i}") for i, n in enumerate(lengths) if n == 0
        ]
        assert records == len(lengths)


def test_an_empty_dataset_has_no_chunks(tmp_path):
    idx = mmidx.write(tmp_path / "d", [], np.uint16)
    assert plan(idx, 1024) == []


# -- EOS and bad records --------------------------------------------------------------------


def test_a_trailing_eos_is_not_doubled_by_the_packer(tmp_path):
    docs = [[5, 6, EOS], [EOS, 7], [8, EOS, EOS], [EOS], [9]]
    idx = mmidx.write(tmp_path / "d", docs, np.uint16)
    [chunk] = plan(idx, 2**20)
    got = pretokenized.read_chunk(LocalBackend(), chunk, SMALL)
    bounds = np.concatenate([[0], np.cumsum(got.lengths)])
    served = [got.tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert served == [[5, 6], [EOS, 7], [8, EOS], [9]]
    assert got.record_ids == [0, 1, 2, 4]
    assert [str(b) for b in got.bad] == [f"{idx} document 3: empty (only an end-of-document id)"]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ids_outside_the_vocabulary_are_bad_records_located_by_document(tmp_path, dtype):
    docs = random_docs(120, seed=5)
    bad_id = -3 if dtype is np.int32 else 1024
    for i in (3, 64, 119):
        docs[i] = docs[i].copy()
        docs[i][len(docs[i]) // 2] = bad_id
    idx = mmidx.write(tmp_path / "d", docs, dtype)
    chunks = plan(idx, 600)
    assert len(chunks) > 3
    got, bad, records = read_all(chunks)
    assert got == [d.tolist() for i, d in enumerate(docs) if i not in (3, 64, 119)]
    assert [(b.reason, b.location) for b in bad] == [
        ("token_out_of_range", f"{idx} document {i}") for i in (3, 64, 119)
    ]
    assert f"id {bad_id} at position {len(docs[3]) // 2}" in bad[0].detail
    assert "1024" in bad[0].detail and records == 120


# -- Megatron: structural damage is a SourceError naming the object -----------------------


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


N = 50  # sequences in the damaged datasets; uint16 tokens


def _damage(kind: str, idx: Path, bin_path: Path) -> None:
    if kind == "magic":
        _patch(idx, 0, b"NOTMEGA")
    elif kind == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif kind == "float dtype":
        _patch(idx, 17, bytes([6]))
    elif kind == "unknown dtype":
        _patch(idx, 17, bytes([42]))
    elif kind == "truncated idx":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif kind == "idx with extra bytes":
        idx.write_bytes(idx.read_bytes() + b"\0" * 8)
    elif kind == "sequence count":
        _patch(idx, 18, struct.pack("<Q", N + 1))
    elif kind == "empty idx":
        idx.write_bytes(b"")
    elif kind == "missing bin":
        bin_path.unlink()
    elif kind == "bin not whole tokens":
        bin_path.write_bytes(bin_path.read_bytes() + b"\0")
    elif kind == "bin too short":
        bin_path.write_bytes(bin_path.read_bytes()[:-4])
    elif kind == "bin too long":
        bin_path.write_bytes(bin_path.read_bytes() + b"\1\0\1\0")
    elif kind == "negative length":
        _patch(idx, 34 + 4 * 20, struct.pack("<i", -5))
    elif kind == "pointer jumps":
        p = struct.unpack_from("<q", idx.read_bytes(), 34 + 4 * N + 8 * 30)[0]
        _patch(idx, 34 + 4 * N + 8 * 30, struct.pack("<q", p + 2))
    elif kind == "first pointer":
        _patch(idx, 34 + 4 * N, struct.pack("<q", 2))
    else:
        raise AssertionError(kind)


PLAN_TIME = [
    "magic",
    "version",
    "float dtype",
    "unknown dtype",
    "truncated idx",
    "idx with extra bytes",
    "sequence count",
    "empty idx",
    "missing bin",
    "bin not whole tokens",
]
READ_TIME = ["bin too short", "bin too long", "negative length", "pointer jumps", "first pointer"]


@pytest.mark.parametrize("kind", PLAN_TIME + READ_TIME)
def test_a_corrupt_dataset_is_a_source_error_naming_the_object(tmp_path, kind):
    docs = random_docs(N, seed=6)
    idx = mmidx.write(tmp_path / "d", docs, np.uint16)
    _damage(kind, idx, tmp_path / "d.bin")
    with pytest.raises(SourceError) as err:
        read_all(plan(idx, 500))
    assert str(idx) in str(err.value) or str(tmp_path / "d.bin") in str(err.value)
    if kind in READ_TIME:  # planned from the header alone; found when the chunk is read
        assert plan(idx, 500)


def test_the_pattern_must_name_the_index(tmp_path):
    mmidx.write(tmp_path / "d", random_docs(5), np.uint16)
    [info] = LocalBackend().list(str(tmp_path / "d.bin"))
    with pytest.raises(SourceError, match=r"d\.bin: a Megatron source must match the \.idx"):
        plan_chunks([(info, SourceSpec(str(tmp_path / "*"), format="megatron"))], 1024)


# -- kinds, keys, descriptions ------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "declared", "token_field", "kind"),
    [
        ("s3://b/meg/part.idx", "auto", None, "megatron"),
        ("/x/part.IDX", "auto", None, "megatron"),
        ("/x/part.idx", "megatron", None, "megatron"),
        ("/x/a.parquet", "auto", "input_ids", "parquet-tokens"),
        ("/x/a", "parquet", "ids", "parquet-tokens"),
        ("/x/a.parquet", "auto", None, "parquet"),
        ("/x/a.jsonl.zst", "auto", None, "jsonl.zst"),
    ],
)
def test_source_kinds(uri, declared, token_field, kind):
    assert source_kind(uri, declared, token_field) == kind


@pytest.mark.parametrize("uri", ["/x/part", "/x/part.bin", "/x/part.idx.zst"])
def test_a_megatron_source_must_name_uncompressed_index_files(uri):
    with pytest.raises(SourceError, match=r"must match the \.idx files .* uncompressed"):
        source_kind(uri, "megatron")


@pytest.mark.parametrize(
    ("uri", "declared", "needle"),
    [
        ("/x/a.jsonl", "auto", "not JSON Lines"),
        ("/x/a", "jsonl", "not JSON Lines"),
        ("/x/a.idx", "auto", "holds nothing but token ids"),
        ("/x/a.idx.gz", "megatron", "uncompressed"),
    ],
)
def test_token_field_where_it_cannot_apply_is_refused(uri, declared, needle):
    with pytest.raises(SourceError, match=needle):
        source_kind(uri, declared, "input_ids")


def _old_key(c: Chunk, digest: str) -> str:
    """The key formula of text chunks before pre-tokenized sources existed."""
    parts = (
        CHUNK_FORMAT_VERSION,
        c.source.uri,
        c.source.size,
        c.source.version,
        c.kind,
        c.text_field,
        c.start,
        c.end,
        c.row_group,
        digest,
    )
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).hexdigest()


def test_keys_of_text_chunks_are_unchanged_and_megatron_keys_pin_both_objects():
    obj = ObjectInfo("s3://b/x.jsonl", 1000, '"etag"')
    for c in (Chunk(obj, "jsonl", "text", 0, 500), Chunk(obj, "parquet", "text", 0, 9, 0, 77)):
        assert c.key("tok") == _old_key(c, "tok")
    idx = ObjectInfo("s3://b/m.idx", 34 + 12 * 10 + 88, '"i1"')
    data = ObjectInfo("s3://b/m.bin", 2000, '"b1"')
    base = Chunk(idx, "megatron", "", 0, 10, nbytes=100, companion=data)
    variants = [
        Chunk(idx, "megatron", "", 0, 10, companion=ObjectInfo(data.uri, 2000, '"b2"')),
        Chunk(idx, "megatron", "", 0, 10, companion=ObjectInfo(data.uri, 2002, '"b1"')),
        Chunk(ObjectInfo(idx.uri, idx.size, '"i2"'), "megatron", "", 0, 10, companion=data),
        Chunk(idx, "megatron", "", 0, 9, companion=data),
        Chunk(idx, "megatron", "", 1, 10, companion=data),
    ]
    keys = {base.key("tok"), *(v.key("tok") for v in variants), base.key("tok2")}
    assert len(keys) == len(variants) + 2
    # the estimate of bytes read is not an input of the tokens
    assert Chunk(idx, "megatron", "", 0, 10, nbytes=5, companion=data).key("t") == base.key("t")
    p = ObjectInfo("/x/a.parquet", 100, "1")
    assert Chunk(p, "parquet", "ids", 0, 9, 0).key("t") != Chunk(
        p, "parquet-tokens", "ids", 0, 9, 0
    ).key("t")


def test_descriptions():
    idx = ObjectInfo("s3://b/m.idx", 100, "e")
    data = ObjectInfo("s3://b/m.bin", 100, "e")
    assert Chunk(idx, "megatron", "", 10, 20, companion=data).describe() == (
        "s3://b/m.idx (documents 10-20)"
    )
    p = ObjectInfo("s3://b/a.parquet", 100, "e")
    assert Chunk(p, "parquet-tokens", "input_ids", 0, 50, 0).describe() == (
        "s3://b/a.parquet (row group 0, rows 0-50, token ids in 'input_ids')"
    )


# -- Parquet token columns -----------------------------------------------------------------


def write_token_parquet(path: Path, rows: list, list_type: pa.DataType, group: int) -> Path:
    table = pa.table(
        {
            "input_ids": pa.array(rows, type=list_type),
            "text": [f"row {i}" for i in range(len(rows))],
        }
    )
    pq.write_table(table, path, row_group_size=group)
    return path


@pytest.mark.parametrize(
    "list_type", [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.uint16())]
)
def test_a_token_column_is_read_per_row_group(tmp_path, list_type):
    docs = [d.tolist() for d in random_docs(130, seed=7)]
    path = write_token_parquet(tmp_path / "t.parquet", docs, list_type, 40)
    store = CountingStore()
    chunks = plan(path, 1024, store, token_field="input_ids")
    assert [(c.kind, c.row_group, c.start, c.end) for c in chunks] == [
        ("parquet-tokens", g, 40 * g, min(40 * g + 40, 130)) for g in range(4)
    ]
    meta = pq.ParquetFile(path).metadata
    assert [c.raw_bytes for c in chunks] == [
        meta.row_group(g).column(0).total_compressed_size for g in range(4)
    ]  # the token column only, not the text beside it
    got, bad, records = read_all(chunks, LARGE)
    assert got == docs and bad == [] and records == 130


def test_bad_token_rows_are_located_by_row(tmp_path):
    docs = [d.tolist() for d in random_docs(60, seed=8)]
    docs[5] = None
    docs[17] = []
    docs[30] = docs[30][:3] + [5000] + docs[30][3:]
    docs[44] = [EOS]
    docs[50] = [1, 2, EOS]
    docs[55] = [3, None, 4]
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int64()))}), path, row_group_size=25
    )
    got, bad, records = read_all(plan(path, 1024, token_field="input_ids"))
    where = f"{path} row"
    assert [(b.reason, b.location) for b in bad] == [
        ("missing_field", f"{where} 5"),
        ("empty", f"{where} 17"),
        ("token_out_of_range", f"{where} 30"),
        ("empty", f"{where} 44"),
        ("null_token", f"{where} 55"),
    ]
    assert "position 3" in bad[2].detail and "position 1" in bad[4].detail
    expected = [d for i, d in enumerate(docs) if i not in (5, 17, 30, 44, 55)]
    expected[expected.index([1, 2, EOS])] = [1, 2]
    assert got == expected and records == 60


def test_a_token_column_of_the_wrong_type_or_name_is_a_source_error(tmp_path):
    path = write_token_parquet(tmp_path / "t.parquet", [[1, 2]], pa.list_(pa.int32()), 10)
    with pytest.raises(SourceError, match=r"column 'text' is string, expected a list of integer"):
        plan(path, 1024, token_field="text")
    with pytest.raises(SourceError, match=r"no column 'ids'.*set token_field"):
        plan(path, 1024, token_field="ids")
    floats = tmp_path / "f.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1.0]], type=pa.list_(pa.float32()))}), floats)
    with pytest.raises(SourceError, match="expected a list of integer token ids"):
        plan(floats, 1024, token_field="ids")


# -- tokenfeed's own token store is a Megatron dataset -------------------------------------


def test_a_stored_chunk_is_a_megatron_dataset(tmp_path):
    docs = random_docs(80, seed=9)
    tokens = np.concatenate(docs).astype(np.uint16)
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    key = "cd" + "0" * 30
    TokenStore(tmp_path / "cache").put(key, tokens, lengths, 80, {}, [], "test")
    prefix = tmp_path / "cache" / "tokens" / key[:2] / key
    assert [d.tolist() for d in mmidx.read(prefix)] == [d.tolist() for d in docs]
    got, bad, _ = read_all(plan(Path(f"{prefix}.idx"), 500))
    assert got == [d.tolist() for d in docs] and not bad


# -- configuration -------------------------------------------------------------------------


def _config(source) -> dict:
    return {
        "jobs": {
            "j": {"sources": [source], "tokenizer": "t.json", "seq_len": 8, "global_batch_size": 2}
        }
    }


def test_config_reads_token_field_and_megatron():
    cfg = from_dict(_config({"path": "/d/*.parquet", "token_field": "input_ids"}))
    assert cfg.jobs[0].datasets[0].sources[0] == SourceSpec(
        "/d/*.parquet", "auto", "text", "input_ids"
    )
    cfg = from_dict(_config({"path": "/d/*", "format": "megatron"}))
    assert cfg.jobs[0].datasets[0].sources[0].format == "megatron"
    assert from_dict(_config("/d/*.idx")).jobs[0].datasets[0].sources[0].token_field is None


@pytest.mark.parametrize(
    ("source", "needles"),
    [
        (
            {"path": "/d/*.jsonl", "token_field": "ids"},
            ["sources[0].token_field", "'ids'", "Parquet sources only"],
        ),
        ({"path": "/d/*", "format": "jsonl", "token_field": "ids"}, ["not JSON Lines"]),
        ({"path": "/d/*.idx", "token_field": "ids"}, ["sources[0].token_field", "Megatron"]),
        ({"path": "/d/*", "format": "megatron", "token_field": "ids"}, ["token ids already"]),
        (
            {"path": "/d/*.parquet", "token_field": "ids", "text_field": "body"},
            ["either a text column or a token column", "'body'", "'ids'"],
        ),
        ({"path": "/d/*.idx", "text_field": "body"}, ["sources[0].text_field", "no text field"]),
        ({"path": "/d/*.parquet", "token_field": ""}, ["sources[0].token_field", "''"]),
        ({"path": "/d/*", "format": "bin"}, ["sources[0].format", "'bin'"]),
    ],
)
def test_config_refuses_fields_that_cannot_apply(source, needles):
    with pytest.raises(ConfigError) as err:
        from_dict(_config(source))
    for needle in needles:
        assert needle in str(err.value)
