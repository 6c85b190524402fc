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


def _python_block_under(doc: str, heading: str) -> str:
    text = (DOCS / doc).read_text()
    section = re.split(r"\n##+ ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def test_trainer_snippets_run_against_a_server(server, tmp_path):
    """docs/client.md's snippet of each trainer, as written, against a real server."""
    import lightning.pytorch as pl
    import torch
    from tokenfeed.client import Client

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Embedding(1024, 8), torch.nn.Linear(8, 1024))

        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input_ids"])
            return torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten()
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(heading: str) -> dict:
        namespace = {
            "TARGET": server.address,
            "JOB": "main",
            "VOCAB": 1024,
            "OUTPUT_DIR": str(tmp_path / heading.strip("# ")),
            "MODEL": torch.nn.Sequential(torch.nn.Embedding(1024, 8), torch.nn.Linear(8, 1024)),
            "LIGHTNING_MODULE": Module(),
        }
        exec(_python_block_under("client.md", heading), namespace)  # noqa: S102 - the docs
        return namespace

    titan = run("### torchtitan")
    assert (titan["resumed"].feed.next_step, titan["resumed"].feed.rank) == (2, 1)
    assert titan["labels"].dtype == torch.int64
    megatron = run("### Megatron")
    assert megatron["micro"]["tokens"].shape == (2, 64)
    assert megatron["micro"]["attention_mask"] is None
    assert run("### Hugging Face")["trainer"].state.global_step == 2
    assert run("### Lightning")["trainer"].global_step == 2
    olmo = run("### OLMo-core")
    assert olmo["batch"]["input_ids"].shape == (8, 64) and olmo["saved"]["next_step"] == 1
    with Client(server.address, job="main") as feed:
        step0 = feed.get_batch(0, 0, 1)
    assert np.array_equal(olmo["batch"]["input_ids"].numpy(), step0["input_ids"])
    assert np.array_equal(olmo["batch"]["labels"].numpy(), step0["labels"])
    assert (olmo["resumed"].feed.next_step, olmo["resumed"].rank_batch_size) == (1, 4 * 64)
    grain = run("### Grain")
    assert grain["local"]["input_ids"].shape == (8, 64) and grain["data"].feed.next_step == 1
