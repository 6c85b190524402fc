"""The tiktoken engine's first encode runs on a thread that has ended before its pool encodes.

tiktoken's threads that encode first in a process stay slower while they encode beside others
(fasttok.FastEngine._settle): the engine encodes its load-time sample on a thread of its own.
Real tokenizer (the test data's byte-level BPE), real documents; HF `tokenizers` is the oracle.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from support import TOKENIZER
from tokenfeed.server.commands import democorpus
from tokenfeed.server.tokenizer import bpeexact, fasttok
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return democorpus.documents()[:96]


def hf_ids(texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(TOKENIZER))
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def split(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [a.tolist() for a in np.split(tokens, np.cumsum(lengths)[:-1])]


class Recorded(fasttok.FastEngine):
    """Notes the thread of each of its encodes."""

    def __init__(self, fail_first: bool = False):
        self.threads: list[threading.Thread] = []
        self.fail_first = fail_first
        super().__init__(*bpeexact.exact_encoding(json.loads(TOKENIZER.read_text())))

    def _encode_group(self, texts: list[str]) -> list[np.ndarray]:
        self.threads.append(threading.current_thread())
        if self.fail_first and len(self.threads) == 1:
            raise RuntimeError("the first encode fails")
        return super()._encode_group(texts)

    def _drain(self, *args) -> None:
        self.threads.append(threading.current_thread())
        super()._drain(*args)


def test_the_first_encode_is_on_a_thread_that_ended_before_any_pool_thread(docs):
    engine = Recorded()
    [settler] = engine.threads  # made and encoded at construction
    assert settler is not threading.current_thread()
    assert not settler.is_alive()
    tokens, lengths = engine.encode(docs, np.dtype(np.int32))
    pool = set(engine.threads[1:])
    assert pool and settler not in pool
    assert all(t.name.startswith("tiktoken") for t in pool)
    assert split(tokens, lengths) == hf_ids(docs)


def test_a_first_encode_that_fails_is_left_to_the_parity_check(docs):
    engine = Recorded(fail_first=True)
    assert len(engine.threads) == 1  # it failed quietly, on its own thread
    tokens, lengths = engine.encode(docs[:32], np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(docs[:32])
