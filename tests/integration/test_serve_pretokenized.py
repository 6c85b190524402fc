"""Pre-tokenized sources served by a real server: Megatron .bin/.idx pairs (local and on an
S3-compatible server) and Parquet token columns, with bad and corrupt input.

(Named apart from tests/unit/test_pretokenized.py: test modules share one namespace here.)

The oracle is the test's own data: the Megatron files are written by tests/mmidx.py from the
published format, the Parquet files by pyarrow. Over one epoch, (a) every document piece of a
row (split by `segment_ids`) is a contiguous run of one written document followed by EOS, (b)
every piece Explain reports reads back from the written document, the pieces of each document
tile a prefix of it with no overlap, and what no row holds is less than one row per chunk (the
documented remainder), and (c) document tokens plus EOS tokens fill every row exactly.
"""

from __future__ import annotations

import mmidx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3env import s3_client
from support import (
    TOKENIZER,
    ServerProcess,
    batch_bytes,
    job_spec,
    write_config,
    write_jsonl,
)
from tokenizers import Tokenizer

EOS = 0  # <|endoftext|> in the test tokenizer (1024 ids)
VOCAB = 1024

Expected = dict[str, dict[int, list[int]]]  # source URI -> record number -> served document


def documents(n: int, seed: int, eod: bool) -> list[list[int]]:
    """n documents of 1..150 ids in [1, VOCAB), with a trailing EOS when `eod` (what
    Megatron's preprocess_data.py --append-eod writes)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, VOCAB, size=int(rng.integers(1, 150))).tolist() for _ in range(n)]
    return [d + [EOS] for d in docs] if eod else docs


def served_form(doc: list[int]) -> list[int]:
    """What the server should serve of a written document: a trailing EOS is the packer's."""
    return doc[:-1] if doc and doc[-1] == EOS else doc


