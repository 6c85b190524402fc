"""gather.py: range copies in C with the GIL released, and their numpy twin (the same bytes)."""

from __future__ import annotations

import shutil
from functools import partial

import numpy as np
import pytest
from gilcheck import lets_others_run
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import gather as g
from tokenfeed.server.pack import packing, rowlayout

BOS, EOS = 1, 2


def _both(dst_size, sources, to, which, frm, n):
    """The destination after the C copies and after the numpy ones (9s where nothing went)."""
    out = []
    for native in (True, False):
        dst = np.full(dst_size, 9, dtype=sources[0].dtype)
        args = [np.array(a, dtype=np.int64) for a in (to, which, frm, n)]
        if native:
            g.gather(dst, args[0], sources, *args[1:])
        else:
            g._gather_numpy(dst, sources, *args)
        out.append(dst)
    return out


def test_the_extension_is_built_where_a_compiler_is():
    # CI installs the package with a C compiler present: the GIL-free copies are what it
    # tests, never a silent fallback.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the numpy twin serves")
    assert g.NATIVE


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([np.uint16, np.int32, np.int64]),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
)
def test_c_and_numpy_copy_the_same_ranges(data, dtype, sizes):
    sources = [np.arange(100 * k, 100 * k + s, dtype=dtype) for k, s in enumerate(sizes)]
    ranges = []
    for _ in range(data.draw(st.integers(0, 8))):
        k = data.draw(st.integers(0, len(sources) - 1))
        m = data.draw(st.integers(0, sizes[k]))
        b = data.draw(st.integers(0, sizes[k] - m))
        ranges.append((data.draw(st.integers(0, 60 - m)), k, b, m))
    columns = list(zip(*ranges, strict=True)) if ranges else [(), (), (), ()]
    native, twin = _both(60, sources, *columns)
    assert np.array_equal(native, twin)
    want = np.full(60, 9, dtype=dtype)
    for a, k, b, m in ranges:
        want[a : a + m] = sources[k][b : b + m]
    assert np.array_equal(native, want)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "bad, message",
    [
        (([0, 5], [0, 2], [0, 0], [1, 1]), "range 1 reads source 2 of 2"),
        (([0], [0], [95], [10]), "range 0: 10 items from 95 of a source of 100"),
        (([25], [0], [0], [10]), "to 25 of a destination of 30"),
        (([0], [0], [0], [-1]), "range 0: -1 items"),
        (([0], [1], [-3], [2]), "range 0: 2 items from -3"),
    ],
)
def test_a_range_out_of_bounds_is_refused_and_nothing_is_copied(native, bad, message):
    sources = [np.arange(100, dtype=np.int32), np.arange(50, dtype=np.int32)]
    dst = np.zeros(30, dtype=np.int32)
    to, which, frm, n = (np.array(a, dtype=np.int64) for a in bad)
    # A valid first range (where there are two) must not be copied either.
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        if native:
            g.gather(dst, to, sources, which, frm, n)
        else:
            g._gather_numpy(dst, sources, to, which, frm, n)
    assert not dst.any()


def test_sources_of_another_dtype_are_refused():
    with pytest.raises(TypeError, match="a source of uint16 for a destination of int32"):
        g.gather(np.zeros(4, np.int32), [0], [np.zeros(4, np.uint16)], [0], [0], [4])


def test_a_destination_that_a_copy_would_miss_is_refused():
    # A strided or read-only destination: the numpy twin would write into a reshaped copy.
    for dst in (np.zeros((4, 4), np.int32)[:, ::2], np.zeros(4, np.int32)):
        dst.flags.writeable = dst.base is not None
        with pytest.raises(ValueError, match="writable C-contiguous"):
            g.gather(dst, [0], [np.ones(2, np.int32)], [0], [0], [2])
        assert not dst.any()


def test_strided_sources_are_copied_whole():
    src = np.arange(20, dtype=np.int32)[::2]  # 0, 2, 4, ...
    dst = np.zeros(3, np.int32)
    g.gather(dst, [0], [src], [0], [4], [3])
    assert dst.tolist() == [8, 10, 12]


@pytest.mark.parametrize("release", [True, False])
def test_the_c_copies_let_other_threads_run_where_asked(release):
    """While the copies run with `release_gil`, a Python thread that waits for the GIL gets
    it; without, it does not: with forced switches off, it can run inside the call only if
    the call released the GIL."""
    if not g.NATIVE:
        pytest.skip("the numpy twin holds the GIL")
    source = np.ones(4 << 20, dtype=np.int32)  # 16 MB, copied 40 times over one place
    dst = np.zeros_like(source)
    times = 40
    args = ([0] * times, [0] * times, [0] * times, [len(source)] * times)
    copy = partial(g.gather, dst, args[0], [source], *args[1:], release_gil=release)
    assert lets_others_run(copy) == release
    assert dst.all()


@pytest.mark.parametrize("add_bos", [False, True])
def test_row_buffers_and_rows_are_the_same_bytes_without_the_extension(monkeypatch, add_bos):
    rng = np.random.default_rng(7)
    lengths = rng.integers(60, 300, 50)
    tokens = rng.integers(3, 60000, int(lengths.sum())).astype(np.uint16)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    stream = packing.concat_stream(offsets, lengths, rng.permutation(50), add_bos)
    tail = [rowlayout.RowBuffer(np.arange(7, dtype=np.uint16) + 9, np.array([0, 4]))]
    built = []
    for native in (True, False):
        monkeypatch.setattr(g, "NATIVE", native and g.NATIVE)
        buf = rowlayout.row_buffer(stream, tokens, tail, BOS, EOS, np.uint16)
        rows = rowlayout._rows(
            [buf.ids, tail[0].ids],
            np.array([0, 1, 0]),
            np.array([5, 0, 900]),
            3,
            7,
            np.dtype(np.uint16),
        )
        built.append((buf, rows))
        with pytest.raises(ValueError):  # a row past its buffer's end, either way
            rowlayout._rows([tail[0].ids], np.array([0]), np.array([3]), 1, 7, np.dtype(np.uint16))
    (a, rows_a), (b, rows_b) = built
    assert not a.ids.flags.writeable and not b.ids.flags.writeable
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)
    assert np.array_equal(rows_a, rows_b)
    assert np.array_equal(rows_a[1], tail[0].ids)
    assert np.array_equal(rows_a[2], a.ids[900:907])
