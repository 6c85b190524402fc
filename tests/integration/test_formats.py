"""The layouts users already have, served where they lie (issue 24): MDS (plain and zstd, a text
column and an ndarray token column), save_to_disk Arrow streams (text and list<int>), a Hub
repository (Hub-named Parquet with a README configs: block) and WebDataset tars (.tar and
.tar.gz, a .txt member or a JSON member's field); each from local files and from the
S3-compatible test server.

Every input is made by the real writer (tests/formats.py). The oracle is independent of the
server: each document tokenized on its own with the `tokenizers` library (the ndarray and
list<int> columns hold those very ids). For each layout, over one epoch: each piece Explain
names (shard and sample or row) reads back from that document, the pieces of every document
cover all of its tokens, what no row holds is less than the epoch's last row (the documented
remainder), document tokens and one EOS each fill the rows exactly, and the slices of W = 2
and 8 ranks concatenate to the W = 1 batch.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import formats
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3env import s3_client
from support import TOKENIZER, ServerProcess, job_spec, write_config
from tokenizers import Tokenizer

SEQ_LEN, BATCH, DOCS = 64, 8, 90
EOS = 0


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, texts):
    """Every layout of the same documents under one root; (root, documents, their ids)."""
    root = tmp_path_factory.mktemp("layouts").resolve()
    docs = texts[:DOCS]
    tok = Tokenizer.from_file(str(TOKENIZER))
    ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    formats.write_mds(root / "mds", docs, ids=ids)
    formats.write_mds(root / "mdsz", docs, compression="zstd")
    formats.write_saved(root / "saved", docs, ids=ids)
    formats.write_hub(root / "hub", {"train": docs, "test": texts[DOCS : DOCS + 20]})
    (root / "wds").mkdir()
    formats.write_tar(root / "wds" / "shard-0.tar", docs[:50])
    formats.write_tar(root / "wds" / "shard-1.tar.gz", docs[50:], gz=True)
    (root / "wdsj").mkdir()
    formats.write_tar(root / "wdsj" / "part-0.tar", docs, member="json", extra=False)
    return root, docs, ids


def jobs_over(base: str) -> dict[str, dict]:
    """One job per layout under `base` (a directory or an s3:// prefix)."""
    sources = {
        "mds": [f"{base}/mds"],
        "mds-zstd": [f"{base}/mdsz/"],
        "mds-ids": [{"path": f"{base}/mds", "token_field": "ids"}],
        "arrow": [f"{base}/saved"],
        "arrow-ids": [{"path": f"{base}/saved", "format": "arrow", "token_field": "ids"}],
        "hub": [{"path": f"{base}/hub", "format": "hf"}],
        "wds": [f"{base}/wds/shard-*"],
        "wds-json": [{"path": f"{base}/wdsj/*.tar", "member": "json"}],
    }
    out = {}
    for name, src in sources.items():
        spec = job_spec([], seq_len=SEQ_LEN, global_batch_size=BATCH, chunk_bytes="2KiB")
        out[name] = spec | {"sources": src}
    return out


def record_index(root: Path) -> dict[tuple[str, str], int]:
    """(object name under the root, Explain's record) -> document, from the layouts' own
    metadata read here: index.json sample counts, the Arrow streams' rows, the Parquet files'
    rows, the tar keys."""
    where: dict[tuple[str, str], int] = {}
    for d in ("mds", "mdsz"):
        base = 0
        for s in json.loads((root / d / "index.json").read_text())["shards"]:
            name = (s["zip_data"] or s["raw_data"])["basename"]
            for k in range(s["samples"]):
                where[(f"{d}/{name}", f"sample {k}")] = base + k
            base += s["samples"]
    base = 0
    for f in json.loads((root / "saved" / "state.json").read_text())["_data_files"]:
        with pa.memory_map(str(root / "saved" / f["filename"])) as m:
            n = pa.ipc.open_stream(m).read_all().num_rows
        where.update({(f"saved/{f['filename']}", f"row {k}"): base + k for k in range(n)})
        base += n
    base = 0
    for path in sorted((root / "hub" / "data").glob("train-*.parquet")):
        n = pq.read_metadata(path).num_rows
        where.update({(f"hub/data/{path.name}", f"row {k}"): base + k for k in range(n)})
        base += n
    for k in range(DOCS):
        shard = "shard-0.tar" if k < 50 else "shard-1.tar.gz"
        j = k if k < 50 else k - 50
        key = f"shard-0/{j:06d}" if k < 50 else f"shard-1/{j:06d}"
        where[(f"wds/{shard}", f"sample {j} ({key})")] = k
        where[("wdsj/part-0.tar", f"sample {k} (part-0/{k:06d})")] = k
    return where


def check_epoch(proc: ServerProcess, job: str, base: str, where: dict, ids: list) -> None:
    """One epoch of `job`: every document served whole, read back from where Explain says."""
    with proc.client(job, timeout=60) as c:
        info = c.describe()
        assert info["state"] == "JOB_STATE_READY", (info["error"], proc.log())
        assert int(info["num_documents"]) == DOCS and info["bad_records"] == []
        assert int(info["num_tokens"]) == sum(map(len, ids))
        units = int(info["num_tokens"]) + DOCS
        total = -(-units // SEQ_LEN)
        steps = -(-total // BATCH)
        rows: list = []
        for step in range(steps):
            b, why = c.get_batch(step), c.explain(step)
            assert why["fingerprint"] == b.fingerprint
            rows += [(b["input_ids"][r["row"]], r["pieces"]) for r in why["rows"]]
            if step in (0, steps // 2, steps - 1):
                for world in (2, 8):
                    parts = [c.get_batch(step, r, world)["input_ids"] for r in range(world)]
                    assert np.array_equal(np.concatenate(parts), b["input_ids"])
    rows = rows[:total]
    covered = {d: np.zeros(len(ids[d]), dtype=np.int64) for d in range(DOCS)}
    served = eos = 0
    for row, pieces in rows:
        eos += int((row == EOS).sum())
        for p in pieces:
            assert p["source"].startswith(base + "/"), p
            doc = where[(p["source"][len(base) + 1 :], p["record"])]
            a, b = int(p["token_start"]), int(p["token_end"])
            assert row[int(p["row_start"]) : int(p["row_end"])].tolist() == ids[doc][a:b], p
            covered[doc][a:b] += 1
            served += b - a
    assert all((c >= 1).all() for c in covered.values()), "a document token was never served"
    assert 0 <= served - sum(map(len, ids)) <= total * SEQ_LEN - units
    assert served + eos == total * SEQ_LEN


def start(root: Path, jobs: dict, **kw) -> ServerProcess:
    proc = ServerProcess(write_config(root / "tf.yaml", jobs, root / "cache", **kw), root / "log")
    for job in jobs:
        assert proc.wait_ready(job, timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    return proc


@pytest.fixture(scope="module")
def local(layouts, tmp_path_factory):
    root = layouts[0]
    proc = start(tmp_path_factory.mktemp("local"), jobs_over(str(root)))
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def remote(layouts, moto_server, tmp_path_factory):
    root = layouts[0]
    client = s3_client(moto_server.endpoint)
    bucket = f"layouts-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = f"data/{path.relative_to(root)}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    client.put_object(Bucket=bucket, Key="tok/tokenizer.json", Body=TOKENIZER.read_bytes())
    jobs = jobs_over(f"s3://{bucket}/data")
    for spec in jobs.values():
        spec["tokenizer"] = f"s3://{bucket}/tok/tokenizer.json"
    store = {"endpoint_url": moto_server.endpoint, "addressing_style": "path"}
    store |= {"block_bytes": "4KiB", "max_attempts": 4}
    proc = start(tmp_path_factory.mktemp("remote"), jobs, object_store=store)
    yield proc, f"s3://{bucket}/data"
    assert proc.stop() == 0, proc.log()


JOBS = sorted(jobs_over("x"))


@pytest.mark.parametrize("job", JOBS)
def test_each_layout_serves_every_document_once_per_epoch(layouts, local, job):
    root, _, ids = layouts
    check_epoch(local, job, str(root), record_index(root), ids)


@pytest.mark.parametrize("job", JOBS)
def test_each_layout_on_object_storage_serves_the_same(layouts, local, remote, job):
    root, _, ids = layouts
    proc, base = remote
    check_epoch(proc, job, base, record_index(root), ids)
    with local.client(job) as here, proc.client(job, timeout=60) as there:
        for step in (0, 5):
            assert np.array_equal(
                here.get_batch(step)["input_ids"], there.get_batch(step)["input_ids"]
            )


def test_the_text_and_token_columns_of_one_layout_give_the_same_batches(local):
    # The ndarray and list<int> columns hold the independent tokenization of the text column.
    with local.client("mds") as text, local.client("mds-ids") as tokens:
        assert np.array_equal(text.get_batch(3)["input_ids"], tokens.get_batch(3)["input_ids"])
    with local.client("arrow") as text, local.client("arrow-ids") as tokens:
        assert np.array_equal(text.get_batch(3)["input_ids"], tokens.get_batch(3)["input_ids"])


def test_shard_indexes_are_kept_in_the_token_store(local, layouts):
    # The plain tar and the Arrow streams were walked once each and kept: one entry per shard.
    cache = Path(local.log_path).parent / "cache"
    kept = sorted(cache.glob("shards/*/*.six"))
    # wds/shard-0.tar, wdsj/part-0.tar, saved/data-0000{0,1}-of-00002.arrow
    assert len(kept) == 4


@pytest.fixture(scope="module")
def damaged(tmp_path_factory, texts):
    """A truncated MDS shard, a tar with a sample lacking its text and a member cut short, and
    a save_to_disk directory whose state.json names a file that is not there; jobs of each
    bad_records policy, and one of the unreadable layout."""
    root = tmp_path_factory.mktemp("damaged").resolve()
    docs = texts[:40]
    formats.write_mds(root / "mds", docs)
    shard = root / "mds" / "shard.00000.mds"
    shard.write_bytes(shard.read_bytes()[:-100])  # the last sample of shard 0 cut short
    members = [(f"t/{i:03d}.txt", d.encode()) for i, d in enumerate(docs[:10])]
    members[4] = ("t/004.cls", b"4")
    (root / "wds").mkdir()
    tar = root / "wds" / "t.tar"
    data = formats.tar_bytes(members)
    tar.write_bytes(data[: data.index(docs[9].encode()) + 20])
    formats.write_saved(root / "saved", docs)
    (root / "saved" / "data-00001-of-00002.arrow").unlink()
    sources = [str(root / "mds"), str(root / "wds" / "t.tar")]
    spec = job_spec([], seq_len=SEQ_LEN, global_batch_size=BATCH, chunk_bytes="2KiB")
    jobs = {
        "skip": spec | {"sources": sources},
        "strict": spec | {"sources": sources, "bad_records": "strict"},
        "unreadable": spec | {"sources": [str(root / "saved")]},
    }
    tmp = tmp_path_factory.mktemp("damaged-server")
    proc = ServerProcess(write_config(tmp / "tf.yaml", jobs, tmp / "cache"), tmp / "log")
    for job in jobs:
        proc.wait_ready(job, timeout=120)
    n0 = json.loads((root / "mds" / "index.json").read_text())["shards"][0]["samples"]
    yield proc, root, n0
    assert proc.stop() == 0, proc.log()


def test_damaged_layouts_are_skipped_counted_and_logged_with_their_location(damaged):
    proc, root, n0 = damaged
    with proc.client("skip") as c:
        info = c.describe()
        assert info["state"] == "JOB_STATE_READY", info["error"]
        counts = {b["reason"]: int(b["count"]) for b in info["bad_records"]}
        assert counts == {"truncated": 2, "missing_field": 1}
        assert int(info["num_documents"]) == 40 + 10 - 3
        assert c.get_batch(0)["input_ids"].shape == (BATCH, SEQ_LEN)
    log = proc.log()
    assert f"{root}/mds/shard.00000.mds sample {n0 - 1}: truncated" in log
    assert f"{root}/wds/t.tar sample 4: missing_field" in log
    assert f"{root}/wds/t.tar member t/009.txt: truncated" in log


def test_damaged_layouts_under_strict_fail_the_job_naming_the_first(damaged):
    proc, root, n0 = damaged
    with proc.client("strict") as c:
        info = c.describe()
    assert info["state"] == "JOB_STATE_FAILED"
    assert "strict" in info["error"]
    assert f"shard.00000.mds sample {n0 - 1}: truncated" in info["error"] or (
        f"{root}/wds/t.tar" in info["error"]
    )


def test_an_unreadable_layout_is_refused_with_its_path_and_what_was_expected(damaged):
    proc, root, _ = damaged
    with proc.client("unreadable") as c:
        info = c.describe()
    assert info["state"] == "JOB_STATE_FAILED"
    assert f"{root}/saved/state.json" in info["error"]
    assert "data-00001-of-00002.arrow is not there" in info["error"]
