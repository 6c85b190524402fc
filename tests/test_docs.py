"""The documentation's code runs: the numpy-only token store reader reads what the server wrote."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from support import TOKENIZER, job_spec, write_jsonl
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod
from tokenizers import Tokenizer

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _python_block(doc: str) -> str:
    return re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), re.S)[0]


def test_token_store_reader_from_the_docs(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:50])
    raw = {
        "server": {"cache_dir": str(tmp_path / "cache")},
        "jobs": {"j": job_spec([corpus], chunk_bytes="1MiB")},
    }
    job = build_jobs(configmod.from_dict(raw))["j"]

    async def build():
        with ThreadPoolExecutor(2) as pool:
            await job.build_index(pool, 2)

    asyncio.run(build())
    namespace: dict = {}
    exec(_python_block("token-store.md"), namespace)  # noqa: S102 - the documented snippet
    (manifest,) = (tmp_path / "cache" / "tokens").rglob("*.json")
    docs = list(namespace["read_chunk"](str(manifest.with_suffix(""))))
    expected = Tokenizer.from_file(str(TOKENIZER)).encode_batch(
        texts[:50], add_special_tokens=False
    )
    assert len(docs) == 50
    for got, want in zip(docs, expected, strict=True):
        assert np.array_equal(got, want.ids)


def test_every_config_in_bring_your_data_loads():
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "bring-your-data.md").read_text(), re.S)
    assert len(blocks) == 5
    for block in blocks:
        cfg = configmod.from_dict(yaml.safe_load(block))
        assert cfg.jobs and all(j.datasets[0].sources for j in cfg.jobs)
