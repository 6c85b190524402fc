"""A buffer laid out straight into the node's arena (pack/sharedrows.py `_make`, rowlayout's
`place`): the slot a maker is offered holds the same bytes a layout in memory would, the
node's other processes map them, the writer reads them in place like any reader (their
segment held while its arrays live, copied out past its in-place budget); a maker that fails
leaves no entry and holds nothing; one too large for a segment is laid out in memory and
not shared."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from tokenfeed.server.pack import packing, rowlayout
from tokenfeed.server.pack.arenalocks import held_in_place
from tokenfeed.server.pack.rowlayout import RowBuffer
from tokenfeed.server.pack.sharedrows import SharedRows

U16 = np.dtype(np.uint16)


def _chunk(seed: int, docs: int = 40) -> tuple[packing.ChunkStream, np.ndarray, list[RowBuffer]]:
    """A chunk's stream in one epoch's order (documents of 64-400 tokens), its tokens, and a
    tail of two pieces."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 400, docs)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = rng.integers(3, 60_000, int(lengths.sum())).astype(np.uint16)
    stream = packing.concat_stream(offsets, lengths, rng.permutation(docs), add_bos=True)
    tail = [
        RowBuffer(rng.integers(3, 60_000, n).astype(np.uint16), np.array([0, n // 2]))
        for n in (50, 9)
    ]
    return stream, tokens, tail


def _laid(seed: int, place=None) -> RowBuffer:
    stream, tokens, tail = _chunk(seed)
    return rowlayout.row_buffer(stream, tokens, tail, 1, 2, U16, place)


def _equal(a: RowBuffer, b: RowBuffer) -> bool:
    return np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)


@pytest.mark.parametrize("seed", range(4))
def test_a_buffer_laid_out_where_it_is_placed_is_the_buffer_laid_out_in_memory(seed):
    offered: list[tuple[int, int]] = []

    def place(n_ids: int, n_starts: int):
        offered.append((n_ids, n_starts))
        return np.zeros(n_ids + 3, U16)[1:-2], np.full(n_starts, -1, np.int64)

    got, want = _laid(seed, place), _laid(seed)
    assert _equal(got, want) and offered == [(len(want.ids), len(want.starts))]
    assert not got.ids.flags.writeable and not got.starts.flags.writeable
    assert _equal(_laid(seed, lambda n_ids, n_starts: None), want)  # no room: in memory


def test_a_slot_laid_out_in_place_is_mapped_by_the_others_and_read_in_place_here(tmp_path):
    writer, reader = SharedRows(tmp_path, 1 << 30), SharedRows(tmp_path, 1 << 30)
    made = writer.get_or_make("fp/0-0-3-1", lambda place=None: _laid(3, place), U16)
    want = _laid(3)
    assert _equal(made, want) and writer.made == 1
    assert held_in_place(made.ids) and held_in_place(made.starts)  # no copy of it here
    assert writer.segment_of(made.ids) is not None and not made.ids.flags.writeable
    assert writer.in_place_bytes() > 0
    mapped = reader.get_or_make("fp/0-0-3-1", lambda place=None: pytest.fail("laid out"), U16)
    assert _equal(mapped, want) and reader.mapped == 1  # its check (xxh3) passed
    held = writer._pins.held()
    del made
    gc.collect()
    assert writer.in_place_bytes() == 0 and writer._pins.held() != held  # let go with its views


def test_a_maker_that_fails_in_its_slot_leaves_no_entry_and_holds_nothing(tmp_path):
    rows = SharedRows(tmp_path, 1 << 30)

    def broken(place=None):
        stream, tokens, tail = _chunk(5)
        place(len(tokens), 3)  # the slot taken, then the layout fails
        raise OSError("the chunk went away")

    with pytest.raises(OSError, match="went away"):
        rows.get_or_make("fp/b", broken, U16)
    assert rows.made == 0 and not rows._pins.held() and not (tmp_path / "fp" / "b").exists()
    again = rows.get_or_make("fp/b", lambda place=None: _laid(5, place), U16)
    assert _equal(again, _laid(5)) and rows.made == 1


def test_a_buffer_larger_than_a_segment_is_laid_out_in_memory_and_not_shared(tmp_path):
    rows = SharedRows(tmp_path, 1 << 20)  # segments of about 128 KiB
    big = RowBuffer(np.arange(200_000, dtype=np.uint16), np.array([0]))
    offered = []

    def make(place=None):
        offered.append(place(len(big.ids), 1))
        return big

    got = rows.get_or_make("fp/big", make, U16)
    assert offered == [None] and got is big and rows.made == 0


def test_past_its_in_place_budget_a_writer_copies_its_slot_out(tmp_path):
    rows = SharedRows(tmp_path, 1 << 22)  # a quarter: about 1 MiB in place
    kept = [
        rows.get_or_make(f"fp/{i}", lambda place=None, i=i: _laid(i, place), U16) for i in range(70)
    ]
    assert all(_equal(k, _laid(i)) for i, k in enumerate(kept))
    in_place = [held_in_place(k.ids) for k in kept]
    assert in_place[0] and not in_place[-1]  # the first ones in place, the last copied out
    assert rows.in_place_bytes() <= rows.in_place_budget
    assert rows.made == 70  # every one written for the others all the same
