"""Token store: Megatron-compatible .bin/.idx pairs, manifests, and corruption detection."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.errors import ChunkMissing, StoreCorruptError
from tokenfeed.server.store.chunkfiles import decode_idx, encode_idx
from tokenfeed.server.store.tokstore import TokenStore

KEY = "ab" + "0123456789abcdef" * 2

# Megatron-LM's DType codes, written out independently of the module under test.
MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def paths(root: Path, key: str = KEY) -> tuple[Path, Path, Path, Path]:
    d = root / "tokens" / key[:2]
    return d / f"{key}.bin", d / f"{key}.idx", d / f"{key}.json", d / f"{key}.rec"


def read_megatron(bin_path: Path, idx_path: Path) -> list[np.ndarray]:
    """A chunk's documents, read the way Megatron's MMapIndexedDataset does: numpy + struct."""
    raw = idx_path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", raw[9:17])
    (code,) = struct.unpack("<B", raw[17:18])
    (seqs,) = struct.unpack("<Q", raw[18:26])
    (docs,) = struct.unpack("<Q", raw[26:34])
    assert version == 1
    offset = 34
    sizes = np.frombuffer(raw, dtype="<i4", count=seqs, offset=offset)
    offset += 4 * seqs
    pointers = np.frombuffer(raw, dtype="<i8", count=seqs, offset=offset)
    offset += 8 * seqs
    doc_idx = np.frombuffer(raw, dtype="<i8", count=docs, offset=offset)
    offset += 8 * docs
    assert offset == len(raw), "trailing bytes after doc_idx"
    # One sequence per document: doc_idx is 0..n.
    assert doc_idx.tolist() == list(range(seqs + 1))
    dtype = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
    data = np.fromfile(bin_path, dtype=dtype)
    starts = pointers // dtype.itemsize
    return [data[a : a + n] for a, n in zip(starts, sizes, strict=True)]


def docs_of(lengths: list[int], dtype) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    lengths_arr = np.array(lengths, dtype=np.int32)
    tokens = (np.arange(int(lengths_arr.sum())) * 7 + 3).astype(dtype)
    bounds = np.concatenate([[0], np.cumsum(lengths_arr)]).astype(np.int64)
    return tokens, lengths_arr, [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def put(store: TokenStore, tokens, lengths, key: str = KEY):
    return store.put(
        key,
        tokens,
        lengths,
        records=len(lengths) + 1,
        bad={"empty": 1},
        bad_examples=["s.jsonl:3: empty"],
        source="s.jsonl",
    )


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_put_writes_files_megatron_can_read(tmp_path, dtype):
    tokens, lengths, docs = docs_of([5, 0, 3, 250, 1], dtype)
    put(TokenStore(tmp_path), tokens, lengths)
    got = read_megatron(*paths(tmp_path)[:2])
    assert len(got) == len(docs)
    for a, b in zip(got, docs, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("lengths", [[4, 0, 9, 2], [0, 0], []])
def test_put_get_index_open_round_trip(tmp_path, lengths):
    tokens, lens, docs = docs_of(lengths, np.uint16)
    index = put(TokenStore(tmp_path), tokens, lens)
    assert (index.key, index.num_docs, index.num_tokens) == (KEY, len(lengths), sum(lengths))
    assert (index.records, index.bad) == (len(lengths) + 1, {"empty": 1})

    # A new instance is a new process as far as the store is concerned: it re-verifies.
    fresh = TokenStore(tmp_path)
    assert fresh.get_index(KEY) == index
    chunk = fresh.open(KEY)
    assert chunk.tokens.dtype == np.uint16
    assert np.array_equal(chunk.tokens, tokens)
    assert chunk.doc_lengths.tolist() == lengths
    for off, n, doc in zip(chunk.doc_offsets, chunk.doc_lengths, docs, strict=True):
        assert np.array_equal(chunk.tokens[off : off + n], doc)


def test_manifest_records_sizes_and_digests(tmp_path):
    tokens, lengths, _ = docs_of([3, 4], np.int32)
    put(TokenStore(tmp_path), tokens, lengths)
    bin_path, idx_path, meta_path, rec_path = paths(tmp_path)
    m = json.loads(meta_path.read_text())
    assert m["rec_bytes"] == rec_path.stat().st_size == 2 * 8
    assert m["bin_bytes"] == bin_path.stat().st_size == 7 * 4
    assert m["idx_bytes"] == idx_path.stat().st_size == 34 + 2 * 4 + 2 * 8 + 3 * 8
    assert m["dtype"] == "int32" and m["num_tokens"] == 7 and m["num_docs"] == 2


def test_missing_chunk_is_absent(tmp_path):
    store = TokenStore(tmp_path)
    assert store.get_index(KEY) is None
    with pytest.raises(ChunkMissing, match=KEY):
        store.open(KEY)


def test_truncated_bin_is_dropped_on_rescan_and_the_manifest_kept(tmp_path):
    tokens, lengths, _ = docs_of([100, 20], np.uint16)
    index = put(TokenStore(tmp_path), tokens, lengths)
    bin_path, idx_path, meta_path, rec_path = paths(tmp_path)
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    store = TokenStore(tmp_path)
    # The index of the chunk survives (the job's index is computed from manifests); the body
    # is gone, so the next use rebuilds it rather than trusting any leftover file.
    assert store.get_index(KEY) == index
    assert not store.has_body(KEY)
    assert meta_path.exists() and not any(p.exists() for p in (bin_path, idx_path, rec_path))
    with pytest.raises(ChunkMissing):
        store.open(KEY)


def test_size_mismatch_is_caught_even_by_the_writing_instance(tmp_path):
    # Sizes are checked on every open, unlike digests.
    store = TokenStore(tmp_path)
    tokens, lengths, _ = docs_of([10], np.int32)
    put(store, tokens, lengths)
    with paths(tmp_path)[1].open("ab") as f:
        f.write(b"\0")
    with pytest.raises(StoreCorruptError, match="disagree"):
        store.open(KEY)
    assert not store.has_body(KEY) and store.get_index(KEY) is not None


def test_body_without_manifest_is_removed_on_rescan(tmp_path):
    tokens, lengths, _ = docs_of([3, 4], np.int32)
    put(TokenStore(tmp_path), tokens, lengths)
    paths(tmp_path)[2].unlink()  # a crash before the commit point
    store = TokenStore(tmp_path)
    assert store.get_index(KEY) is None
    assert not any(p.exists() for p in paths(tmp_path))


@pytest.mark.parametrize("which", [0, 1, 3], ids=["bin", "idx", "rec"])
def test_flipped_byte_fails_checksum_in_a_fresh_store(tmp_path, which):
    tokens, lengths, _ = docs_of([100, 20], np.uint16)
    put(TokenStore(tmp_path), tokens, lengths)
    target = paths(tmp_path)[which]
    data = bytearray(target.read_bytes())
    data[len(data) - 3] ^= 0x40  # same size: only the digest can tell
    target.write_bytes(bytes(data))

    store = TokenStore(tmp_path)
    assert store.get_index(KEY) is not None  # the rescan checks sizes only, by design
    with pytest.raises(StoreCorruptError, match="checksum"):
        store.open(KEY)
    # The body is dropped (to be rebuilt), the manifest kept.
    assert store.get_index(KEY) is not None and not store.has_body(KEY)
    assert [p.exists() for p in paths(tmp_path)] == [False, False, True, False]


def test_unreadable_manifest_is_dropped(tmp_path):
    tokens, lengths, _ = docs_of([3], np.int32)
    put(TokenStore(tmp_path), tokens, lengths)
    paths(tmp_path)[2].write_bytes(b'{"key": ')
    assert TokenStore(tmp_path).get_index(KEY) is None
    assert not any(p.exists() for p in paths(tmp_path))


def test_stale_temp_files_are_removed_on_open(tmp_path):
    tokens, lengths, _ = docs_of([3, 3], np.int32)
    put(TokenStore(tmp_path), tokens, lengths)
    d = paths(tmp_path)[0].parent
    stale = [d / f"{KEY}.bin.x1y2.tmp", d / f"{KEY}.json.abc.tmp", tmp_path / "tokens/cd/z.tmp"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    store = TokenStore(tmp_path)
    assert not any(p.exists() for p in stale)
    # Committed files are untouched.
    assert np.array_equal(store.open(KEY).tokens, tokens)


def test_put_leaves_no_temp_files(tmp_path):
    tokens, lengths, _ = docs_of([3, 3], np.int32)
    put(TokenStore(tmp_path), tokens, lengths)
    assert list((tmp_path / "tokens").rglob("*.tmp")) == []


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2**31 - 1), max_size=50),
    dtype=st.sampled_from([np.uint8, np.uint16, np.int32, np.int64]),
)
def test_encode_decode_idx_round_trip(lengths, dtype):
    lens = np.array(lengths, dtype=np.int32)
    dt = np.dtype(dtype)
    got_dtype, got_lengths, pointers = decode_idx(encode_idx(lens, dt))
    assert got_dtype == dt
    assert got_lengths.tolist() == lengths
    # Pointers are byte offsets: int64 so chunks past 2 GiB do not wrap.
    expected = np.concatenate([[0], np.cumsum(lens.astype(np.int64))[:-1]]) * dt.itemsize
    assert pointers.tolist() == expected[: len(lengths)].tolist()


def test_decode_idx_rejects_bad_magic_version_and_dtype():
    good = encode_idx(np.array([1, 2], dtype=np.int32), np.dtype(np.uint16))
    with pytest.raises(StoreCorruptError, match="magic"):
        decode_idx(b"NOTANIDX!" + good[9:])
    with pytest.raises(StoreCorruptError, match="version"):
        decode_idx(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(StoreCorruptError, match="dtype code"):
        decode_idx(good[:17] + b"\x63" + good[18:])
