"""The compact wire form: one token array and document boundaries, expanded by the client
(numpy) and by the PyTorch helper (here on the CPU device; test_jax_expand.py: the JAX one).

The expansion is checked against the tensors the server's packers make (concat rows from a
stream of documents, best_fit rows with padding), the encoding against a serialized message, and
the fingerprint against an independent computation from its documented definition.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.client import wire
from tokenfeed.client.batch import Batch
from tokenfeed.client.torch import expand as torch_expand
from tokenfeed.client.wire import (
    TENSOR_NAMES,
    WIRE_VERSION,
    Compact,
    WireError,
    compact_from_flat_starts,
    compact_from_starts,
    compact_from_tensors,
    decode,
    encode,
    expand,
    fingerprint,
    slice_rows,
    split_rows,
    token_dtype,
)
from tokenfeed.server.pack import bestfit, packing
from tokenfeed.v1 import tokenfeed_pb2 as pb

BOS, EOS, PAD = 1, 2, 2


def over_the_wire(fields: dict) -> pb.Batch:
    """Serialize and parse, as a real client would receive the message."""
    return pb.Batch.FromString(pb.Batch(job="j", **fields).SerializeToString())


def concat_case(lengths, seq_len, rows, add_bos, dtype):
    lens = np.array(lengths, dtype=np.int32)
    tokens = np.arange(10, 10 + int(lens.sum()), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)[: len(lens)]
    stream = packing.concat_stream(offsets, lens, np.arange(len(lens)), add_bos)
    k = len(rows)
    ids = np.empty((k, seq_len + 1), dtype=np.int32)
    lo = np.asarray(rows, dtype=np.int64) * seq_len
    found = packing.fill_concat(
        stream,
        tokens,
        lo,
        lo + seq_len + 1,
        np.arange(k, dtype=np.int64) * (seq_len + 1),
        BOS,
        EOS,
        ids.reshape(-1),
    )
    starts = packing.starts_mask(found, ids.shape)
    tensors = packing.concat_tensors(ids, starts, seq_len)
    compact = compact_from_starts(ids.astype(dtype), starts)
    # The server's path (flat starts, sorted) gives the same compact form.
    flat = compact_from_flat_starts(ids.astype(dtype), np.sort(found))
    assert np.array_equal(flat.starts, compact.starts)
    assert np.array_equal(flat.row_splits, compact.row_splits)
    return tensors, compact


def check_expands_to(c, tensors):
    msg = over_the_wire(encode(c))
    batch = Batch(msg)
    assert tuple(batch) == TENSOR_NAMES
    for name in TENSOR_NAMES:
        got = batch[name]
        assert got.dtype == np.int32 and got.shape == tensors[name].shape, name
        assert np.array_equal(got, tensors[name]), name
        assert not got.flags.writeable
    # The PyTorch helper derives the same tensors from the compact form on its device.
    on_device = torch_expand(batch, "cpu")
    for name in TENSOR_NAMES:
        assert on_device[name].dtype == torch.int32, name
        assert np.array_equal(on_device[name].numpy(), tensors[name]), name
    return batch


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=8).filter(any),
    seq_len=st.integers(1, 16),
    add_bos=st.booleans(),
    wide=st.booleans(),
)
def test_concat_rows_expand_to_the_packers_tensors(lengths, seq_len, add_bos, wide):
    total = packing.concat_units(sum(lengths), len(lengths), add_bos)
    n = (total - 1) // seq_len
    if n < 1:
        return
    dtype = np.dtype("<i4") if wide else np.dtype("<u2")
    tensors, c = concat_case(lengths, seq_len, list(range(n)), add_bos, dtype)
    check_expands_to(c, tensors)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=10),
    seq_len=st.integers(1, 16),
    add_bos=st.booleans(),
)
def test_best_fit_rows_expand_to_the_packers_tensors(lengths, seq_len, add_bos):
    lens = np.array(lengths, dtype=np.int32)
    tokens = np.arange(10, 10 + int(lens.sum()), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)[: len(lens)]
    layout = bestfit.bestfit_layout(lens, seq_len, add_bos)
    tensors = bestfit.bestfit_rows_at(
        layout, offsets, tokens, np.arange(layout.rows), seq_len, BOS, EOS, PAD
    )
    c = compact_from_tensors(tensors, np.dtype("<u2"))
    check_expands_to(c, tensors)


def test_a_worked_example():
    # Row 0: "10 11 E | 12 13" then label 14; row 1 padded best_fit-style by two slots; an id
    # above 32767 stays positive through the helpers' widening of uint16.
    tokens = np.array([[10, 11, EOS, 12, 13, 65535], [20, 21, EOS, 30, PAD, PAD]], dtype="<u2")
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[0, 3] = starts[1, 3] = True
    c = compact_from_starts(tokens, starts, np.array([0, 2]))
    assert c.starts.tolist() == [3, 3] and c.row_splits.tolist() == [0, 1, 2]
    assert expand(c, "input_ids").tolist() == [[10, 11, EOS, 12, 13], [20, 21, EOS, 30, PAD]]
    assert expand(c, "labels").tolist() == [[11, EOS, 12, 13, 65535], [21, EOS, 30, PAD, PAD]]
    assert torch_expand(c)["labels"].tolist() == expand(c, "labels").tolist()
    assert expand(c, "position_ids").tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]
    assert expand(c, "segment_ids").tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 2, 0]]
    assert expand(c, "loss_mask").tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def reference_fingerprint(fields: dict) -> str:
    """The documented definition, without the module under test: xxh3-128 over the header
    (<IqqII: version, rows, seq_len, token dtype code, has padding) and the arrays' bytes."""
    header = struct.pack(
        "<IqqII",
        fields["wire_version"],
        fields["rows"],
        fields["seq_len"],
        fields["token_dtype"],
        1 if fields["padding"] else 0,
    )
    return xxhash.xxh3_128_hexdigest(
        header + fields["tokens"] + fields["starts"] + fields["row_splits"] + fields["padding"]
    )


