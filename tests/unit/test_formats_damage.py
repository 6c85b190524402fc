"""Damaged and unreadable layouts (issue 24), read the way a build reads them (plan_chunks, then
each chunk's records): every bad record counted and located by shard and sample, row or
member; every layout that cannot be read refused at planning with its path and what was
expected; one chunk of a large shard read with ranged reads of about its own size; the tar and
Arrow shard indexes walked once and kept. Inputs are made by the real writers
(tests/formats.py), then damaged here.
"""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import formats
import numpy as np
import pyarrow as pa
import pytest
from tokenfeed.server.diskcache.cache import DiskCache
from tokenfeed.server.errors import SourceError
from tokenfeed.server.objstore.objects import ObjectInfo
from tokenfeed.server.objstore.storage import ObjectStorage
from tokenfeed.server.settings.config import SourceSpec
from tokenfeed.server.source import arrowfiles, pretokenized, tarwalk, wds
from tokenfeed.server.source.chunks import plan_chunks
from tokenfeed.server.source.readers import locate_record, read_documents
from tokenfeed.server.store.shardfiles import ShardIndexFiles

TEXTS = [f"document {i}: " + "words of some length " * (i % 9 + 1) for i in range(120)]


def read_all(pattern, chunk_bytes=2048, storage=None, indexes=None, **spec):
    """(texts, bad records as 'location: reason', records) of every chunk of a source."""
    storage = storage or ObjectStorage()
    source = SourceSpec(str(pattern), **spec)
    objects = storage.for_uri(source.pattern).list(source.pattern)
    chunks = plan_chunks([(o, source) for o in objects], chunk_bytes, storage, indexes)
    texts, bad, records = [], [], 0
    for c in chunks:
        docs = read_documents(storage.for_uri(c.source.uri), c)
        texts += docs.texts
        bad += [f"{b.location}: {b.reason}" for b in docs.bad]
        records += docs.records
    return texts, bad, records


def cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ---------------------------------------------------------------- MDS


def test_a_truncated_mds_shard_loses_only_the_samples_past_its_end(tmp_path):
    formats.write_mds(tmp_path / "m", TEXTS)
    index = json.loads((tmp_path / "m" / "index.json").read_text())
    n0 = index["shards"][0]["samples"]
    shard = tmp_path / "m" / "shard.00000.mds"
    offsets = np.frombuffer(shard.read_bytes()[4 : 4 + 4 * (n0 + 1)], dtype="<u4")
    cut(shard, int(offsets[n0 - 3]) + 5)  # inside sample n0 - 3
    texts, bad, records = read_all(tmp_path / "m")
    assert records == len(TEXTS)
    assert bad == [f"{shard} sample {k}: truncated" for k in range(n0 - 3, n0)]
    assert texts == TEXTS[: n0 - 3] + TEXTS[n0:]


