"""Row buffers shared by a node's serving processes through files (pack/sharedrows.py): laid
out once whoever asks, the same bytes mapped back; a damaged file is laid out again; a dead
writer's lock is free at once, a too slow one not waited for; the directory stays under its
budget."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
from tokenfeed.server.pack import sharedrows
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

    def make() -> RowBuffer:
        calls.append(1)
        return want

    first, second = SharedRows(tmp_path, 1 << 30), SharedRows(tmp_path, 1 << 30)  # two processes
    a = first.get_or_make("fp/0-0-1-7", make, I32)
    b = second.get_or_make("fp/0-0-1-7", make, I32)
    assert len(calls) == 1 and equal(a, want) and equal(b, want)
    assert (first.made, second.made, second.mapped) == (1, 0, 1)
    assert b.ids.dtype == I32 and not b.ids.flags.writeable  # a read-only mapping
    # Another name is another buffer.
    other = second.get_or_make("fp/0-0-2-7", lambda: buffer(99, 1), I32)
    assert equal(other, buffer(99, 1)) and second.made == 1


def test_a_damaged_file_is_laid_out_again(tmp_path):
    rows = SharedRows(tmp_path, 1 << 30)
    rows.get_or_make("x/b", lambda: buffer(5000), I32)
    path = tmp_path / "x" / "b"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte of the payload
    path.write_bytes(bytes(raw))
    calls = []

    def make() -> RowBuffer:
        calls.append(1)
        return buffer(5000)

    got = SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32)
    assert calls == [1] and equal(got, buffer(5000))
    again = SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32)  # rewritten, good
    assert calls == [1] and equal(again, buffer(5000))
    path.write_bytes(b"short")
    assert equal(SharedRows(tmp_path, 1 << 30).get_or_make("x/b", make, I32), buffer(5000))
    assert calls == [1, 1]


def test_a_process_waits_for_the_one_laying_out(tmp_path):
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> RowBuffer:
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
    b = SharedRows(tmp_path, 1 << 30).get_or_make("j/k", lambda: calls.append("fast"), I32)
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
    got = SharedRows(tmp_path, 1 << 30).get_or_make("j/k", lambda: buffer(100), I32)
    waited = time.monotonic() - began
    writer.wait(10)
    assert equal(got, buffer(100)) and (tmp_path / "j" / "k").exists() and not lock.exists()
    assert 0.25 < waited < sharedrows.WAIT_SECONDS / 2  # it waited for the writer, not longer
    # A lock file left behind (no process holds it) is no lock at all.
    (tmp_path / "j" / "other.lock").write_bytes(b"")
    got = SharedRows(tmp_path, 1 << 30).get_or_make("j/other", lambda: buffer(8), I32)
    assert equal(got, buffer(8)) and (tmp_path / "j" / "other").exists()


def test_a_writer_too_slow_is_not_waited_for(tmp_path, monkeypatch):
    (tmp_path / "j").mkdir()
    writer = _holder(tmp_path / "j" / "k.lock")
    try:
        monkeypatch.setattr(sharedrows, "WAIT_SECONDS", 0.2)
        rows = SharedRows(tmp_path, 1 << 30)
        got = rows.get_or_make("j/k", lambda: buffer(7), I32)
        # Laid out here and served, nothing written: the slow writer still writes it.
        assert equal(got, buffer(7)) and not (tmp_path / "j" / "k").exists() and rows.made == 0
    finally:
        writer.kill()
        writer.wait(10)


def test_on_the_event_loop_a_process_does_not_wait_for_another(tmp_path):
    (tmp_path / "j").mkdir()
    writer = _holder(tmp_path / "j" / "k.lock")
    calls: list[int] = []

    def make():
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


def test_the_directory_stays_under_its_budget(tmp_path):
    n = 20
    size = 4000 * 4 + (4000 // 7) * 8 + sharedrows.HEADER.size
    rows = SharedRows(tmp_path, budget=5 * size)
    for i in range(n):
        rows.get_or_make(f"fp/{i}", lambda i=i: buffer(4000, i), I32)
        os.utime(tmp_path / "fp" / str(i), (1000 + i, 1000 + i))  # distinct ages
        on_disk = sum(p.stat().st_size for p in (tmp_path / "fp").iterdir())
        assert on_disk <= 5 * size + size  # at most one write past the budget between sweeps
    kept = sorted(int(p.name) for p in (tmp_path / "fp").iterdir())
    assert kept[-1] == n - 1 and kept == list(range(kept[0], n))  # the oldest went first
