"""The tiktoken engine's first encode runs on a thread that has ended before its pool encodes.

tiktoken's threads that encode first in a process stay slower while they encode beside others
(fasttok.FastEngine._settle): the engine encodes its load-time sample on a thread of its own.
Real tokenizer (the test data's byte-level BPE), real documents; HF `tokenizers` is the oracle.
"""

from __future__ import annotations

import gc
import json
import os
import threading

import numpy as np
import pytest
from support import TOKENIZER
from tokenfeed.server.commands import democorpus
from tokenfeed.server.offline import buildpool
from tokenfeed.server.tokenizer import ENGINE_PROCESSES_ENV, bpeexact, fasttok
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


class Makes:
    """bpeexact's maker of Encodings, noting each one it makes and the thread that made it."""

    def __init__(self):
        self.make, _ = bpeexact.exact_encoder(json.loads(TOKENIZER.read_text()))
        self.made: list[tuple[object, threading.Thread]] = []

    def __call__(self):
        encoding = self.make()
        self.made.append((encoding, threading.current_thread()))
        return encoding


class Used(fasttok.FastEngine):
    """Notes the Encoding each pool thread encodes with. In its first call every pool thread
    starts draining (and takes its Encoding) before any encodes, so each takes part."""

    def __init__(self, makes: Makes, threads: int):
        self.used: dict[threading.Thread, set[int]] = {}
        self.gate: threading.Barrier | None = threading.Barrier(threads)
        _, lut = bpeexact.exact_encoder(json.loads(TOKENIZER.read_text()))
        super().__init__(makes.make(), lut, threads=threads, make=makes)

    def _drain(self, *args) -> None:
        if self.gate is not None:
            self.gate.wait(timeout=10)
        super()._drain(*args)

    def _own(self):
        found = super()._own()
        self.used.setdefault(threading.current_thread(), set()).add(id(found))
        return found


def test_each_pool_thread_encodes_with_an_encoding_of_its_own(docs, monkeypatch):
    monkeypatch.delenv(ENGINE_PROCESSES_ENV, raising=False)
    makes = Makes()
    engine = Used(makes, threads=2)
    for _ in range(2):  # a second call: the same Encodings, none made anew
        tokens, lengths = engine.encode(docs, np.dtype(np.int32))
        assert split(tokens, lengths) == hf_ids(docs)
        engine.gate = None
    assert len(makes.made) == 2  # one per pool thread, made on it
    made_on = {thread: id(encoding) for encoding, thread in makes.made}
    assert set(made_on) == set(engine.used)
    assert all(engine.used[t] == {made_on[t]} for t in made_on)  # each used its own only
    assert id(engine.encoding) not in made_on.values()
    assert all(t.name.startswith("tiktoken") for t in made_on)