def test_a_truncated_zstd_shard_keeps_the_samples_it_holds_whole(tmp_path, texts):
    many = texts[:400]  # one shard of prose, about 300 KB: zstd blocks of 128 KB
    formats.write_mds(tmp_path / "m", many, compression="zstd", size_limit=1 << 20)
    shard = tmp_path / "m" / "shard.00000.mds.zstd"
    cut(shard, shard.stat().st_size * 3 // 4)
    texts, bad, records = read_all(tmp_path / "m", chunk_bytes=1 << 20)
    assert records == len(many)
    first = len(texts)
    assert 0 < first < len(many) and texts == many[:first]
    assert bad == [f"{shard} sample {k}: truncated" for k in range(first, len(many))]


@pytest.mark.parametrize("delta", [3, -2])
def test_an_index_json_that_miscounts_a_shard_is_counted_and_located(tmp_path, delta):
    formats.write_mds(tmp_path / "m", TEXTS)
    path = tmp_path / "m" / "index.json"
    index = json.loads(path.read_text())
    n1 = index["shards"][1]["samples"]
    index["shards"][1]["samples"] = n1 + delta
    path.write_text(json.dumps(index))
    texts, bad, _ = read_all(tmp_path / "m")
    shard = tmp_path / "m" / "shard.00001.mds"
    if delta > 0:  # samples the index counts and the shard does not hold
        assert bad == [f"{shard} sample {k}: index_mismatch" for k in range(n1, n1 + delta)]
        assert texts == TEXTS
    else:  # samples the shard holds and the index does not count: one record says so
        assert bad == [f"{shard} samples {n1 + delta}-{n1 - 1}: index_mismatch"]
        n0 = index["shards"][0]["samples"]
        assert len(texts) == len(TEXTS) + delta
        assert TEXTS[n0 + n1 + delta] not in texts


def test_a_shard_without_the_column_has_its_samples_counted(tmp_path):
    # Two writers' directories under one index.json (what streaming's merge_index writes).
    formats.write_mds(tmp_path / "m" / "a", TEXTS[:60])
    out = tmp_path / "m" / "b"
    with formats.mds_writer()(out=str(out), columns={"body": "str"}, size_limit=1 << 13) as w:
        for t in TEXTS[60:]:
            w.write({"body": t})
    shards = []
    for d in ("a", "b"):
        for s in json.loads((tmp_path / "m" / d / "index.json").read_text())["shards"]:
            s["raw_data"]["basename"] = f"{d}/{s['raw_data']['basename']}"
            shards.append(s)
    (tmp_path / "m" / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))
    texts, bad, records = read_all(tmp_path / "m")
    assert texts == TEXTS[:60] and records == 120
    assert len(bad) == 60 and all(": missing_field" in b for b in bad)
    assert bad[0] == f"{out}/shard.00000.mds sample 0: missing_field"
    with pytest.raises(
        SourceError, match=r"no shard has a column 'title' .*\['body', 'n', 'text'\]"
    ):
        read_all(tmp_path / "m", text_field="title")


def test_text_that_is_not_utf8_is_located_by_sample(tmp_path):
    with formats.mds_writer()(out=str(tmp_path / "m"), columns={"text": "bytes"}) as w:
        for i, t in enumerate(TEXTS[:20]):
            w.write({"text": b"\xff\xfe" if i == 7 else t.encode()})
    texts, bad, _ = read_all(tmp_path / "m", format="mds")
    assert bad == [f"{tmp_path}/m/shard.00000.mds sample 7: invalid_utf8"]
    assert texts == TEXTS[:7] + TEXTS[8:20]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("no index", ["no index.json", "(version 2)"]),
        ("version 1", ["index.json: not an MDS index", "version 2"]),
        ("shard gone", ["its shard 1 (shard.00001.mds) is not there", "does not match"]),
        ("pkl", ["encoded 'pkl'", "runs code"]),
        ("brotli", ["compressed with 'br'", "zstd"]),
    ],
)
def test_an_unreadable_mds_layout_is_refused_at_start(tmp_path, damage, words):
    m = tmp_path / "m"
    if damage in ("pkl", "brotli"):
        columns = {"text": "pkl"} if damage == "pkl" else {"text": "str"}
        compression = "br" if damage == "brotli" else None
        with formats.mds_writer()(out=str(m), columns=columns, compression=compression) as w:
            w.write({"text": "a"})
    else:
        formats.write_mds(m, TEXTS)
    if damage == "no index":
        (m / "index.json").unlink()
    if damage == "version 1":
        (m / "index.json").write_text(json.dumps({"version": 1, "shards": []}))
    if damage == "shard gone":
        (m / "shard.00001.mds").unlink()
    with pytest.raises(SourceError) as err:
        read_all(m, format="mds")
    assert str(m) in str(err.value)
    for w in words:
        assert w in str(err.value)


# ---------------------------------------------------------------- WebDataset


def test_tar_damage_is_counted_and_located_by_member_or_sample(tmp_path):
    good = [(f"s/{i:04d}.txt", t.encode()) for i, t in enumerate(TEXTS[:10])]
    members = good[:3] + [("s/0003.cls", b"3")]  # sample 0003 has no text
    members += [("s/0004.txt", b"caf\xe9")]  # not UTF-8
    members += [("s/0005.json", b'{"id": 5}')]  # json, but the source reads .txt: missing
    members += good[6:]
    path = tmp_path / "d.tar"
    path.write_bytes(formats.tar_bytes(members))
    data = path.read_bytes()
    at = data.index(TEXTS[9].encode())  # the last member: cut inside its data
    cut(path, at + 10)
    texts, bad, records = read_all(path, chunk_bytes=3000)
    assert records == 10
    assert texts == TEXTS[:3] + TEXTS[6:9]
    assert bad == [
        f"{path} sample 3: missing_field",
        f"{path} member s/0004.txt: invalid_utf8",
        f"{path} sample 5: missing_field",
        f"{path} member s/0009.txt: truncated",
    ]


