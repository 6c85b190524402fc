"""Many small source objects through a real server: grouped into a few chunks, served, and every
row piece explained back to its own object and line.

The corpus is 200 small .jsonl.gz files (two documents each, and a malformed line in some, so
record ids and line numbers differ from document numbers). The oracle reads the line Explain
names, tokenizes its text on its own with the HF tokenizer and compares the tokens with the ids
served at the piece's place in the row. The same corpus from the S3-compatible test server plans
the same chunks and serves the same bytes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from s3env import s3_client
from support import TOKENIZER, ServerProcess, batch_bytes, job_spec, write_config
from tokenfeed.server.objstore.localfiles import LocalBackend
from tokenfeed.server.settings.config import SourceSpec
from tokenfeed.server.source.chunks import plan_chunks
from tokenizers import Tokenizer

FILES, PER_FILE = 200, 2
SEQ_LEN, BATCH, STEPS = 64, 8, 12
CHUNK_BYTES = 64 * 2**10


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, texts) -> Path:
    root = tmp_path_factory.mktemp("small")
    for i in range(FILES):
        lines = [json.dumps({"text": t}) for t in texts[PER_FILE * i : PER_FILE * (i + 1)]]
        if i % 7 == 3:
            lines.insert(1, '{"text": "unterminated')
        (root / f"part-{i:05d}.jsonl.gz").write_bytes(
            gzip.compress("".join(line + "\n" for line in lines).encode())
        )
    return root


def _serve(tmp: Path, sources: list[str], **config) -> ServerProcess:
    spec = job_spec(
        sources,
        seq_len=SEQ_LEN,
        global_batch_size=BATCH,
        chunk_bytes=f"{CHUNK_BYTES // 1024}KiB",
        **config.pop("job", {}),
    )
    tmp.mkdir(exist_ok=True)
    cfg = write_config(tmp / "tf.yaml", {"main": spec}, tmp / "cache", **config)
    proc = ServerProcess(cfg, tmp / "server.log")
    assert proc.wait_ready("main", timeout=120)["state"] == "JOB_STATE_READY", proc.log()
    return proc


def _line(uri: str, where: str) -> str:
    number = int(where.removeprefix("line "))
    lines = gzip.decompress(Path(uri).read_bytes()).decode().splitlines()
    return json.loads(lines[number - 1])["text"]


def test_small_objects_are_served_from_a_few_chunks_and_explained_to_their_lines(
    tmp_path, small_corpus
):
    objs = LocalBackend().list(str(small_corpus / "*.jsonl.gz"))
    planned = plan_chunks([(o, SourceSpec(str(small_corpus / "*"))) for o in objs], CHUNK_BYTES)
    total = sum(o.size for o in objs)
    assert len(objs) == FILES and len(planned) <= -(-total // (CHUNK_BYTES // 2))
    tok = Tokenizer.from_file(str(TOKENIZER))
    proc = _serve(tmp_path, [str(small_corpus / "*.jsonl.gz")])
    try:
        with proc.client("main") as c:
            info = c.describe()
            assert int(info["num_chunks"]) == len(planned) < FILES // 10
            assert int(info["num_documents"]) == FILES * PER_FILE
            bad = {b["reason"]: int(b["count"]) for b in info["bad_records"]}
            assert bad == {"malformed_json": len(range(3, FILES, 7))}
            seen_objects, pieces = set(), 0
            for step in range(STEPS):
                ids = c.get_batch(step)["input_ids"]
                for row in c.explain(step)["rows"]:
                    for p in row["pieces"]:
                        ts, te, rs, re = (
                            int(p[k]) for k in ("token_start", "token_end", "row_start", "row_end")
                        )
                        text = _line(p["source"], p["record"])
                        own = tok.encode(text, add_special_tokens=False).ids
                        assert ids[int(row["row"]), rs:re].tolist() == own[ts:te], p
                        seen_objects.add(p["source"])
                        pieces += 1
            # the rows read many objects of each group, not only a group's first
            assert pieces > STEPS * BATCH and len(seen_objects) > 2 * len(planned)
    finally:
        assert proc.stop() == 0, proc.log()


def test_small_objects_from_s3_are_the_same_chunks_and_bytes(
    tmp_path, small_corpus, moto_server, s3_bucket
):
    client = s3_client(moto_server.endpoint)
    for path in sorted(small_corpus.iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"small/{path.name}", Body=path.read_bytes())
    local = _serve(tmp_path / "local", [str(small_corpus / "*.jsonl.gz")])
    try:
        with local.client("main") as c:
            want = {s: batch_bytes(c.get_batch(s)) for s in range(STEPS)}
            chunks = int(c.describe()["num_chunks"])
    finally:
        assert local.stop() == 0, local.log()
    object_store = {
        "endpoint_url": moto_server.endpoint,
        "addressing_style": "path",
        "block_bytes": "4KiB",
    }
    remote = _serve(
        tmp_path / "s3", [f"s3://{s3_bucket}/small/*.jsonl.gz"], object_store=object_store
    )
    try:
        with remote.client("main") as c:
            assert int(c.describe()["num_chunks"]) == chunks
            got = {s: batch_bytes(c.get_batch(s)) for s in range(STEPS)}
            assert got == want
            explained = c.explain(0)["rows"][0]["pieces"][0]
            assert explained["source"].startswith(f"s3://{s3_bucket}/small/part-")
    finally:
        assert remote.stop() == 0, remote.log()
