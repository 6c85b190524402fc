"""Through the real index build: a tokenizer.json that truncates and pads to 16 tokens (BERT
style) still stores every document whole, with no pad or template ids.

The oracle is a second load of the same file with truncation and padding turned off by hand.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from support import job_spec, write_jsonl
from tokenfeed.server.jobs.stack import build_jobs
from tokenfeed.server.settings import config as configmod
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

MAX_LEN = 16


def truncating_wordpiece(path: Path, texts: list[str]) -> Path:
    words = sorted({w.lower() for t in texts[:20] for w in t.split() if w.isalpha()})[:500]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]", *words])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.enable_truncation(max_length=MAX_LEN)
    tok.enable_padding(length=MAX_LEN, pad_token="[PAD]", pad_id=0)
    tok.save(str(path))
    return path


def test_the_index_counts_every_token_of_every_document(tmp_path, texts):
    docs = [*texts[:60], "the", "a b", "of the"]  # long prose and documents far under 16
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    tok_path = truncating_wordpiece(tmp_path / "tokenizer.json", texts)
    spec = job_spec([corpus], tokenizer=str(tok_path), chunk_bytes="8KiB")
    raw = {"server": {"cache_dir": str(tmp_path / "cache")}, "jobs": {"j": spec}}
    job = build_jobs(configmod.from_dict(raw))["j"]

    async def build():
        with ThreadPoolExecutor(2) as pool:
            await job.build_index(pool, 2)

    asyncio.run(build())
    (index,) = job.indexes
    assert index.error == "" and job.tokenizer.ignored_settings

    oracle = Tokenizer.from_file(str(tok_path))
    oracle.no_truncation()
    oracle.no_padding()
    want = [e.ids for e in oracle.encode_batch(docs, add_special_tokens=False)]
    assert int(index.num_docs.sum()) == len(docs)
    assert int(index.num_tokens.sum()) == sum(map(len, want))
    assert max(map(len, want)) > 10 * MAX_LEN and min(map(len, want)) == 1

    # The stored chunks, in source order, hold each document's tokens exactly.
    stored = [index.open_body(c)[1] for c in range(len(index.chunks))]
    assert len(stored) > 1
    assert np.concatenate([s.doc_lengths for s in stored]).tolist() == list(map(len, want))
    tokens = np.concatenate([s.tokens for s in stored])
    assert tokens.tolist() == [i for ids in want for i in ids]
    assert not np.isin(tokens, [0, 2, 3]).any()  # [PAD], [CLS], [SEP]