def test_fingerprint_matches_its_definition_and_sees_every_field():
    _, c = concat_case([5, 3, 9, 2], 4, [0, 1, 2, 3], True, np.dtype("<u2"))
    fields = encode(c)
    assert fields["wire_version"] == WIRE_VERSION == 2
    assert fields["fingerprint"] == reference_fingerprint(fields) == fingerprint(c)
    seen = {fields["fingerprint"]}
    for name in ("tokens", "starts", "row_splits"):
        raw = bytearray(fields[name])
        raw[len(raw) // 2] ^= 1
        seen.add(reference_fingerprint({**fields, name: bytes(raw)}))
    seen.add(reference_fingerprint({**fields, "padding": b"\x01\x00" * c.rows}))
    assert len(seen) == 5


def test_decoding_is_zero_copy_and_checked():
    tensors, c = concat_case([40, 7, 13], 8, [0, 2, 4, 5], False, np.dtype("<i4"))
    msg = over_the_wire(encode(c))
    batch = Batch(msg)
    # int32 tokens: input_ids and labels are views of the received bytes
    assert np.shares_memory(batch["input_ids"], batch.compact.tokens)
    assert np.shares_memory(batch["labels"], batch.compact.tokens)
    bad = pb.Batch()
    bad.CopyFrom(msg)
    raw = bytearray(bad.tokens)
    raw[5] ^= 0xFF
    bad.tokens = bytes(raw)
    with pytest.raises(WireError, match="fingerprint mismatch"):
        Batch(bad)
    assert Batch(bad, verify=False)["input_ids"].shape == (4, 8)  # verification is optional


def test_uint16_input_ids_and_labels_share_one_widened_copy():
    tensors, c = concat_case([40, 7, 13], 8, [0, 2, 4, 5], False, np.dtype("<u2"))
    batch = Batch(over_the_wire(encode(c)))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.dtype == labels.dtype == np.int32
    assert np.array_equal(ids, tensors["input_ids"])
    assert np.array_equal(labels, tensors["labels"])
    # one int32 copy of the [rows, seq_len + 1] tokens, both tensors views of it
    assert np.shares_memory(ids, labels)
    assert not np.shares_memory(ids, batch.compact.tokens)
    assert not ids.flags.writeable and not labels.flags.writeable
    with pytest.raises(ValueError):
        ids.base[0, 0] = 7  # the shared copy is read-only too


@pytest.mark.parametrize(
    "change",
    [
        {"starts": np.array([3, 6, 2], dtype="<u2").tobytes()},
        {"row_splits": np.array([0, 1, 2, 3, 3], dtype="<i4").tobytes()},
        {"padding": np.array([0, 2, 0, 2], dtype="<u2").tobytes()},
        {"tokens": np.arange(36, dtype="<u2")[::-1].tobytes()},
    ],
)
def test_a_well_formed_message_with_any_field_changed_fails_its_fingerprint(change):
    """The client fingerprints the received bytes of every field (not arrays made of them):
    a change to any one that passes the consistency checks is still caught."""
    c = Compact(
        np.arange(36, dtype="<u2").reshape(4, 9),
        np.array([3, 5, 2], dtype="<u2"),
        np.array([0, 2, 2, 3, 3], dtype="<i4"),
        np.array([0, 1, 0, 2], dtype="<u2"),
    )
    fields = encode(c)
    good = decode(over_the_wire(fields))
    assert fingerprint(good) == fields["fingerprint"] == fingerprint(c)
    changed = over_the_wire({**fields, **change})
    decode(changed, verify=False)  # well-formed
    with pytest.raises(WireError, match="fingerprint mismatch"):
        decode(changed)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"wire_version": 1}, "wire version 1"),
        ({"token_dtype": pb.DTYPE_FLOAT32}, "unknown token dtype"),
        ({"rows": 5}, "tokens: "),
        ({"row_splits": np.array([0, 1, 0, 2, 2], dtype="<i4").tobytes()}, "row_splits"),
        ({"starts": np.array([0, 3], dtype="<u2").tobytes()}, "outside"),
        ({"padding": np.array([9, 0, 0, 0], dtype="<u2").tobytes()}, "padding of more"),
    ],
)
def test_malformed_messages_are_refused(change, match):
    _, c = concat_case([40, 7, 13], 8, [0, 2, 4, 5], False, np.dtype("<u2"))
    fields = {**encode(c), **change}
    if "starts" in change:
        fields["row_splits"] = np.array([0, 2, 2, 2, 2], dtype="<i4").tobytes()
    with pytest.raises(WireError, match=match):
        decode(over_the_wire(fields), verify=False)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(-3, 70_000), max_size=150),
    lo=st.integers(-2, 5),
    hi=st.integers(0, 70_000),
    dtype=st.sampled_from(["<i4", "<i8"]),
)
def test_decodes_checks_agree_with_numpys_at_every_size(values, lo, hi, dtype):
    """Small arrays are checked as lists, large ones with numpy: the same answers."""
    a = np.array(values, dtype=dtype)
    assert wire._ascending(a) == bool(np.all(a[1:] >= a[:-1]))
    if len(a):
        assert wire._between(a, lo, hi) == bool(np.all((a >= lo) & (a < hi)))