def test_a_json_member_without_the_field_and_a_corrupt_header(tmp_path):
    members = [(f"k/{i}.json", json.dumps({"text": t}).encode()) for i, t in enumerate(TEXTS[:6])]
    members[2] = ("k/2.json", b'{"body": "x"}')
    path = tmp_path / "j.tar"
    data = bytearray(formats.tar_bytes(members))
    h = data.index(b"k/4.json") - 0  # a pax or ustar header of member 4: its checksum fails
    block = h - h % 512
    data[block + 100 : block + 108] = b"7777777\0"
    path.write_bytes(bytes(data))
    texts, bad, _ = read_all(path, member="json")
    assert texts == TEXTS[:2] + TEXTS[3:4]
    assert bad[0] == f"{path} member k/2.json: missing_field"
    assert bad[1].startswith(f"{path} byte ") and bad[1].endswith(": corrupt_header")
    assert len(bad) == 2


def _damaged_tars(tmp_path: Path) -> dict[str, bytes]:
    """A good shard and shards damaged in the ways the header walk must locate."""
    good = formats.write_tar(tmp_path / "g.tar", TEXTS * 3).read_bytes()
    out = {"good": good}
    at = good.index(b"g/000011.txt")  # a member's header (pax or ustar) past the first batch
    bad_sum = bytearray(good)
    bad_sum[at - at % 512 + 100 : at - at % 512 + 108] = b"7777777\0"
    out["checksum"] = bytes(bad_sum)
    pax = bytearray(good)  # a pax payload of garbage under a header that fails its checksum
    block = good.index(b"g/000013.txt") - 512  # the payload of the pax header before it
    assert good[block - 512 : block - 512 + 14] == b"././@PaxHeader"
    pax[block : block + 12] = b"xx garbage y"
    pax[block - 512 + 100 : block - 512 + 108] = b"7777777\0"
    out["pax"] = bytes(pax)
    out["cut"] = good[: good.index(TEXTS[5].encode(), good.index(b"g/000020")) + 7]
    return out


@pytest.mark.parametrize("damage", ["good", "checksum", "pax", "cut"])
def test_the_batched_checksum_walk_is_the_header_by_header_walk(tmp_path, monkeypatch, damage):
    """`walked` verifies checksums a batch at a time: the same members and damage as the
    walk that verifies each header, whether a failing header is in a batch or the last."""
    data = _damaged_tars(tmp_path)[damage]
    expected = list(tarwalk.members(io.BytesIO(data), len(data)))
    # A header that fails ends the walk with its damage; a cut inside a member's data is the
    # reader's to find (the member's header still says its size).
    assert expected and isinstance(expected[-1], tarwalk.Damage) == (damage in ("checksum", "pax"))
    for batch in (4096, 5):
        monkeypatch.setattr(tarwalk._Checksums, "BATCH", batch)
        assert tarwalk.walked(io.BytesIO(data), len(data)) == expected, batch