def serve_epoch(proc: ServerProcess, job: str) -> tuple[dict, list]:
    """(DescribeJob, [(input_ids, segment_ids, Explain pieces)] for every row that starts in
    epoch 0: ceil(U / seq_len) rows, U the epoch's tokens and EOS, the last one reading on into
    epoch 1)."""
    rows, info = [], proc.wait_ready(job)
    with proc.client(job, timeout=60) as c:
        assert info["state"] == "JOB_STATE_READY", (info["error"], proc.log())
        units = int(info["num_tokens"]) + int(info["num_documents"])
        total = -(-units // int(info["seq_len"]))
        batch = int(info["global_batch_size"])
        for step in range(-(-total // batch)):
            b, why = c.get_batch(step), c.explain(step)
            assert why["fingerprint"] == b.fingerprint
            rows += [
                (b["input_ids"][r["row"]], b["segment_ids"][r["row"]], r["pieces"])
                for r in why["rows"]
                if int(r["epoch"]) == 0
            ]
    assert len(rows) == total
    return info, rows


def check_epoch(proc: ServerProcess, job: str, expected: Expected) -> dict:
    info, rows = serve_epoch(proc, job)
    seq_len = int(info["seq_len"])
    docs = [d for per_source in expected.values() for d in per_source.values()]
    assert int(info["num_documents"]) == len(docs)

    # (a) without Explain: each segment of a row is a run of one document and its EOS
    haystack = "|," + ",|,".join(",".join(map(str, [*d, EOS])) for d in docs) + ",|"
    for ids, seg, _ in rows[::3]:
        for s in np.unique(seg):
            piece = "," + ",".join(map(str, ids[seg == s].tolist())) + ","
            assert piece in haystack

    # (b) with Explain: pieces read back from the written documents and cover each of them
    covered: dict[tuple[str, int], np.ndarray] = {}
    eos_served = served = 0
    for ids, _, pieces in rows:
        eos_served += int((ids == EOS).sum())  # no written document holds EOS inside
        for p in pieces:
            kind, number = p["record"].split()
            assert kind == ("document" if p["source"].endswith(".idx") else "row"), p
            doc = expected[p["source"]][int(number)]  # a KeyError: a bad record was served
            a, b = p["token_start"], p["token_end"]
            assert ids[p["row_start"] : p["row_end"]].tolist() == doc[a:b]
            key = (p["source"], int(number))
            covered.setdefault(key, np.zeros(len(doc), dtype=np.int64))[a:b] += 1
            served += b - a
    # Every token of every document at least once; the rest (the last row reading on into
    # epoch 1) is less than one row.
    assert len(covered) == len(docs)
    assert all((c >= 1).all() for c in covered.values())
    units = sum(map(len, docs)) + len(docs)
    assert 0 <= served - sum(map(len, docs)) <= len(rows) * seq_len - units
    # (c) nothing else in the rows: document tokens and one EOS after each
    assert served + eos_served == len(rows) * seq_len
    return info


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory):
    """Megatron files (uint16 with EOD, int32 without, sentence-grouped document index) and
    Parquet token columns (list<int32> and large_list<int64>), and a server with a job each."""
    root = tmp_path_factory.mktemp("pretok").resolve()
    (root / "meg").mkdir()
    (root / "pq").mkdir()
    a, b = documents(240, 1, eod=True), documents(180, 2, eod=False)
    a_idx = mmidx.write(root / "meg" / "a", a, np.uint16)
    b_idx = mmidx.write(root / "meg" / "b", b, np.int32, document_index=[0, 5, 50, 120, 180])
    c, d = documents(200, 3, eod=True), documents(100, 4, eod=False)
    c_path, d_path = root / "pq" / "c.parquet", root / "pq" / "d.parquet"
    pq.write_table(
        pa.table(
            {"input_ids": pa.array(c, type=pa.list_(pa.int32())), "text": ["unused"] * len(c)}
        ),
        c_path,
        row_group_size=60,
    )
    pq.write_table(
        pa.table({"input_ids": pa.array(d, type=pa.large_list(pa.int64()))}),
        d_path,
        row_group_size=30,
    )
    jobs = {
        "meg": job_spec([root / "meg" / "*.idx"], chunk_bytes="2KiB"),
        "pq": job_spec([], chunk_bytes="2KiB")
        | {"sources": [{"path": str(root / "pq" / "*.parquet"), "token_field": "input_ids"}]},
    }
    proc = ServerProcess(write_config(root / "tf.yaml", jobs, root / "cache"), root / "log.txt")
    for job in jobs:
        assert proc.wait_ready(job)["state"] == "JOB_STATE_READY", proc.log()
    expected = {
        "meg": {str(a_idx): dict(enumerate(map(served_form, a))), str(b_idx): dict(enumerate(b))},
        "pq": {str(c_path): dict(enumerate(map(served_form, c))), str(d_path): dict(enumerate(d))},
    }
    yield proc, root, expected
    assert proc.stop() == 0, proc.log()


def test_a_megatron_dataset_is_served_document_by_document(pretokenized):
    proc, _, expected = pretokenized
    info = check_epoch(proc, "meg", expected["meg"])
    assert int(info["num_chunks"]) > 10 and info["bad_records"] == []
    docs = [d for per_source in expected["meg"].values() for d in per_source.values()]
    assert int(info["num_tokens"]) == sum(map(len, docs))  # the EOD of `a` is not counted


def test_a_parquet_token_column_is_served_row_by_row(pretokenized):
    proc, _, expected = pretokenized
    info = check_epoch(proc, "pq", expected["pq"])
    assert int(info["num_chunks"]) == 4 + 4  # row groups: 200 rows by 60, 100 rows by 30
    assert info["bad_records"] == []


def test_megatron_batches_from_s3_equal_the_local_ones(
    pretokenized, moto_server, s3_bucket, tmp_path
):
    proc, root, _ = pretokenized
    client = s3_client(moto_server.endpoint)
    for path in sorted((root / "meg").iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"meg/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=s3_bucket, Key="tok/tokenizer.json", Body=TOKENIZER.read_bytes())
    spec = job_spec(
        [f"s3://{s3_bucket}/meg/*.idx"],
        chunk_bytes="2KiB",
        tokenizer=f"s3://{s3_bucket}/tok/tokenizer.json",
    )
    object_store = {
        "endpoint_url": moto_server.endpoint,
        "addressing_style": "path",
        "block_bytes": "4KiB",
        "max_attempts": 4,
    }
    cfg = write_config(
        tmp_path / "s3.yaml", {"meg": spec}, tmp_path / "cache", object_store=object_store
    )
    remote = ServerProcess(cfg, tmp_path / "s3.log")
    try:
        assert remote.wait_ready("meg")["state"] == "JOB_STATE_READY", remote.log()
        with proc.client("meg") as local, remote.client("meg", timeout=60) as s3:
            want, got = local.describe(), s3.describe()
            for key in ("num_chunks", "num_documents", "num_tokens", "rows_per_epoch"):
                assert got[key] == want[key], key
            steps = int(want["steps_per_epoch"])
            for step in range(steps + 2):
                assert batch_bytes(s3.get_batch(step)) == batch_bytes(local.get_batch(step))
            why = s3.explain(3)["rows"][0]["pieces"][0]
            assert why["source"].startswith(f"s3://{s3_bucket}/meg/")
            assert why["record"].startswith("document ")
    finally:
        assert remote.stop() == 0, remote.log()


# -- bad and corrupt input ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretok-bad").resolve()
    for d in ("skip", "strict", "corrupt-idx", "corrupt-bin"):
        (root / d).mkdir()
    e = documents(150, 5, eod=True)
    e[3] = e[3][:2] + [VOCAB] + e[3][2:]  # one past the last id
    e[64] = e[64][:-1] + [60000, EOS]
    e[10] = []
    e[20] = [EOS]
    e_idx = mmidx.write(root / "skip" / "e", e, np.uint16)
    f = documents(50, 6, eod=False)
    f[7] = None
    f[33] = [5, -1, 6]
    f_path = root / "skip" / "f.parquet"
    pq.write_table(pa.table({"ids": pa.array(f, type=pa.list_(pa.int32()))}), f_path)
    g = documents(90, 7, eod=False)
    g[41] = [1, 2, 4096]
    g_idx = mmidx.write(root / "strict" / "g", g, np.int32)
    h_idx = mmidx.write(root / "corrupt-idx" / "h", documents(60, 8, eod=False), np.uint16)
    h_idx.write_bytes(h_idx.read_bytes()[:-8])  # truncated
    k_idx = mmidx.write(root / "corrupt-bin" / "k", documents(60, 9, eod=False), np.uint16)
    k_bin = root / "corrupt-bin" / "k.bin"
    k_bin.write_bytes(k_bin.read_bytes()[:-6])  # three tokens short
    jobs = {
        "skip": job_spec([e_idx], chunk_bytes="1KiB")
        | {"sources": [str(e_idx), {"path": str(f_path), "token_field": "ids"}]},
        "strict": job_spec([g_idx], chunk_bytes="1KiB", bad_records="strict"),
        "corrupt-idx": job_spec([root / "corrupt-idx" / "*.idx"], chunk_bytes="1KiB"),
        "corrupt-bin": job_spec([root / "corrupt-bin" / "*.idx"], chunk_bytes="1KiB"),
    }
    proc = ServerProcess(write_config(root / "tf.yaml", jobs, root / "cache"), root / "log.txt")
    for job in jobs:
        proc.wait_ready(job)
    paths = {"e": e_idx, "f": f_path, "g": g_idx, "h": h_idx, "k": k_idx, "k.bin": k_bin}
    expected = {
        str(e_idx): {i: served_form(d) for i, d in enumerate(e) if i not in (3, 10, 20, 64)},
        str(f_path): {i: d for i, d in enumerate(f) if i not in (7, 33)},
    }
    yield proc, paths, expected
    assert proc.stop() == 0, proc.log()


def test_bad_documents_are_skipped_counted_and_located(bad_input):
    proc, paths, expected = bad_input
    with proc.client("skip") as c:
        counts = {b["reason"]: int(b["count"]) for b in c.describe()["bad_records"]}
    assert counts == {"token_out_of_range": 3, "empty": 2, "missing_field": 1}
    log = proc.log()
    for where, reason in [
        (f"{paths['e']} document 3", "token_out_of_range"),
        (f"{paths['e']} document 64", "token_out_of_range"),
        (f"{paths['e']} document 10", "empty"),
        (f"{paths['e']} document 20", "empty"),
        (f"{paths['f']} row 7", "missing_field"),
        (f"{paths['f']} row 33", "token_out_of_range"),
    ]:
        assert f"{where}: {reason}" in log, where
    assert f"{paths['e']} document 3: token_out_of_range (id 1024 at position 2" in log
    # the rest is served, every good document once, no bad one ever
    check_epoch(proc, "skip", expected)


def test_strict_policy_refuses_an_out_of_range_id_with_its_location(bad_input):
    proc, paths, _ = bad_input
    with proc.client("strict") as c:
        info = c.describe()
    assert info["state"] == "JOB_STATE_FAILED"
    assert f"{paths['g']} document 41: token_out_of_range" in info["error"]
    assert "strict" in info["error"]


@pytest.mark.parametrize(
    ("job", "names"), [("corrupt-idx", ["h"]), ("corrupt-bin", ["k", "k.bin"])]
)
def test_a_corrupt_dataset_fails_the_job_naming_the_object(bad_input, job, names):
    proc, paths, _ = bad_input
    with proc.client(job) as c:
        info = c.describe()
    assert info["state"] == "JOB_STATE_FAILED"
    for name in names:
        assert str(paths[name]) in info["error"], info["error"]
    with proc.client("skip") as c:  # the server and its other jobs go on
        assert c.get_batch(0)["input_ids"].shape == (8, 64)


# -- tokenfeed's own token store is a Megatron dataset --------------------------------------


def test_a_tokenfeed_token_store_serves_as_a_megatron_source(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:150])
    cfg = write_config(tmp_path / "text.yaml", {"text": job_spec([corpus])}, tmp_path / "cache")
    text = ServerProcess(cfg, tmp_path / "text.log")
    assert text.wait_ready("text")["state"] == "JOB_STATE_READY", text.log()
    assert text.stop() == 0, text.log()

    # Read with the test's own reader, the stored chunks hold exactly the tokenizer's documents.
    store = (tmp_path / "cache" / "tokens").resolve()
    idxs = sorted(store.rglob("*.idx"))
    assert len(idxs) > 3
    stored = {
        str(i): dict(enumerate(d.tolist() for d in mmidx.read(i.with_suffix("")))) for i in idxs
    }
    tok = Tokenizer.from_file(str(TOKENIZER))
    want = [e.ids for e in tok.encode_batch(texts[:150], add_special_tokens=False)]
    assert sorted(d for per in stored.values() for d in per.values()) == sorted(want)

    cfg = write_config(
        tmp_path / "meg.yaml", {"meg": job_spec([store / "**" / "*.idx"])}, tmp_path / "cache2"
    )
    meg = ServerProcess(cfg, tmp_path / "meg.log")
    try:
        check_epoch(meg, "meg", stored)
    finally:
        assert meg.stop() == 0, meg.log()
