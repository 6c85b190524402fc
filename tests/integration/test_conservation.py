"""Every token of every document, exactly once per epoch, over two epochs, through a server.

Corpora laid out as real ones often are: (a) many small compressed JSON Lines files, (b) one
plain file cut into tiny chunks, (c) Parquet with many small row groups, (d) a mixture of two
datasets. The oracle is independent of the server: each document is tokenized on its own with
the HF tokenizer. Concat rows are stretches of one endless stream, epoch after epoch (U tokens
each: documents plus one EOS each), so the rows of a dataset that start before 2*U are
R = ceil(2U / L) rows whose inputs are stream[0 : R*L]: every document twice, plus the
R*L - 2U first tokens of epoch 2. Explain says where each piece of each row comes from; the
served ids of that piece must equal the document's own tokens there.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import TOKENIZER, ServerProcess, job_spec, write_config, write_jsonl
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenizers import Tokenizer

SEQ_LEN, BATCH = 128, 8
EPOCHS = 2


def _tokenize(texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(TOKENIZER))
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _many_gz(root: Path, texts: list[str]) -> dict[tuple[str, str], str]:
    """(a): three documents per .jsonl.gz file."""
    where = {}
    for i in range(0, len(texts), 3):
        path = root / f"small-{i // 3:04d}.jsonl.gz"
        part = texts[i : i + 3]
        path.write_bytes(
            gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in part).encode())
        )
        where.update({(path.name, f"line {k + 1}"): t for k, t in enumerate(part)})
    return where


def _one_plain(root: Path, texts: list[str]) -> dict[tuple[str, str], str]:
    """(b): one plain file (cut into tiny chunks by chunk_bytes)."""
    path = write_jsonl(root / "one.jsonl", texts)
    return {(path.name, f"line {k + 1}"): t for k, t in enumerate(texts)}


def _small_groups(root: Path, texts: list[str]) -> dict[tuple[str, str], str]:
    """(c): a Parquet file with row groups of 4 rows."""
    path = root / "groups.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    return {(path.name, f"row {k}"): t for k, t in enumerate(texts)}


LAYOUTS = {
    "many_small_gz": (_many_gz, {}),
    "tiny_chunks": (_one_plain, {"chunk_bytes": "1KiB"}),
    "small_row_groups": (_small_groups, {"chunk_bytes": "4KiB"}),
}


def _serve(tmp: Path, jobs: dict) -> ServerProcess:
    cfg = write_config(tmp / "tf.yaml", jobs, tmp / "cache")
    proc = ServerProcess(cfg, tmp / "server.log")
    for name in jobs:
        assert proc.wait_ready(name, timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    return proc


def _rows_needed(info: dict) -> int:
    units = int(info["num_tokens"]) + int(info["num_documents"])  # one EOS per document
    return -(-EPOCHS * units // SEQ_LEN), units


def _check_pieces(rows, explained, where, tokens_of, dataset=None):
    """Coverage count of every document token by the rows' pieces; each piece's served ids
    equal the document's own tokens."""
    coverage: dict[str, np.ndarray] = {}
    for ids, row in zip(rows, explained, strict=True):
        if dataset is not None:
            assert row["dataset"] == dataset
        for p in row["pieces"]:
            key = (Path(p["source"]).name, p["record"])
            text = where[key]
            doc = tokens_of[text]
            ts, te, rs, re = (
                int(p[k]) for k in ("token_start", "token_end", "row_start", "row_end")
            )
            assert ids[rs:re].tolist() == doc[ts:te], f"row piece {p} differs from the document"
            cov = coverage.setdefault(text, np.zeros(len(doc), dtype=np.int64))
            cov[ts:te] += 1
    return coverage


