"""A phase that changes seq_len: every unit of a dataset's stream is an input of exactly one row,
whatever the chunk sizes, window, change steps and lengths (segments.py, planner.py).

The planner runs on its own over a made-up dataset (units per chunk, no tokens): the rows of
steps 0, 1, 2, ... are located and cut into the pieces of chunks they read (Planner.pieces:
a later segment's own rows, and its carry rows, whose stretches come from the window the
segment before had not finished). Each piece's input positions are mapped back to stream
units; no unit may be an input twice, and after the rows have read three epochs' worth of units,
the first two epochs must be covered whole.
"""

from __future__ import annotations

import os
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenfeed.server.pack import bestfit
from tokenfeed.server.sampling import order
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.sampling.planner import Planner

SEED, NAME = 5, "ds"


class FakeIndex:
    """What the planner reads of a dataset's index (planner.DatasetUnits), READY."""

    def __init__(self, units: list[int], seq_len: int):
        self.dataset = SimpleNamespace(name=NAME)
        self.units_per_chunk = np.array(units, dtype=np.int64)
        self.units_per_epoch = int(self.units_per_chunk.sum())
        self.per_row, self.span, self.seq_len = seq_len, seq_len + 1, seq_len
        self.ready, self.rows_built = True, 0

    def not_built(self, job, step, need):  # pragma: no cover - READY
        raise AssertionError


def planner_for(units, window, batch, phases) -> tuple[Planner, FakeIndex]:
    first = phases[0][1]
    idx = FakeIndex(units, first)
    schedule = Schedule([Phase(s, batch, (Fraction(1),)) for s, _ in phases], SEED)
    spec = SimpleNamespace(
        name="j",
        seed=SEED,
        window_chunks=window,
        packing="concat",
        seq_len=first,
        phases=[SimpleNamespace(global_batch_size=batch)],
    )
    planner = Planner(spec, [idx], schedule)
    starts = [s for s, _ in phases]

    def seq_len(step: int) -> int:
        return phases[int(np.searchsorted(starts, step, side="right")) - 1][1]

    planner.use(schedule, 2**40, seq_len, list(phases))
    return planner, idx


def unit_of(planner: Planner, epoch: int, chunk: int, lo: int, segment: int) -> int:
    lay = planner.layout(0, epoch, segment)
    position = int(np.nonzero(lay.chunk_order == chunk)[0][0])
    return epoch * planner.indexes[0].units_per_epoch + int(lay.units_cum[position]) + lo


@settings(max_examples=40, deadline=None)
@given(
    units=st.lists(st.integers(1, 60), min_size=2, max_size=9),
    window=st.integers(1, 4),
    batch=st.integers(1, 5),
    changes=st.lists(
        st.tuples(st.integers(1, 30), st.integers(2, 41)),
        min_size=1,
        max_size=3,
        unique_by=lambda c: c[0],
    ),
    first=st.integers(2, 17),
)
def test_every_unit_is_an_input_once_across_seq_len_changes(units, window, batch, changes, first):
    phases = [(0, first)] + sorted(changes)
    planner, idx = planner_for(units, window, batch, phases)
    U = idx.units_per_epoch
    seen = np.zeros(4 * U + 200, dtype=np.int64)
    served, step = 0, 0
    while served < 3 * U:
        plan = planner.plan_steps([step], 0, 1)
        L = plan.seq_len
        for part in plan.parts:
            pc = planner.pieces(part)
            for e, c, lo, hi, at in zip(
                pc.epoch.tolist(),
                pc.chunk.tolist(),
                pc.lo.tolist(),
                pc.hi.tolist(),
                pc.at.tolist(),
                strict=True,
            ):
                inputs = max(0, min(hi - lo, L - at))  # the row's last position is a label
                if inputs:
                    u = unit_of(planner, e, c, lo, part.segment)
                    seen[u : u + inputs] += 1
        served += plan.rows * L
        step += 1
    assert seen.max() <= 1, f"unit {int(np.argmax(seen))} is an input twice"
    assert seen[: 2 * U].min() == 1, f"unit {int(np.argmin(seen[: 2 * U]))} never served"


def test_without_a_change_the_first_segment_is_the_dataset_as_before():
    planner, idx = planner_for([30, 7, 50, 12], 2, 3, [(0, 8)])
    (seg,) = planner.segments(0)
    assert (seg.index, seg.first_row, seg.carry_units, seg.start, seg.origin) == (0, 0, 0, 0, 0)
    plan = planner.plan_steps([2], 0, 1)
    (part,) = plan.parts
    lay = order.epoch_layout(idx.units_per_chunk, SEED, NAME, 0, 2, 8, idx.units_per_epoch)
    rows = np.arange(6, 9)
    assert np.array_equal(part.units, order.natural_rows(lay, rows) * 8)


# ---------------------------------------------------------------- phases that change the packing


class DocsIndex(FakeIndex):
    """A made-up dataset with documents: chunk c holds documents of `docs[c]` tokens."""

    def __init__(self, docs: list[list[int]], seq_len: int, packing: str, bos: bool):
        self.docs = [np.array(d, dtype=np.int64) for d in docs]
        self.num_docs = np.array([len(d) for d in docs], dtype=np.int64)
        self.num_tokens = np.array([sum(d) for d in docs], dtype=np.int64)
        if packing == "concat":
            units = (self.num_tokens + self.num_docs * (2 if bos else 1)).tolist()
        else:
            units = [bestfit.bestfit_rows(d, seq_len, bos) for d in self.docs]
        super().__init__(units, seq_len)
        if packing == "best_fit":
            self.per_row, self.span = 1, 1


