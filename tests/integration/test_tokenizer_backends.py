"""tokenizer.backend changes nothing but speed: the same job's token store, built by `tokenfeed
build` with hf and with tiktoken, and by a server's own build with auto, is the same bytes, and
the job's fingerprint is the same.

The corpus has many more documents than each process compares with HF before it trusts tiktoken
(tokenize.PARITY_DOCS), so most of the tiktoken stores' ids are tiktoken's own, and bad lines of
every kind throughout: with tiktoken a chunk's lines are parsed by the engine's threads once the
check has passed (source/jsonl.JsonLines), and the chunks' records, ids and located bad records
(in the manifests) must be those HF's path, which parses them first, stores.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support import TOKENIZER, job_spec, write_config
from tokenfeed.server.commands import democorpus
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod
from tokenfeed.server.tokenizer.tokenize import PARITY_DOCS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real prose, and documents with what prose lacks (other scripts, emoji, runs of spaces,
    tabs and digits, the end-of-text token written in the text), over two files."""
    docs = democorpus.documents()
    rng = random.Random(5)
    words = ["日本語", "😀👍🏽", "e\u0301", "  ", "\t\t", "\n\n", "1234567", "<|endoftext|>"]
    words += ["it's", "naïve", "Ωμέγα", "مرحبا", "{}", "==", "x"]
    docs += ["".join(rng.choices(words, k=rng.randint(1, 300))) for _ in range(400)]
    # Two build processes compare 2 * PARITY_DOCS documents; the rest are tiktoken's alone.
    assert len(docs) > 3 * PARITY_DOCS
    root = tmp_path_factory.mktemp("backends")
    bad = [b'{"text": "caf\xe9"}', b'{"text": "cut', b"[1, 2]", b'{"body": "x"}', b'{"text": 7}']
    bad += [b'{"text": ""}', b"", b"  "]
    for name, part in (("a.jsonl", docs[::2]), ("b.jsonl", docs[1::2])):
        lines = [json.dumps({"text": t}).encode() for t in part]
        for k in range(len(lines) // 41, 0, -1):  # a bad line every 41 documents, each kind
            lines.insert(41 * k, bad[k % len(bad)])
        (root / name).write_bytes(b"\n".join(lines) + b"\n")
    return root


def config(tmp: Path, corpus: Path, backend: str) -> Path:
    tokenizer = {"path": str(TOKENIZER), "backend": backend}
    spec = job_spec([corpus / "*"], tokenizer=tokenizer, chunk_bytes="24KiB")
    return write_config(tmp / f"{backend}.yaml", {"main": spec}, tmp / f"cache-{backend}")


def cli_build(cfg: Path) -> str:
    cmd = [sys.executable, "-m", "tokenfeed.server.commands.cli", "build", "--config", str(cfg)]
    done = subprocess.run(
        [*cmd, "--workers", "2"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def store_files(cache: Path) -> dict[str, bytes]:
    root = cache / "tokens"
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def built_job(cfg: Path):
    """The job in this process over its cache directory, its index built (tokenizing whatever
    is not in the store yet)."""
    job = build_jobs(configmod.from_dict(yaml.safe_load(cfg.read_text())))["main"]
    with ThreadPoolExecutor(2) as pool:
        asyncio.run(job.build_index(pool, 2, retry=False))
    assert job.state == "ready", job.error
    return job


def test_the_store_and_the_fingerprint_do_not_depend_on_the_engine(tmp_path, corpus):
    hf, fast, auto = (config(tmp_path, corpus, b) for b in ("hf", "tiktoken", "auto"))
    for cfg in (hf, fast):
        out = cli_build(cfg)
        assert "differs from HF" not in out, out
    expected = store_files(tmp_path / "cache-hf")
    assert sum(name.endswith(".bin") for name in expected) > 5
    manifests = [json.loads(v) for k, v in expected.items() if k.endswith(".json")]
    reasons = {r for m in manifests for r in m.get("bad_records", {})}
    assert reasons == {"invalid_utf8", "malformed_json", "not_an_object", "missing_field"} | {
        "not_text",
        "empty",
    }, reasons
    assert store_files(tmp_path / "cache-tiktoken") == expected

    # A server's own build (its tokenize threads, in-process) with auto, from an empty cache.
    jobs = {b: built_job(cfg) for b, cfg in (("auto", auto), ("hf", hf), ("tiktoken", fast))}
    assert store_files(tmp_path / "cache-auto") == expected
    assert {b: j.tokenizer.engine for b, j in jobs.items()} == {
        "auto": "tiktoken",
        "hf": "hf",
        "tiktoken": "tiktoken",
    }
    assert len({j.fingerprint for j in jobs.values()}) == 1 and jobs["hf"].fingerprint
