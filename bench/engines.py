"""The engines bench/tokenization.py measures tokenfeed against, each timed alone over the same
texts in this process: bare `tokenizers`, bare tiktoken (the Encoding fasttok derives: one per
thread, or one shared, settled or as tiktoken leaves it) and fasttok's own engine. Each returns
its seconds."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tokenfeed.server.tokenizer.tokenize import ENCODE_BATCH_DOCS
from tokenizers import Tokenizer


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def bare_hf(tokenizer: Path, texts: list[str]) -> float:
    tok = Tokenizer.from_file(str(tokenizer))  # a cold word cache, like a build's
    start = time.perf_counter()
    for i in range(0, len(texts), ENCODE_BATCH_DOCS):
        tok.encode_batch_fast(texts[i : i + ENCODE_BATCH_DOCS], add_special_tokens=False)
    return time.perf_counter() - start


def fast_engine(tokenizer: Path):
    """(fasttok's engine for the tokenizer, None) or (None, why there is none)."""
    try:
        from tokenfeed.server.tokenizer import fasttok
    except ImportError:
        return None, "no fasttok.py"
    tok = Tokenizer.from_file(str(tokenizer))
    try:
        return fasttok.FastEngine.from_config(json.loads(tok.to_str())), ""
    except ImportError as e:
        return None, f"tiktoken is not installed ({e})"
    except fasttok.NotExact as e:
        return None, f"tiktoken is not exact for the tokenizer: {e}"


def bare_tiktoken(tokenizer: Path, texts: list[str], how: str = "own") -> float:
    """tiktoken alone: the Encoding fasttok derives (made before the clock starts), its own
    encode_to_numpy on a thread per core (it releases the GIL), no tokenfeed code while timed.
    `how`:
    - "own": each thread an Encoding of its own of the same ranks (each made before the
      clock, and used by that thread alone): the engine at its best, the reference;
    - "settled": one Encoding for every thread, as FastEngine leaves its own (its regex
      caches' owner a thread that has ended: fasttok.FastEngine._settle);
    - "cold": one Encoding as tiktoken leaves it, so one of the timed threads is the first to
      encode and owns its regex caches (what a plain user of tiktoken's threads gets)."""
    from tokenfeed.server.tokenizer import bpeexact

    n = cores()
    if how == "settled":
        engine, _ = fast_engine(tokenizer)
        encodings = [engine.encoding] * n
    else:
        make, _ = bpeexact.exact_encoder(json.loads(Tokenizer.from_file(str(tokenizer)).to_str()))
        encodings = [make() for _ in range(n)] if how == "own" else [make()] * n
    groups = [texts[i::n] for i in range(n)]

    def encode(i: int) -> int:
        enc = encodings[i].encode_to_numpy
        return sum(enc(t, disallowed_special=()).size for t in groups[i])

    with ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        list(pool.map(encode, range(n)))
        return time.perf_counter() - start


def fasttok_engine(tokenizer: Path, texts: list[str]) -> float:
    engine, _ = fast_engine(tokenizer)
    start = time.perf_counter()
    engine.encode(texts, np.dtype(np.uint16))
    return time.perf_counter() - start
