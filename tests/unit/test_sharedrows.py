"""Row buffers shared by a node's serving processes through an arena in shared memory
(pack/sharedrows.py): laid out once whoever asks, the same bytes read back in place; a damaged
or stale buffer is laid out again; no segment is written anew while an array of it lives; a
dead writer's lock is free at once, a too slow one not waited for; the arena is a ring that
renews its oldest segments and forgets their entries."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
from tokenfeed.server.pack import arenaformat, arenawrite, sharedrows
from tokenfeed.server.pack.rowlayout import RowBuffer
from tokenfeed.server.pack.sharedrows import SharedRows

I32 = np.dtype(np.int32)


def buffer(n: int, seed: int = 0) -> RowBuffer:
    rng = np.random.default_rng(seed)
    return RowBuffer(
        rng.integers(0, 50_000, n).astype(np.int32), np.sort(rng.choice(n, n // 7, replace=False))
    )


def equal(a: RowBuffer, b: RowBuffer) -> bool:
    return np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)


def test_one_process_lays_out_the_others_map_the_same_bytes(tmp_path):
    want = buffer(10_000)
    calls = []

    def make(place=None) -> RowBuffer:
        calls.append(1)
        return want

    first, second = SharedRows(tmp_path, 1 << 30), SharedRows(tmp_path, 1 << 30)  # two processes
    a = first.get_or_make("fp/0-0-1-7", make, I32)
    b = second.get_or_make("fp/0-0-1-7", make, I32)
    assert len(calls) == 1 and equal(a, want) and equal(b, want)
    assert (first.made, second.made, second.mapped) == (1, 0, 1)
    assert b.ids.dtype == I32 and not b.ids.flags.writeable  # a read-only mapping
    # Another name is another buffer.
    other = second.get_or_make("fp/0-0-2-7", lambda place=None: buffer(99, 1), I32)
    assert equal(other, buffer(99, 1)) and second.made == 1


def _entry(root, name: str) -> tuple[int, ...]:
    return arenaformat.ENTRY.unpack((root / name).read_bytes())  # magic, seg, gen, offset, ...


def test_a_damaged_buffer_is_laid_out_again(tmp_path):
    rows = SharedRows(tmp_path, 1 << 30)
    rows.get_or_make("x/b", lambda place=None: buffer(5000), I32)
    offset = _entry(tmp_path, "x/b")[3]
    with open(tmp_path / "arena", "r+b") as f:  # one flipped byte of the payload
        f.seek(offset + arenaformat.SLOT_HEADER + 4 * 1234)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    calls = []

    def make(place=None) -> RowBuffer:
        calls.append(1)
        return buffer(5000)

    got = SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32)
    assert calls == [1] and equal(got, buffer(5000))
    again = SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32)  # rewritten, good
    assert calls == [1] and equal(again, buffer(5000))
    (tmp_path / "x" / "b").write_bytes(b"short")  # a damaged entry
    assert equal(SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32), buffer(5000))
    assert calls == [1, 1]
    # An entry that points at another buffer's slot (another name) is no entry at all.
    rows.get_or_make("x/c", lambda place=None: buffer(5000, 3), I32)
    (tmp_path / "x" / "b").write_bytes((tmp_path / "x" / "c").read_bytes())
    assert equal(SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32), buffer(5000))
    assert calls == [1, 1, 1]


def test_a_buffer_is_hashed_by_the_nodes_first_reader_only(tmp_path, monkeypatch):
    # Every worker takes every buffer its ranks read: one check a node, not one a worker.
    writer = SharedRows(tmp_path, 1 << 30)
    writer.get_or_make("x/b", lambda place=None: buffer(5000), I32)
    hashed, real = [], sharedrows.slot_digest
    counted = lambda i, s: hashed.append(1) or real(i, s)  # noqa: E731
    monkeypatch.setattr(sharedrows, "slot_digest", counted)  # a reader's check
    monkeypatch.setattr(arenawrite, "slot_digest", counted)  # a writer's digest

    def never(place=None) -> RowBuffer:
        raise AssertionError("laid out again")

    readers = [SharedRows(tmp_path, 1 << 30) for _ in range(3)]
    assert all(equal(r.get_or_make("x/b", never, I32), buffer(5000)) for r in readers)
    assert hashed == [1]
    # The mark is the slot's stamp: the same name written again (a new slot) is checked again.
    os.unlink(tmp_path / "x" / "b")
    hashed.clear()
    writer.get_or_make("x/b", lambda place=None: buffer(5000), I32)
    assert hashed == [1]  # the writer's digest of what it writes
    assert all(equal(r.get_or_make("x/b", never, I32), buffer(5000)) for r in readers)
    assert hashed == [1, 1]


# 8 segments of 11 pages: two buffers of 4000 int32 ids (and 571 starts) each.
SLOT_BYTES = 20_736
SMALL = arenaformat.DATA_START + arenaformat.SEGMENTS * 11 * 4096


def _fill(rows: SharedRows, names, seed: int = 0) -> None:
    for i, name in enumerate(names):
        rows.get_or_make(name, lambda place=None, i=i: buffer(4000, seed + i), I32)


def test_a_segment_is_never_written_anew_while_an_array_of_it_lives(tmp_path):
    writer, reader = SharedRows(tmp_path, SMALL), SharedRows(tmp_path, SMALL)  # two processes
    assert writer.segment_bytes == 11 * 4096 and 2 * SLOT_BYTES <= writer.segment_bytes
    _fill(writer, ["fp/0", "fp/1"])  # segment 0
    held = reader.get_or_make("fp/0", lambda place=None: None, I32)
    tail = held.ids[3990:]  # a view cut from it outlives the buffer
    del held
    gc.collect()
    assert reader._pins.held() == {0: 1}
    # Seven more segments fill; the eighth would be segment 0 again, which the reader holds.
    _fill(writer, [f"fp/{i}" for i in range(2, 16)], seed=2)
    assert writer.made == 16 and _entry(tmp_path, "fp/15")[1] == 7
    got = writer.get_or_make("fp/16", lambda place=None: buffer(4000, 16), I32)
    assert equal(got, buffer(4000, 16)) and _entry(tmp_path, "fp/16")[1] == 1  # 0 skipped
    assert np.array_equal(tail, buffer(4000, 0).ids[3990:])  # still the bytes it was
    del tail
    gc.collect()
    assert reader._pins.held() == {}
    _fill(writer, [f"fp/{i}" for i in range(17, 31)], seed=17)  # round to segment 0 again
    assert _entry(tmp_path, "fp/30")[1] == 0  # renewed once nothing of it lived
    assert not (tmp_path / "fp" / "0").exists()  # its old entries forgotten


def _record_holder(path, offset: int, length: int) -> subprocess.Popen:
    """Another process reading from bytes of the arena (a shared record lock on them) until
    killed."""
    code = (
        "import fcntl, os, struct, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "arg = struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, int(sys.argv[2]), int(sys.argv[3]), 0)\n"
        "fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    argv = [sys.executable, "-c", code, str(path), str(offset), str(length)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"locked\n"
    return p


def test_with_every_other_segment_read_from_a_writer_keeps_its_own_copy(tmp_path):
    rows = SharedRows(tmp_path, SMALL)
    seg = rows.segment_bytes
    readers = [
        _record_holder(tmp_path / "arena", arenaformat.DATA_START + s * seg, seg)
        for s in range(1, arenaformat.SEGMENTS)
    ]
    try:
        _fill(rows, ["a/0", "a/1"])  # segment 0 has room for two
        got = rows.get_or_make("a/2", lambda place=None: buffer(4000, 2), I32)
        assert equal(got, buffer(4000, 2)) and rows.made == 2 and not (tmp_path / "a/2").exists()
    finally:
        for p in readers:
            p.kill()
            p.wait(10)
    rows.get_or_make("a/3", lambda place=None: buffer(4000, 3), I32)
    assert rows.made == 3 and _entry(tmp_path, "a/3")[1] == 1  # the readers gone: segment 1


def test_a_buffer_taken_twice_holds_its_segment_until_both_are_gone(tmp_path):
    _fill(SharedRows(tmp_path, SMALL), ["b/0"])
    reader = SharedRows(tmp_path, SMALL)
    first = reader.get_or_make("b/0", lambda place=None: None, I32)
    second = reader.get_or_make("b/0", lambda place=None: None, I32)
    assert reader.mapped == 2 and reader._pins.held() == {0: 2}
    assert not first.ids.flags.writeable
    del first
    gc.collect()
    assert reader._pins.held() == {0: 1}
    del second
    gc.collect()
    assert reader._pins.held() == {}


def test_a_process_waits_for_the_one_laying_out(tmp_path):
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow(place=None) -> RowBuffer:
        calls.append("slow")
        started.set()
        release.wait(10)
        return buffer(3000)

    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "a", SharedRows(tmp_path, 1 << 30).get_or_make("j/k", slow, I32)
        )
    )
    t.start()
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    b = SharedRows(tmp_path, 1 << 30).get_or_make(
        "j/k", lambda place=None: calls.append("fast"), I32
    )
    t.join(10)
    assert calls == ["slow"] and equal(b, buffer(3000)) and equal(out["a"], buffer(3000))


def _holder(lock) -> subprocess.Popen:
    """Another process that takes the lock of `lock` and keeps it until killed."""
    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"locked\n"
    return p


def test_a_dead_writers_lock_is_free_at_once(tmp_path):
    (tmp_path / "j").mkdir()
    lock = tmp_path / "j" / "k.lock"
    writer = _holder(lock)
    threading.Timer(0.3, writer.kill).start()  # dies (SIGKILL) without letting go itself
    began = time.monotonic()
    got = SharedRows(tmp_path, 1 << 30).get_or_make("j/k", lambda place=None: buffer(100), I32)
    waited = time.monotonic() - began
    writer.wait(10)
    assert equal(got, buffer(100)) and (tmp_path / "j" / "k").exists() and not lock.exists()
    assert 0.25 < waited < sharedrows.WAIT_SECONDS / 2  # it waited for the writer, not longer
    # A lock file left behind (no process holds it) is no lock at all.
    (tmp_path / "j" / "other.lock").write_bytes(b"")
    got = SharedRows(tmp_path, 1 << 30).get_or_make("j/other", lambda place=None: buffer(8), I32)
    assert equal(got, buffer(8)) and (tmp_path / "j" / "other").exists()


def test_a_writer_too_slow_is_not_waited_for(tmp_path, monkeypatch):
    (tmp_path / "j").mkdir()
    writer = _holder(tmp_path / "j" / "k.lock")
    try:
        monkeypatch.setattr(sharedrows, "WAIT_SECONDS", 0.2)
        rows = SharedRows(tmp_path, 1 << 30)
        got = rows.get_or_make("j/k", lambda place=None: buffer(7), I32)
        # Laid out here and served, nothing written: the slow writer still writes it.
        assert equal(got, buffer(7)) and not (tmp_path / "j" / "k").exists() and rows.made == 0
    finally:
        writer.kill()
        writer.wait(10)


def test_on_the_event_loop_a_process_does_not_wait_for_another(tmp_path):
    (tmp_path / "j").mkdir()
    writer = _holder(tmp_path / "j" / "k.lock")
    calls: list[int] = []

    def make(place=None):
        calls.append(1)
        return buffer(9)

    try:
        began = time.monotonic()
        assert SharedRows(tmp_path, 1 << 30).get_or_make_now("j/k", make, I32) is None
        assert time.monotonic() - began < 0.5 and calls == []  # no wait, nothing laid out
    finally:
        writer.kill()
        writer.wait(10)
    first = SharedRows(tmp_path, 1 << 30)
    got = first.get_or_make_now("j/k", make, I32)  # the lock is free: laid out and written
    assert got is not None and equal(got, buffer(9)) and first.made == 1 and calls == [1]
    second = SharedRows(tmp_path, 1 << 30)
    again = second.get_or_make_now("j/k", make, I32)  # mapped from the file
    assert again is not None and equal(again, buffer(9)) and second.mapped == 1 and calls == [1]


def test_the_arena_renews_its_oldest_segments_and_forgets_their_entries(tmp_path):
    rows = SharedRows(tmp_path, SMALL)
    n = 40  # two and a half rounds of the ring
    for i in range(n):
        rows.get_or_make(f"fp/{i}", lambda place=None, i=i: buffer(4000, i), I32)
        assert (tmp_path / "arena").stat().st_size == rows.budget <= SMALL
    assert rows.made == n
    kept = sorted(int(p.name) for p in (tmp_path / "fp").iterdir() if not p.name.endswith("lock"))
    assert kept[-1] == n - 1 and kept == list(range(kept[0], n))  # the oldest went first
    # Stale entries go once a round (when the first segment is renewed): two rounds' at most.
    rounds = 2 * arenaformat.SEGMENTS  # buffers a round
    assert len(kept) <= 2 * rounds
    reader = SharedRows(tmp_path, SMALL)
    for i in reversed(range(n)):  # newest first: a buffer made here is written, over the oldest
        calls = []
        got = reader.get_or_make(
            f"fp/{i}", lambda place=None, i=i, calls=calls: calls.append(i) or buffer(4000, i), I32
        )
        assert equal(got, buffer(4000, i))
        assert calls == ([] if i >= n - rounds else [i])  # the last round's are current


def test_a_process_reads_a_quarter_of_the_arena_in_place_at_most_and_copies_past_it(tmp_path):
    """Whatever a process keeps (its row cache holds `stream_cache_bytes`), it holds at most
    a quarter of the arena: the ring can still start segments anew for the others."""
    writer, reader = SharedRows(tmp_path, SMALL), SharedRows(tmp_path, SMALL)
    names = [f"c/{i}" for i in range(12)]
    _fill(writer, names)
    kept = [reader.get_or_make(name, lambda place=None: None, I32) for name in names]
    assert all(equal(b, buffer(4000, i)) for i, b in enumerate(kept))
    assert all(not b.ids.flags.writeable for b in kept)
    assert reader.in_place_bytes() == 4 * SLOT_BYTES <= reader.in_place_budget < 5 * SLOT_BYTES
    assert reader._pins.held() == {0: 2, 1: 2}  # the rest are copies, held nowhere
    # The writer goes round the ring past the segments of the copies.
    _fill(writer, [f"d/{i}" for i in range(20)], seed=50)
    assert writer.made == 32 and all(equal(b, buffer(4000, i)) for i, b in enumerate(kept))
    assert {_entry(tmp_path, f"d/{i}")[1] for i in range(16, 20)} <= {2, 3, 4, 5, 6, 7}