def test_threads_past_the_budget_share_the_engines_encoding(docs, monkeypatch):
    # The budget holds one Encoding of this vocabulary: one thread makes its own, the other
    # encodes with the engine's (settled) one; the ids are HF's either way.
    monkeypatch.delenv(ENGINE_PROCESSES_ENV, raising=False)  # one process: all of it
    makes = Makes()
    engine = Used(makes, threads=2)
    each = fasttok.ENCODING_BYTES_PER_RANK * engine.encoding.n_vocab
    # Room for one more beside what other engines of this process hold.
    monkeypatch.setattr(fasttok, "OWN_ENCODINGS_BYTES", fasttok.held_bytes() + each)
    tokens, lengths = engine.encode(docs, np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(docs)
    assert len(makes.made) == 1
    assert sorted(len(u) for u in engine.used.values()) == [1, 1]
    assert {i for u in engine.used.values() for i in u} == {
        id(makes.made[0][0]),
        id(engine.encoding),
    }


def test_released_encodings_are_made_again_by_the_next_encode(docs, monkeypatch):
    # A server lets them go once its jobs are built; a later chunk (one rebuilt) makes them
    # again, and its ids are HF's all the same.
    monkeypatch.delenv(ENGINE_PROCESSES_ENV, raising=False)
    makes = Makes()
    engine = Used(makes, threads=2)
    before = fasttok.held_bytes()
    engine.encode(docs[:64], np.dtype(np.int32))
    first = {id(e) for e, _ in makes.made}
    assert len(first) == 2
    each = fasttok.ENCODING_BYTES_PER_RANK * engine.encoding.n_vocab
    assert fasttok.held_bytes() == before + 2 * each
    engine.release()
    assert fasttok.held_bytes() == before
    engine.gate = threading.Barrier(2)
    tokens, lengths = engine.encode(docs, np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(docs)
    assert len(makes.made) == 4  # two new ones, within the same budget
    latest = {i for u in engine.used.values() for i in u} - first
    assert latest == {id(e) for e, _ in makes.made[2:]}


def test_the_processes_of_a_build_share_the_budget(docs, monkeypatch):
    # The machine's budget is two processes' worth of room for one Encoding of this
    # vocabulary; a build of two processes (as `tokenfeed build` says in the environment it
    # starts its workers with) gives this one's threads one of them.
    makes = Makes()
    engine = Used(makes, threads=2)
    each = fasttok.ENCODING_BYTES_PER_RANK * engine.encoding.n_vocab
    room = fasttok.held_bytes() + each
    monkeypatch.setattr(fasttok, "OWN_ENCODINGS_BYTES", 2 * room)
    monkeypatch.setenv(ENGINE_PROCESSES_ENV, "2")
    assert fasttok.own_bytes() == room
    tokens, lengths = engine.encode(docs, np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(docs)
    assert len(makes.made) == 1


def test_a_build_says_how_many_of_its_processes_share_the_machine(monkeypatch):
    # For as long as the build runs: a process that builds and then serves (or a test run)
    # gets all of it again afterwards.
    monkeypatch.delenv(ENGINE_PROCESSES_ENV, raising=False)
    workers = buildpool.Workers.start(None, "job", 0)  # type: ignore[arg-type]  # none started
    assert os.environ[ENGINE_PROCESSES_ENV] == "1"
    assert fasttok.own_bytes() == fasttok.OWN_ENCODINGS_BYTES
    workers.shutdown()
    assert ENGINE_PROCESSES_ENV not in os.environ
    monkeypatch.setenv(ENGINE_PROCESSES_ENV, "3")
    workers = buildpool.Workers.start(None, "job", 0)  # type: ignore[arg-type]
    workers.shutdown()
    assert os.environ[ENGINE_PROCESSES_ENV] == "3"
    assert fasttok.own_bytes() == fasttok.OWN_ENCODINGS_BYTES // 3
    monkeypatch.setenv(ENGINE_PROCESSES_ENV, "not a number")
    assert fasttok.own_bytes() == fasttok.OWN_ENCODINGS_BYTES


def test_the_engines_of_a_process_share_its_budget(docs, monkeypatch):
    # A server has an engine per job: the second one's threads get what the first one left,
    # and all of it once the first one is gone.
    monkeypatch.delenv(ENGINE_PROCESSES_ENV, raising=False)
    first_makes, second_makes = Makes(), Makes()
    first = Used(first_makes, threads=2)
    each = fasttok.ENCODING_BYTES_PER_RANK * first.encoding.n_vocab
    monkeypatch.setattr(fasttok, "OWN_ENCODINGS_BYTES", fasttok.held_bytes() + 3 * each)
    first.encode(docs[:64], np.dtype(np.int32))
    assert len(first_makes.made) == 2
    second = Used(second_makes, threads=2)
    tokens, lengths = second.encode(docs, np.dtype(np.int32))
    assert split(tokens, lengths) == hf_ids(docs)
    assert len(second_makes.made) == 1  # the one left
    del first  # its Encodings go with it
    gc.collect()
    second.release()
    second.gate = threading.Barrier(2)
    second.encode(docs[:64], np.dtype(np.int32))
    assert len(second_makes.made) == 3  # both of its threads, now
