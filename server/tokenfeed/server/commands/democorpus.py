"""A small real-text corpus and a tokenizer, made offline in seconds from Python's own docs.

Documents are the language reference topics that ship with CPython (`pydoc_data.topics`) and the
docstrings of standard-library modules, classes and functions: real English technical prose,
present on every machine that has Python. The same Python version gives the same corpus.
The tokenizer is a byte-level BPE trained on that corpus.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# Modules that open windows, print, or take long to import.
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc"}


def documents(min_chars: int = 200) -> list[str]:
    """Deterministic list of documents (sorted, de-duplicated)."""
    from pydoc_data.topics import topics

    docs = {text.strip() for text in topics.values() if len(text.strip()) >= min_chars}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in _SKIP:
                continue
            try:
                module = importlib.import_module(name)
            except Exception:  # platform-specific modules are simply absent
                continue
            public = [obj for attr, obj in vars(module).items() if not attr.startswith("_")]
            objects = [module, *public]
            for cls in [o for o in objects if inspect.isclass(o)]:
                objects.extend(vars(cls).values())
            for obj in objects:
                # Only what the module defines, publicly: re-exports and private helpers depend
                # on what else was imported (typing_extensions patches typing's), which would
                # vary the corpus.
                if obj is not module and getattr(obj, "__module__", None) != name:
                    continue
                if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
                    doc = inspect.getdoc(obj)
                    if doc and len(doc) >= min_chars:
                        docs.add(doc.strip())
    return sorted(docs)


def train_tokenizer(docs: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def _jsonl(docs: list[str], start_id: int) -> bytes:
    lines = (json.dumps({"id": start_id + i, "text": d}) for i, d in enumerate(docs))
    return ("\n".join(lines) + "\n").encode()


def write_corpus(out: Path, docs: list[str]) -> list[Path]:
    """Split docs over the three source formats: plain JSONL, JSONL.zst + .gz, and Parquet."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(docs)
    parts = [
        docs[: n // 2],
        docs[n // 2 : 3 * n // 4],
        docs[3 * n // 4 : 7 * n // 8],
        docs[7 * n // 8 :],
    ]
    paths = [
        out / "docs-000.jsonl",
        out / "docs-001.jsonl.zst",
        out / "docs-002.jsonl.gz",
        out / "docs-003.parquet",
    ]
    offsets = [0, len(parts[0]), len(parts[0]) + len(parts[1]), n - len(parts[3])]
    paths[0].write_bytes(_jsonl(parts[0], offsets[0]))
    paths[1].write_bytes(zstandard.ZstdCompressor(level=3).compress(_jsonl(parts[1], offsets[1])))
    paths[2].write_bytes(gzip.compress(_jsonl(parts[2], offsets[2]), mtime=0))
    table = pa.table({"id": list(range(offsets[3], n)), "text": parts[3]})
    pq.write_table(table, paths[3], row_group_size=max(1, len(parts[3]) // 4))
    return paths


def prepare(out: Path) -> tuple[Path, Path, int]:
    """(corpus dir, tokenizer path, number of documents) under `out`, made once."""
    corpus, tok_path = out / "corpus", out / "tokenizer.json"
    marker = out / "corpus.done"
    if marker.exists() and tok_path.exists():
        return corpus, tok_path, int(marker.read_text())
    docs = documents()
    write_corpus(corpus, docs)
    train_tokenizer(docs).save(str(tok_path))
    marker.write_text(str(len(docs)))
    return corpus, tok_path, len(docs)
