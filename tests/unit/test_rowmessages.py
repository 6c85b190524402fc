"""rowmessages.py: a group's messages made in C, each batch's rows copied straight from their
sources, and the twins that run without a C compiler (the same bytes, the same refusals)."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import rowmessages as rm
from tokenfeed.v1 import tokenfeed_pb2 as pb


def test_the_extension_is_built_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the twins serve")
    assert rm.NATIVE


def _messages(native: bool, *args):
    if native and rm.NATIVE:
        return rm.messages(*args)
    heads, tails, sources, which, at, span, fp_len, fingerprint = args
    return rm._messages_py(
        heads, tails, sources, which, at, span, sources[0].itemsize, fp_len, fingerprint
    )


def _batch_messages(native: bool, *args):
    if native and rm.NATIVE:
        return rm.batch_messages(*args)
    parts, tags, steps, epochs, starts, start_at, splits, each, sources, *rest = args
    which, at, span, fp_len, hasher, header = rest
    return rm._batch_messages_py(
        tuple(parts),
        bytes(tags),
        np.asarray(steps, dtype=np.int64),
        np.asarray(epochs, dtype=np.int64),
        starts,
        np.asarray(start_at, dtype=np.int64),
        splits,
        each,
        sources,
        np.asarray(which, dtype=np.int64),
        np.asarray(at, dtype=np.int64),
        span,
        sources[0].itemsize,
        fp_len,
        hasher,
        header,
    )


class _Toy:
    """A hasher whose digest shows what it was given, and in which order: header, then each
    update, each ended by "|"; hexdigest: the first `size` hex characters of its MD5."""

    size = 10

    def __init__(self, header: bytes):
        self.seen = bytearray(header)

    def update(self, data) -> None:
        self.seen += bytes(data) + b"|"

    def hexdigest(self) -> str:
        return hashlib.md5(self.seen).hexdigest()[: self.size]


def _varint(n: int) -> bytes:
    """protobuf's own varint of n (an int64 field's bytes after its key)."""
    return pb.Batch(epoch=n).SerializeToString()[1:]


def test_varints_are_protobufs():
    assert rm.varint(0) == b"\x00"
    for n in [*range(1, 300), 16_383, 16_384, 2**21 - 1, 2**21, 2**63 - 1, -1, -(2**63)]:
        assert rm.varint(n) == _varint(n)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_messages_are_head_fingerprint_tail_and_rows_either_way(dtype):
    """Each batch's bytes are its head, the fingerprint of its rows as copied, its tail, then
    its rows; the C call and the twin make the same bytes."""
    rng = np.random.default_rng(3)
    sources = [rng.integers(0, 60_000, n).astype(dtype) for n in (50, 90, 17)]
    which = np.array([2, 0, 1, 1, 0, 2], dtype=np.int64)
    at = np.array([3, 40, 0, 80, 1, 10], dtype=np.int64)
    heads, tails = [b"head-a", b"", b"h3"], [b"t1", b"tail-two", b""]
    seen = []

    def fingerprint(i: int, rows: memoryview) -> str:
        seen.append((i, bytes(rows)))
        return f"{i:02d}" + bytes(rows).hex()[:6]

    made = [_messages(n, heads, tails, sources, which, at, 7, 8, fingerprint) for n in (1, 0)]
    assert made[0] == made[1]
    for i, message in enumerate(made[0]):
        rows = b"".join(sources[k][a : a + 7].tobytes() for k, a in zip(which, at, strict=True))
        mine = rows[i * 14 * sources[0].itemsize : (i + 1) * 14 * sources[0].itemsize]
        want = heads[i] + (f"{i:02d}" + mine.hex()[:6]).encode() + tails[i] + mine
        assert message == want
    assert seen[:3] == seen[3:] and [i for i, _ in seen[:3]] == [0, 1, 2]


@pytest.mark.parametrize("native", [True, False])
def test_messages_refuse_what_they_cannot_make(native):
    """A row past its source, rows that are not whole batches, a fingerprint of the wrong size
    or not ASCII: ValueError either way; a view the fingerprint keeps is released."""
    sources = [np.arange(20, dtype=np.int32)]
    ok = np.array([0, 0], dtype=np.int64), np.array([0, 5], dtype=np.int64)

    def fp(i, rows):
        return "ab"

    with pytest.raises(ValueError, match="row 1"):
        _messages(native, [b"", b""], [b"", b""], sources, ok[0], np.array([0, 14]), 7, 2, fp)
    with pytest.raises(ValueError, match="not 3 batches"):
        _messages(native, [b""] * 3, [b""] * 3, sources, *ok, 7, 2, fp)
    for bad in ("abc", "é1", 12):
        with pytest.raises(ValueError, match="fingerprint"):
            _messages(native, [b""] * 2, [b""] * 2, sources, *ok, 7, 2, lambda i, r, b=bad: b)
    kept = []
    _messages(
        native, [b""] * 2, [b""] * 2, sources, *ok, 7, 2, lambda i, r: kept.append(r) or fp(i, r)
    )
    with pytest.raises(ValueError):
        bytes(kept[0])
    with pytest.raises(ValueError, match="exploded"):  # the callback's own error, raised
        _messages(native, [b""] * 2, [b""] * 2, sources, *ok, 7, 2, _exploding)


def _exploding(i: int, rows: memoryview) -> str:
    raise ValueError("the fingerprint exploded")


PARTS = (b"<a>", b"", b"[c]", b"{d}")
TAGS = bytes([0x10, 0x38, 0x72, 0x7A])  # fields 2 and 7 (varints), 14 and 15 (bytes)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    batches=st.integers(1, 6),
    per=st.integers(1, 3),
    dtype=st.sampled_from([np.uint16, np.int32]),
    each=st.sampled_from([0, 4, 12]),
)
def test_batch_messages_write_each_batchs_own_fields_around_the_shared_pieces(
    data, batches, per, dtype, each
):
    """batch_messages makes what messages makes from heads and tails written out by hand:
    a, the step's field (none for 0), b | fingerprint | the epoch's field (none for 0), c,
    the starts' and splits' fields (none where empty), d | rows; C and twin alike."""
    varints = st.one_of(st.integers(0, 3), st.integers(0, 2**40), st.just(16_384))
    steps = data.draw(st.lists(varints, min_size=batches, max_size=batches))
    epochs = data.draw(st.lists(varints, min_size=batches, max_size=batches))
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=batches, max_size=batches))
    start_at = np.concatenate(([0], np.cumsum(sizes) * 8)).astype(np.int64)
    starts = bytes(range(256))[: int(start_at[-1])]
    splits = bytes(range(100, 256))[: each * batches]
    rng = np.random.default_rng(batches * per + each)
    sources = [rng.integers(0, 60_000, n).astype(dtype) for n in (30, 41)]
    which = rng.integers(0, 2, batches * per).astype(np.int64)
    at = np.array([rng.integers(0, sources[k].size - 5 + 1) for k in which], dtype=np.int64)

    heads, tails, own = [], [], []
    for i in range(batches):
        step = TAGS[0:1] + _varint(steps[i]) if steps[i] else b""
        heads.append(PARTS[0] + step + PARTS[1])
        tail = (TAGS[1:2] + _varint(epochs[i]) if epochs[i] else b"") + PARTS[2]
        mine = starts[start_at[i] : start_at[i + 1]]
        rows = splits[i * each : (i + 1) * each]
        for tag, field in ((TAGS[2:3], mine), (TAGS[3:4], rows)):
            tail += tag + _varint(len(field)) + field if field else b""
        tails.append(tail + PARTS[3])
        own.append(b"".join(part + b"|" for part in (mine, rows)))

    def fingerprint(i: int, rows: memoryview) -> str:  # header, rows, starts, splits
        return hashlib.md5(b"head" + bytes(rows) + b"|" + own[i]).hexdigest()[:10]

    want = _messages(False, heads, tails, sources, which, at, 5, 10, fingerprint)
    args = (PARTS, TAGS, steps, epochs, starts, start_at, splits, each, sources, which, at, 5)
    for native in (True, False):
        assert _batch_messages(native, *args, 10, _Toy, b"head") == want


@pytest.mark.parametrize("native", [True, False])
def test_batch_messages_refuse_what_they_cannot_make(native):
    """Starts past the bytes given or not ascending, too few splits, an epoch or an offset
    missing, parts or tags of the wrong count, a row past its source: refused either way."""
    sources = [np.arange(20, dtype=np.int32)]
    which, at = np.zeros(2, dtype=np.int64), np.array([0, 5], dtype=np.int64)

    def call(**change):
        args = {
            "parts": PARTS,
            "tags": TAGS,
            "steps": [1, 2],
            "epochs": [0, 0],
            "starts": b"x" * 16,
            "start_at": [0, 8, 16],
            "splits": b"y" * 8,
            "each": 4,
            "at": at,
        } | change
        a = args
        return _batch_messages(
            native,
            a["parts"],
            a["tags"],
            a["steps"],
            a["epochs"],
            a["starts"],
            a["start_at"],
            a["splits"],
            a["each"],
            sources,
            which,
            a["at"],
            7,
            _Toy.size,
            _Toy,
            b"",
        )

    assert len(call()) == 2
    for change, message in [
        ({"start_at": [0, 8, 24]}, "starts"),
        ({"start_at": [0, 12, 8]}, "starts"),
        ({"start_at": [-8, 8, 16]}, "starts"),
        ({"splits": b"y" * 7}, "row splits"),
        ({"epochs": [0]}, "epochs"),
        ({"start_at": [0, 16]}, "offsets"),
        ({"parts": PARTS[:3]}, "parts"),
        ({"tags": TAGS[:3]}, "tags"),
        ({"each": -1}, "splits_each"),
        ({"at": np.array([0, 14], dtype=np.int64)}, "row 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**change)
    with pytest.raises(TypeError, match="part 1"):
        call(parts=(b"", "text", b"", b""))


@pytest.mark.parametrize("native", [True, False])
def test_batch_messages_pass_on_a_hashers_error_and_refuse_a_short_digest(native):
    """A hasher that raises is the call's error (not a SystemError), whatever step it fails
    at; a digest of the wrong length is refused (ValueError naming the batch)."""
    sources = [np.arange(20, dtype=np.int32)]
    which, at = np.zeros(2, dtype=np.int64), np.array([0, 5], dtype=np.int64)

    def call(hasher, fp_len=_Toy.size):
        args = (PARTS, TAGS, [1, 2], [0, 0], b"x" * 16, [0, 8, 16], b"y" * 8, 4, sources)
        return _batch_messages(native, *args, which, at, 7, fp_len, hasher, b"h")

    class Fails(_Toy):
        def __init__(self, header: bytes, where: str):
            super().__init__(header)
            self.where = where
            if where == "make":
                raise KeyError("no hasher")

        def update(self, data) -> None:
            if self.where == "update":
                raise KeyError("no update")
            super().update(data)

        def hexdigest(self) -> str:
            if self.where == "digest":
                raise KeyError("no digest")
            return super().hexdigest()

    for where in ("make", "update", "digest"):
        with pytest.raises(KeyError, match=f"no {where[:6] if where != 'make' else 'hasher'}"):
            call(lambda header, w=where: Fails(header, w))
    with pytest.raises(ValueError, match="batch 0's fingerprint"):
        call(_Toy, fp_len=_Toy.size + 1)