@pytest.mark.parametrize("fault", ["splits", "start 0", "start seq_len"])
def test_large_malformed_batches_are_refused(fault):
    rows, seq_len = 100, 8
    starts = np.full(rows, 3, dtype="<u2")
    splits = np.arange(rows + 1, dtype="<i4")
    if fault == "splits":
        splits[50], splits[51] = 52, 50
    else:
        starts[77] = 0 if fault == "start 0" else seq_len
    c = Compact(np.zeros((rows, seq_len + 1), dtype="<u2"), starts, splits, None)
    with pytest.raises(WireError, match="row_splits" if fault == "splits" else "outside"):
        decode(over_the_wire(encode(c)), verify=False)


def test_token_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert token_dtype(50_257) == np.dtype("<u2")
    assert token_dtype(65_536) == np.dtype("<u2")  # ids 0..65535
    assert token_dtype(65_537) == np.dtype("<i4")
    assert token_dtype(128_256) == np.dtype("<i4")


def test_the_server_packers_name_the_same_tensors():
    assert packing.TENSOR_NAMES == TENSOR_NAMES == bestfit.BESTFIT_TENSOR_NAMES


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 3),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_split_rows_is_slice_rows_of_each_batch(per, steps, extra, padded, seed):
    rng = np.random.default_rng(seed)
    rows, seq_len = per * steps + extra, 16
    tokens = rng.integers(0, 60_000, (rows, seq_len + 1)).astype(np.uint16)
    counts = rng.integers(0, 4, rows)
    splits = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    starts = rng.integers(1, seq_len, int(splits[-1])).astype(np.uint16)
    padding = (rng.integers(0, 2, rows) * rng.integers(0, 3, rows)).astype(np.uint16)
    c = Compact(tokens, starts, splits, padding if padded else None)
    for i, got in enumerate(split_rows(c, per, steps)):
        want = slice_rows(c, i * per, (i + 1) * per)
        assert fingerprint(got) == fingerprint(want)
        pairs = zip(
            (got.tokens, got.starts, got.row_splits),
            (want.tokens, want.starts, want.row_splits),
            strict=True,
        )
        for a, b in pairs:
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert (got.padding is None) == (want.padding is None)
        if got.padding is not None:
            assert np.array_equal(got.padding, want.padding)
