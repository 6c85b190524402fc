"""Mixtures, schedules, best-fit packing and Explain against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support import TOKENIZER, ServerProcess, batch_bytes, job_spec, write_config, write_jsonl
from tokenfeed.client import Client
from tokenizers import Tokenizer


def _mixture(corpus_dir, texts, **overrides):
    web = write_jsonl(corpus_dir / "web.jsonl", texts[:250])
    books = write_jsonl(corpus_dir / "books.jsonl", texts[250:330])
    spec = job_spec([], seq_len=64, global_batch_size=8)
    del spec["sources"]
    spec["datasets"] = {
        "web": {"sources": [str(web)], "weight": 3},
        "books": {"sources": [str(books)], "weight": "1"},
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, texts):
    tmp = tmp_path_factory.mktemp("mix")
    jobs = {
        "mix": _mixture(
            tmp,
            texts,
            schedule=[
                {"start_step": 20, "weights": {"books": 3}},
                {"start_step": 40, "global_batch_size": 16},
            ],
        ),
        "mix-short": _mixture(tmp, texts, schedule=[{"start_step": 20, "weights": {"books": 3}}]),
        "fit": job_spec([tmp / "web.jsonl"], packing="best_fit", seq_len=64),
    }
    proc = ServerProcess(write_config(tmp / "tf.yaml", jobs, tmp / "cache"), tmp / "log.txt")
    for job in jobs:
        assert proc.wait_ready(job)["state"] == "JOB_STATE_READY", proc.log()
    yield proc
    assert proc.stop() == 0


def _datasets(c: Client, job: str, step: int, world: int = 1, rank: int = 0) -> list[str]:
    return [r["dataset"] for r in c.explain(step, rank, world, job=job)["rows"]]


def test_each_batch_holds_the_apportioned_rows_of_each_dataset(mixed):
    with Client(mixed.address) as c:
        info = c.describe("mix")
        assert [d["name"] for d in info["datasets"]] == ["web", "books"]
        assert [p["start_step"] for p in info["schedule"]] == [0, 20, 40]
        counts = [_datasets(c, "mix", s).count("web") for s in range(20)]
        # 3:1 of 8 rows: 6 web rows per batch, within one row over any prefix
        assert sum(counts) == 120 and all(5 <= n <= 7 for n in counts)
        after = [_datasets(c, "mix", s).count("web") for s in range(20, 40)]
        assert sum(after) == 80  # weights 3:3 from step 20
        assert len(_datasets(c, "mix", 40)) == 16  # batch-size ramp at step 40
        with pytest.raises(Exception, match="does not divide global_batch_size 16"):
            c.get_batch(40, rank=0, world_size=3, job="mix")


def test_a_later_phase_leaves_earlier_batches_byte_identical(mixed):
    with Client(mixed.address) as c:
        for step in (0, 19, 20, 39):
            a, b = c.get_batch(step, job="mix"), c.get_batch(step, job="mix-short")
            assert a.fingerprint == b.fingerprint, step
        assert (
            c.get_batch(40, job="mix").fingerprint != c.get_batch(40, job="mix-short").fingerprint
        )


@pytest.mark.parametrize("job", ["mix", "fit"])
def test_rank_slices_concatenate_for_every_packing(mixed, job):
    with Client(mixed.address, job=job) as c:
        whole = c.get_batch(3)
        parts = [c.get_batch(3, rank=r, world_size=4) for r in range(4)]
    for name in whole:
        assert np.array_equal(np.concatenate([p[name] for p in parts]), whole[name])


@pytest.mark.parametrize("job", ["mix", "fit"])
def test_explained_token_ranges_read_back_from_the_sources_equal_the_rows(mixed, job):
    tok = Tokenizer.from_file(str(TOKENIZER))
    files: dict[str, list[str]] = {}
    with Client(mixed.address, job=job) as c:
        for step in (0, 7, 41):
            batch, info = c.get_batch(step), c.explain(step)
            assert info["fingerprint"] == batch.fingerprint
            for row in info["rows"]:
                ids = batch["input_ids"][row["row"]]
                assert row["pieces"], row
                for p in row["pieces"]:
                    lines = files.setdefault(p["source"], open(p["source"]).read().splitlines())
                    kind, number = p["record"].split()
                    assert kind == "line"
                    text = json.loads(lines[int(number) - 1])["text"]
                    want = tok.encode(text, add_special_tokens=False).ids
                    got = ids[p["row_start"] : p["row_end"]].tolist()
                    assert got == want[p["token_start"] : p["token_end"]]


def test_best_fit_splits_only_documents_longer_than_a_row_and_masks_padding(mixed):
    tok = Tokenizer.from_file(str(TOKENIZER))
    split_seen = padded = 0
    with Client(mixed.address, job="fit") as c:
        for step in range(6):
            batch, info = c.get_batch(step), c.explain(step)
            for row in info["rows"]:
                for p in row["pieces"]:
                    line = open(p["source"]).read().splitlines()[int(p["record"].split()[1]) - 1]
                    n = len(tok.encode(json.loads(line)["text"], add_special_tokens=False).ids)
                    if p["token_start"] > 0 or p["token_end"] < n:  # a piece of a document
                        assert n + 1 > 64, "a document that fits in a row was split"
                        split_seen += 1
                mask = batch["loss_mask"][row["row"]]
                segments = batch["segment_ids"][row["row"]]
                # padding: no segment, no loss; everything else is learned from
                assert ((segments == 0) <= (mask == 0)).all()
                padded += int((segments == 0).sum())
    assert split_seen and padded, "the corpus exercises both splitting and padding"


def test_explain_command_prints_each_rows_sources(mixed):
    cmd = [
        sys.executable,
        "-m",
        "tokenfeed.server.commands.cli",
        "explain",
        "--target",
        mixed.address,
        "--job",
        "mix",
        "--step",
        "3",
        "--rank",
        "1",
        "--world-size",
        "2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("job mix step 3 rank 1/2 fingerprint ")
    rows = [line for line in lines if line.startswith("row ")]
    assert len(rows) == 4 and all("dataset web" in r or "dataset books" in r for r in rows)
    assert any("<- tokens [" in line and ".jsonl line " in line for line in lines)


@pytest.mark.parametrize("job", ["mix", "fit"])
def test_streams_planned_several_steps_at_once_equal_unary_across_phases(mixed, job):
    # A stream plans and assembles its next steps together (up to server.stream_ahead at
    # once); the groups break where the batch size changes (step 40 of `mix`).
    with Client(mixed.address) as c:
        streamed = [
            (b.step, b.epoch, batch_bytes(b)) for b in c.iter_batches(15, 161, 1, 2, job=job)
        ]
        unary = [
            (s, b.epoch, batch_bytes(b))
            for s, b in ((s, c.get_batch(s, 1, 2, job=job)) for s in range(15, 161))
        ]
    assert [s for s, _, _ in streamed] == list(range(15, 161))
    assert streamed == unary
    rows = {len(np.frombuffer(u["input_ids"], dtype=np.int32)) // 64 for _, _, u in unary}
    assert rows == ({4, 8} if job == "mix" else {4})  # 16 rows a step from step 40 on