class Shapes:
    """jobs/shapes.py's ChunkShapes over a DocsIndex, computed on the spot."""

    def __init__(self, idx: DocsIndex, bos: bool):
        self.idx, self.bos = idx, bos

    def concat_units(self, d):
        return self.idx.num_tokens + self.idx.num_docs * (2 if self.bos else 1)

    def bestfit_units(self, d, seq_len):
        return np.array([bestfit.bestfit_rows(x, seq_len, self.bos) for x in self.idx.docs])

    def bestfit_stretches(self, d, seq_len, epoch, chunks, rows):
        out = []
        for c, r in zip(chunks.tolist(), rows.tolist(), strict=True):
            lengths = self.idx.docs[c]
            layout = bestfit.bestfit_layout(lengths, seq_len, self.bos)
            doc_order = order.document_order(len(lengths), SEED, NAME, epoch, c)
            out.append(bestfit.row_stretches(layout, doc_order, r))
        return out


def packing_planner(docs, window, batch, phases, packing, bos):
    first = phases[0][1]
    idx = DocsIndex(docs, first, packing, bos)
    schedule = Schedule([Phase(s, batch, (Fraction(1),)) for s, _, _ in phases], SEED)
    spec = SimpleNamespace(
        name="j",
        seed=SEED,
        window_chunks=window,
        packing=packing,
        seq_len=first,
        phases=[SimpleNamespace(global_batch_size=batch)],
    )
    shapes = Shapes(idx, bos)
    planner = Planner(spec, [idx], schedule, shapes)
    starts = [s for s, _, _ in phases]

    def seq_len(step: int) -> int:
        return phases[int(np.searchsorted(starts, step, side="right")) - 1][1]

    planner.use(schedule, 2**40, seq_len, list(phases))
    return planner, idx, shapes


def placed_units(planner, shapes, part, L):
    """The concat stream units a part's rows place: a concat (or carry) row its inputs, a
    best_fit row every slot of its pieces."""
    pc = planner.pieces(part)
    out = []
    cols = (pc.epoch.tolist(), pc.chunk.tolist(), pc.lo.tolist(), pc.hi.tolist(), pc.at.tolist())
    U = int(shapes.concat_units(0).sum())
    for e, c, lo, hi, at in zip(*cols, strict=True):
        lay = planner.layouts.concat_layout(0, e)
        base = e * U + int(lay.units_cum[int(np.nonzero(lay.chunk_order == c)[0][0])])
        if part.packing == "best_fit":
            for row in shapes.bestfit_stretches(0, L, e, np.array([c]), np.array([lo])):
                out += [np.arange(base + a, base + b) for a, b in row]
        else:
            inputs = max(0, min(hi - lo, L - at))
            out.append(np.arange(base + lo, base + lo + inputs))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@settings(max_examples=int(os.environ.get("SEGMENT_EXAMPLES", 40)), deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=2, max_size=8),
    window=st.integers(1, 3),
    batch=st.integers(1, 4),
    changes=st.lists(
        st.tuples(st.integers(1, 25), st.integers(3, 33), st.sampled_from(["concat", "best_fit"])),
        min_size=1,
        max_size=3,
        unique_by=lambda c: c[0],
    ),
    first=st.integers(3, 17),
    packing=st.sampled_from(["concat", "best_fit"]),
    bos=st.booleans(),
)
def test_every_unit_is_placed_once_across_packing_changes(
    docs, window, batch, changes, first, packing, bos
):
    phases = [(0, first, packing)] + sorted(changes)
    planner, idx, shapes = packing_planner(docs, window, batch, phases, packing, bos)
    U = int(shapes.concat_units(0).sum())
    seen = np.zeros(8 * U + 400, dtype=np.int64)
    step = 0
    while seen[: 2 * U].min() == 0 and step < 50 * U:
        plan = planner.plan_steps([step], 0, 1)
        for part in plan.parts:
            units = placed_units(planner, shapes, part, plan.seq_len)
            np.add.at(seen, units, 1)
        step += 1
    assert seen[: 2 * U].min() == 1, f"unit {int(np.argmin(seen[: 2 * U]))} never placed"
    assert seen.max() <= 1, f"unit {int(np.argmax(seen))} placed twice"


def test_a_best_fit_job_with_phases_of_one_seq_len_keeps_one_segment():
    """Phases that change only the batch size or weights leave a best_fit job's rows as they
    are: the same rows as the job without them (its first segment throughout)."""
    docs = [[5, 9, 3], [12, 2], [7, 7, 7, 1], [30], [4, 4]]
    one, _, _ = packing_planner(docs, 2, 2, [(0, 16, "best_fit")], "best_fit", True)
    two, _, _ = packing_planner(
        docs, 2, 2, [(0, 16, "best_fit"), (4, 16, "best_fit")], "best_fit", True
    )
    assert len(two.segments(0)) == 1
    for step in range(12):
        a, b = one.plan_steps([step], 0, 1), two.plan_steps([step], 0, 1)
        assert [p.units.tolist() for p in a.parts] == [p.units.tolist() for p in b.parts]