def _assert_each_token_twice(coverage, where, tokens_of, extra: int) -> None:
    texts = set(where.values())
    assert set(coverage) == texts, f"{len(texts - set(coverage))} documents never served"
    total_extra = 0
    for text in texts:
        cov = coverage[text]
        assert (cov >= EPOCHS).all(), "a document token was served fewer times than epochs"
        assert (cov <= EPOCHS + 1).all()
        total_extra += int((cov - EPOCHS).sum())
    # The excess is epoch 2's first tokens (its EOS tokens are not document tokens).
    assert total_extra <= extra


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_epochs_serve_every_token_once_per_epoch(tmp_path, texts, layout):
    make, overrides = LAYOUTS[layout]
    root = tmp_path / "corpus"
    root.mkdir()
    docs = texts[:150]
    where = make(root, docs)
    tokens_of = dict(zip(docs, _tokenize(docs), strict=True))
    spec = job_spec([root / "*"], seq_len=SEQ_LEN, global_batch_size=BATCH, **overrides)
    proc = _serve(tmp_path, {"main": spec})
    try:
        with proc.client("main") as c:
            info = c.describe()
            assert int(info["num_documents"]) == len(docs)
            assert int(info["num_tokens"]) == sum(map(len, tokens_of.values()))
            rows, units = _rows_needed(info)
            steps = -(-rows // BATCH)
            batches = list(c.iter_batches(0, steps))
            ids = np.concatenate([b["input_ids"] for b in batches])[:rows]
            explained = [r for s in range(steps) for r in c.explain(s)["rows"]][:rows]
            # Slicing by any world size concatenates to the same global batch.
            for step in (0, steps // 2, steps - 1):
                for world in (2, 8):
                    parts = [c.get_batch(step, r, world)["input_ids"] for r in range(world)]
                    assert np.array_equal(np.concatenate(parts), batches[step]["input_ids"])
        # Every input position of every row is a document token or an EOS: nothing else.
        eos = Tokenizer.from_file(str(TOKENIZER)).token_to_id("<|endoftext|>")
        covered = sum(
            int(p["row_end"]) - int(p["row_start"]) for r in explained for p in r["pieces"]
        )
        assert covered + int((ids == eos).sum()) == rows * SEQ_LEN
        coverage = _check_pieces(ids, explained, where, tokens_of)
        _assert_each_token_twice(coverage, where, tokens_of, rows * SEQ_LEN - EPOCHS * units)
        assert int((ids == eos).sum()) >= EPOCHS * len(docs)
    finally:
        assert proc.stop() == 0, proc.log()


def test_mixture_serves_every_token_of_each_dataset_once_per_epoch(tmp_path, texts):
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    root_a.mkdir()
    root_b.mkdir()
    docs_a, docs_b = texts[:60], texts[60:100]
    where = {**_many_gz(root_a, docs_a), **_small_groups(root_b, docs_b)}
    tokens_of = dict(zip(docs_a + docs_b, _tokenize(docs_a + docs_b), strict=True))
    spec = job_spec([], seq_len=SEQ_LEN, global_batch_size=BATCH)
    del spec["sources"]
    spec["datasets"] = {
        "web": {"sources": [str(root_a / "*")], "weight": 3},
        "books": {"sources": [str(root_b / "*")], "weight": 1, "chunk_bytes": "4KiB"},
    }
    proc = _serve(tmp_path, {"mix": spec})
    try:
        with proc.client("mix") as c:
            info = c.describe()
            need = {d["name"]: _rows_needed(d) for d in info["datasets"]}
            schedule = Schedule([Phase(0, BATCH, (3, 1))], int(info["seed"]))
            picked: dict[str, list] = defaultdict(list)  # dataset -> [(dataset row, ids, expl)]
            step = 0
            while any(len(picked[n]) < need[n][0] for n in need):
                batch, expl = c.get_batch(step), c.explain(step)["rows"]
                datasets, rows = schedule.rows(step, 0, BATCH)
                for pos in range(BATCH):
                    name = ("web", "books")[int(datasets[pos])]
                    assert expl[pos]["dataset"] == name
                    if rows[pos] < need[name][0]:
                        picked[name].append((int(rows[pos]), batch["input_ids"][pos], expl[pos]))
                step += 1
        for name, docs in (("web", docs_a), ("books", docs_b)):
            got = sorted(picked[name], key=lambda t: t[0])
            assert [r for r, _, _ in got] == list(range(need[name][0]))
            mine = {k: v for k, v in where.items() if v in set(docs)}
            coverage = _check_pieces(
                [g[1] for g in got], [g[2] for g in got], mine, tokens_of, dataset=name
            )
            rows, units = need[name]
            _assert_each_token_twice(coverage, mine, tokens_of, rows * SEQ_LEN - EPOCHS * units)
    finally:
        assert proc.stop() == 0, proc.log()
