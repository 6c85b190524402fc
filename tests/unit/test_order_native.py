"""sampling/_feistel.c: the sample order's Feistel network and its walks in C give the values of
bijection.py's numpy twin (the reference), so the C path changes no batch byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.sampling import bijection

pytestmark = pytest.mark.skipif(bijection._native is None, reason="built without a C compiler")

keys_st = st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=12).map(tuple)


@settings(max_examples=150, deadline=None)
@given(half=st.integers(1, 32), keys=keys_st, inverse=st.booleans(), data=st.data())
def test_the_network_is_the_numpy_ones(half, keys, inverse, data):
    top = 2 ** min(2 * half, 64) - 1
    x = np.array(data.draw(st.lists(st.integers(0, top), max_size=40)), dtype=np.uint64)
    assert np.array_equal(
        bijection._feistel(x, half, keys, inverse), bijection._feistel_numpy(x, half, keys, inverse)
    )


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**32), epoch=st.integers(0, 10**6))
def test_a_permutation_is_the_numpy_ones(n, seed, epoch):
    keys = bijection.round_keys("docs", seed, "ds", epoch, 3)
    native = bijection.permutation(n, keys)
    assert sorted(native.tolist()) == list(range(n))  # a bijection of [0, n)
    assert np.array_equal(native, _numpy_permutation(n, keys))
    # and the same values as the network walked one index at a time (bijection.permute)
    assert np.array_equal(native[:50], bijection.permute(np.arange(min(n, 50)), n, keys))


def test_large_domains_agree():
    keys = bijection.round_keys("rows", 7, "big", 2)
    for n in (65_537, 1_000_003):
        assert np.array_equal(bijection.permutation(n, keys), _numpy_permutation(n, keys))


def test_bad_arguments_are_refused():
    out = np.empty(3, dtype=np.int64)
    with pytest.raises(ValueError, match="domain"):
        bijection._native.permutation(17, 2, (1, 2), out)  # 17 items do not fit 2**4
    with pytest.raises(ValueError, match="int64 items"):
        bijection._native.permutation(4, 2, (1, 2), out)
    with pytest.raises(TypeError, match="uint64"):
        x = np.zeros(3, dtype=np.int64)
        bijection._native.feistel(x, x, 2, (1,), False)
    with pytest.raises(ValueError, match="at most 64 keys"):
        bijection._native.feistel(
            np.zeros(1, np.uint64), np.zeros(1, np.uint64), 2, [0] * 65, False
        )


def _numpy_permutation(n: int, keys: tuple[int, ...]) -> np.ndarray:
    native, bijection._native = bijection._native, None
    try:
        return bijection.permutation(n, keys)
    finally:
        bijection._native = native