@pytest.mark.parametrize("damage", ["good", "checksum", "cut", "members"])
@pytest.mark.parametrize("member", ["txt", "json"])
def test_a_planned_tar_is_read_as_the_walk_reads_it(tmp_path, monkeypatch, damage, member):
    """Chunks of a tar this process planned are cut where the plan's walk found each text,
    without walking their headers again; damaged ones read as the walk reads them."""
    if damage == "members":
        data = formats.tar_bytes(
            [("m/0.txt", b"one"), ("m/1.cls", b"1"), ("m/2.txt", b"caf\xe9"), ("m/3.txt", b"")]
            + [("m/4.json", b'{"text": 4}'), ("m/5.json", b"{"), ("m/6.json", b'{"text": "six"}')]
        )
    elif member == "json":
        data = formats.write_tar(tmp_path / "g.tar", TEXTS * 3, member="json").read_bytes()
        if damage != "good":
            cut_at = data.index(b'"text"', len(data) // 2) + 3  # inside a member's data
            data = data[:cut_at] if damage == "cut" else _damaged_tars(tmp_path)[damage]
    else:
        data = _damaged_tars(tmp_path)[damage]
    path = tmp_path / "t" / "s.tar"
    path.parent.mkdir()
    path.write_bytes(data)
    walks = []
    real = wds._samples

    def counted(f, size):
        walks.append(size)
        return real(f, size)

    monkeypatch.setattr(wds, "_samples", counted)
    wds._PLANNED.discard(wds._planned_key(_info(path), wds.reading(member, "text")))
    planned = read_all(path, member=member, chunk_bytes=300)  # planned in this process
    fell_back = len(walks) - 1  # one walk plans; the chunks read by walking them
    monkeypatch.setattr(wds, "_planned_texts", lambda *_: None)  # every chunk walked
    walks.clear()
    walked = read_all(path, member=member, chunk_bytes=300)
    assert planned == walked
    chunks = len(walks) - 1
    assert chunks >= 1 and 0 <= fell_back <= chunks
    if damage == "good":
        assert fell_back == 0 and len(planned[0]) == 3 * len(TEXTS)  # read without a walk
    else:
        assert fell_back > 0  # the chunks with damage were walked


def test_tar_gz_is_read_whole_and_its_truncation_located(tmp_path):
    path = formats.write_tar(tmp_path / "w.tar.gz", TEXTS[:40], gz=True)
    cut(path, path.stat().st_size * 2 // 3)
    texts, bad, records = read_all(path, chunk_bytes=1 << 20)
    assert 0 < len(texts) < 40 and texts == TEXTS[: len(texts)]
    # The stream ends early: one record says so, after what the sample it cut left (if any).
    n = len(texts)
    assert bad[-1] == f"{path} sample {records - 1}: truncated"
    assert all(f"sample {n}" in b or "w/0000" in b for b in bad[:-1]) and len(bad) <= 3


# ---------------------------------------------------------------- Arrow and the Hub


def test_arrow_rows_that_are_not_utf8_or_cut_short_are_located(tmp_path):
    values = [t.encode() for t in TEXTS[:80]]
    values[5] = b"\xc3\x28"
    formats.write_saved(tmp_path / "s", values, shards=1)
    path = tmp_path / "s" / "data-00000-of-00001.arrow"
    table = arrowfiles.batch_table(ObjectStorage().for_uri(str(path)), _info(path))
    last = table[-1]
    cut(path, int(last[0] + last[1] // 2))  # the last batch (rows 64-79) cut in half
    texts, bad, records = read_all(tmp_path / "s")
    assert records == 80
    assert bad[0] == f"{path} row 5: invalid_utf8"
    assert bad[1:] == [f"{path} row {r}: truncated" for r in range(64, 80)]
    assert texts == TEXTS[:5] + TEXTS[6:64]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        ("no state", ["no state.json", "save_to_disk"]),
        ("file gone", ["data file data-00001-of-00002.arrow is not there"]),
        ("no column", ["no column 'body'", "['text']", "text_field"]),
        ("ipc file", ["an Arrow IPC file (ARROW1)", "stream format"]),
    ],
)
def test_an_unreadable_arrow_layout_is_refused_at_start(tmp_path, make, words):
    s = formats.write_saved(tmp_path / "s", TEXTS[:40])
    spec: dict = {"format": "arrow"}
    if make == "no state":
        (s / "state.json").unlink()
    if make == "file gone":
        (s / "data-00001-of-00002.arrow").unlink()
    if make == "no column":
        spec["text_field"] = "body"
    if make == "ipc file":
        table = pa.table({"text": TEXTS[:4]})
        with pa.ipc.new_file(str(s / "data-00000-of-00002.arrow"), table.schema) as w:
            w.write_table(table)
    with pytest.raises(SourceError) as err:
        read_all(s, **spec)
    assert str(s) in str(err.value)
    for w in words:
        assert w in str(err.value)


def test_hub_layouts_pick_the_config_and_split(tmp_path):
    hub = formats.write_hub(tmp_path / "hub", {"train": TEXTS[:50], "validation": TEXTS[50:60]})
    assert sorted(read_all(hub, format="hf")[0]) == sorted(TEXTS[:50])
    assert sorted(read_all(hub, format="hf", split="validation")[0]) == sorted(TEXTS[50:60])
    with pytest.raises(SourceError, match="no config 'en'"):
        read_all(hub, format="hf", config="en")
    # The Parquet export's layout, without a README: <config>/<split>/NNNN.parquet
    export = tmp_path / "export"
    for config, split, texts in (("en", "train", TEXTS[:30]), ("fr", "train", TEXTS[30:40])):
        (export / config / split).mkdir(parents=True)
        formats.write_hub(tmp_path / "tmp" / config, {split: texts}, shards=1)
        src = tmp_path / "tmp" / config / "data" / f"{split}-00000-of-00001.parquet"
        src.rename(export / config / split / "0000.parquet")
    assert read_all(export, format="hf", config="fr")[0] == TEXTS[30:40]
    (tmp_path / "link").symlink_to(export)  # named through a symlink: the same files
    assert read_all(tmp_path / "link", format="hf", config="fr")[0] == TEXTS[30:40]
    with pytest.raises(SourceError, match="no data files for split 'test'"):
        read_all(export, format="hf", config="en", split="test")


# ---------------------------------------------------------------- reads and shard indexes


class CountingStore:
    """A local store that counts the bytes each read asks for."""

    parallel_reads = 1

    def __init__(self, inner):
        self.inner, self.bytes = inner, 0

    def list(self, pattern):
        return self.inner.list(pattern)

    def read_range(self, obj, start, end):
        data = self.inner.read_range(obj, start, end)
        self.bytes += len(data)
        return data

    def open(self, obj):
        return io.BytesIO(self.read_range(obj, 0, obj.size))


class CountingStorage(ObjectStorage):
    def __init__(self):
        super().__init__()
        self.store = CountingStore(super().for_uri("/"))

    def for_uri(self, uri):
        return self.store


@pytest.mark.parametrize("layout", ["mds", "tar", "arrow"])
def test_one_chunk_of_a_large_shard_is_read_by_ranges_of_its_size(tmp_path, layout):
    many = TEXTS * 20  # 2400 documents, about 400 KB
    if layout == "mds":
        formats.write_mds(tmp_path / "x", many, size_limit=1 << 22)
    elif layout == "tar":
        (tmp_path / "x").mkdir()
        formats.write_tar(tmp_path / "x" / "big.tar", many, extra=False)
    else:
        formats.write_saved(tmp_path / "x", many, shards=1)
    storage = CountingStorage()
    source = SourceSpec(str(tmp_path / "x"))
    objects = storage.for_uri("").list(source.pattern)
    chunks = plan_chunks([(o, source) for o in objects], 16384, storage)
    big = max(o.size for o in objects)
    assert len(chunks) > 10 and big > 300_000
    c = chunks[len(chunks) // 2]
    storage.store.bytes = 0
    docs = read_documents(storage.for_uri(""), c)
    assert docs.texts and not docs.bad
    assert storage.store.bytes < c.raw_bytes + 4096, (storage.store.bytes, c.raw_bytes)
    assert docs.texts == many[many.index(docs.texts[0]) :][: len(docs.texts)]
    where = locate_record(storage, c, types.SimpleNamespace(data_start=0), 0)  # type: ignore[arg-type]
    assert where[0] == c.source.uri and where[1].split()[0] in ("sample", "row")


def test_tar_and_arrow_shards_are_walked_once_and_kept(tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    formats.write_tar(tmp_path / "w" / "a.tar", TEXTS)
    formats.write_saved(tmp_path / "s", TEXTS)
    walks = {"tar": 0, "arrow": 0}
    real_tar, real_arrow = wds.sample_table, arrowfiles.batch_table

    def tar_walk(store, obj, text_field=""):
        walks["tar"] += 1
        return real_tar(store, obj, text_field)

    def arrow_walk(store, obj):
        walks["arrow"] += 1
        return real_arrow(store, obj)

    monkeypatch.setattr(wds, "sample_table", tar_walk)
    monkeypatch.setattr(arrowfiles, "batch_table", arrow_walk)
    cache = tmp_path / "cache"
    first = read_all(tmp_path / "w", indexes=ShardIndexFiles(DiskCache(cache, 2**30)))
    read_all(tmp_path / "s", indexes=ShardIndexFiles(DiskCache(cache, 2**30)))
    assert walks == {"tar": 1, "arrow": 2}
    # A restart (a new cache over the same directory) plans from the kept indexes.
    indexes = ShardIndexFiles(DiskCache(cache, 2**30))
    assert read_all(tmp_path / "w", indexes=indexes) == first
    read_all(tmp_path / "s", indexes=indexes)
    assert walks == {"tar": 1, "arrow": 2}
    # A kept index that fails its digest is walked again.
    kept = sorted(cache.glob("shards/*/*.six"))
    assert len(kept) == 3
    for k in kept:
        k.write_bytes(k.read_bytes()[:-1] + b"?")
    assert read_all(tmp_path / "w", indexes=ShardIndexFiles(DiskCache(cache, 2**30))) == first
    assert walks["tar"] == 2


def test_token_columns_hold_ids_checked_against_the_vocabulary(tmp_path):
    ids = [[1, 2, 3], [4, 2000], [5, 6, 0]]  # 2000: outside a vocabulary of 1024; 0: EOS
    formats.write_mds(tmp_path / "m", ["a", "b", "c"], ids=ids)
    formats.write_saved(tmp_path / "s", ["a", "b", "c"], ids=ids, shards=1)
    tok = types.SimpleNamespace(vocab_size=1024, eos_id=0, dtype=np.dtype(np.uint16))
    for root, where in ((tmp_path / "m", "shard.00000.mds sample 1"), (tmp_path / "s", "row 1")):
        storage, spec = ObjectStorage(), SourceSpec(str(root), token_field="ids")
        objects = storage.for_uri(spec.pattern).list(spec.pattern)
        (chunk,) = plan_chunks([(o, spec) for o in objects], 1 << 20, storage)
        got = pretokenized.read_chunk(storage.for_uri(""), chunk, tok)  # type: ignore[arg-type]
        assert got.tokens.tolist() == [1, 2, 3, 5, 6] and got.lengths.tolist() == [3, 2]
        assert [b.reason for b in got.bad] == ["token_out_of_range"]
        assert got.bad[0].location.endswith(where)


def _info(path: Path) -> ObjectInfo:
    (info,) = ObjectStorage().for_uri(str(path)).list(str(path))
    return info


def test_auto_detection_reads_only_unambiguous_layouts(tmp_path):
    # An index.json that is not MDS, and a state.json that is not save_to_disk, stay JSON Lines.
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "index.json").write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "j" / "state.json").write_text(json.dumps({"text": "two"}) + "\n")
    assert sorted(read_all(tmp_path / "j")[0]) == ["one", "two"]
    # An MDS directory and a save_to_disk one side by side under one path: each read once,
    # their own description files (index.json, state.json, dataset_info.json) not as text.
    formats.write_mds(tmp_path / "both" / "m", TEXTS[:30])
    formats.write_saved(tmp_path / "both" / "s", TEXTS[30:60])
    texts, bad, records = read_all(tmp_path / "both")
    assert sorted(texts) == sorted(TEXTS[:60]) and bad == [] and records == 60
    # A lone MDS shard cannot be read without its index.json.
    with pytest.raises(SourceError, match="read through its index.json"):
        read_all(tmp_path / "both" / "m" / "shard.00000.mds")


@pytest.mark.parametrize(
    "field",
    [b"0001234\0", b"  1234 \0", b"1234\0\0\0\0", b"\0\0\0\0\0\0\0\0", b"        ", b"0000017 "]
    + [
        b"12 34\0\0\0",
        b"-12\0\0\0\0\0",
        b"1_2\0\0\0\0\0",
        b"\x80\0\0\0\0\0\x01\x00",
        b"12\n\0\0\0\0\0",
    ]
    + [b"9\0\0\0\0\0\0\0", b"12\x003 x\0\0", b" \x0012\0\0\0\0"],
)
def test_header_numbers_read_in_numpy_are_read_as_one_at_a_time(field):
    """The batch walk's octal reading of checksum fields: a plain field gives `_number`'s
    value; any other is marked for `_number` itself (which may refuse it)."""
    values, plain = tarwalk._octal(np.frombuffer(field, dtype=np.uint8).reshape(1, 8))
    try:
        expected = tarwalk._number(field)
    except ValueError:
        expected = None
    if plain[0]:
        assert int(values[0]) == expected, field
    # What writers write is plain (the fast path covers it), and whatever follows a NUL.
    assert plain[0] == (field in USUAL_FIELDS or field.startswith((b" \x00", b"12\x00"))), field


USUAL_FIELDS = (b"0001234\0", b"  1234 \0", b"1234\0\0\0\0", b"\0" * 8, b" " * 8, b"0000017 ")
