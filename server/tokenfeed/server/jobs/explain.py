"""Provenance: where each row of a batch comes from (Explain): per row its dataset and epoch,
per document piece among its inputs the source object, the record ("line N", "row N",
"document N"), the document's token range and the row positions it fills."""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenfeed.server.jobs.job import Job
from tokenfeed.server.pack import packing
from tokenfeed.server.sampling.planner import RowPlan
from tokenfeed.server.source.readers import locate_record


def explain(job: Job, step: int, rank: int, world_size: int) -> list[dict[str, Any]]:
    """Provenance of every row of one rank's batch (reads manifests, may count lines: run it
    off the event loop)."""
    plan = job.plan(step, rank, world_size)
    with job.pinned(plan):
        return explain_rows(job, plan)


def explain_rows(job: Job, plan: RowPlan) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{} for _ in range(plan.rows)]
    for part in plan.parts:
        d, pc = part.dataset, job.planner.pieces(part)
        idx = job.indexes[d]
        cols = (part.slots.tolist(), part.epochs.tolist(), part.rows.tolist())
        for slot, epoch, row in zip(*cols, strict=True):
            rows[slot] = {
                "row": slot,
                "dataset": idx.dataset.name,
                "epoch": epoch,
                "dataset_row": row,
                "pieces": [],
            }
        for i in np.argsort(pc.row * (plan.seq_len + 1) + pc.at, kind="stable"):
            r, e, c = int(pc.row[i]), int(pc.epoch[i]), int(pc.chunk[i])
            job.assembler.chunk(d, c)  # its body (and provenance) in the cache
            provenance = job.store.provenance(idx.keys[c])
            pieces = pieces_of(
                job,
                d,
                e,
                c,
                int(pc.lo[i]),
                int(pc.hi[i]),
                int(pc.at[i]),
                plan.seq_len,
                part.packing == "best_fit",
            )
            for doc, ts, te, rs, re in pieces:
                uri, where = locate_record(
                    idx.storage, idx.chunks[c], provenance, int(provenance.record_ids[doc])
                )
                rows[int(part.slots[r])]["pieces"].append((uri, where, ts, te, rs, re))
    return rows


def pieces_of(
    job: Job,
    d: int,
    epoch: int,
    c: int,
    lo: int,
    hi: int,
    at: int,
    seq_len: int,
    best_fit: bool,
) -> list[tuple[int, int, int, int, int]]:
    """(document, token start, token end, row start, row end) of the documents in a piece
    of chunk c (units [lo, hi) from row position `at`; `best_fit`: unit lo is a best-fit
    row at seq_len)."""
    bos = int(job.assembler.loaded_tokenizer.add_bos)
    if not best_fit:
        return packing.concat_pieces(job.assembler.stream(d, epoch, c), lo, hi, at, seq_len)
    r = lo  # a best_fit unit is a whole row
    layout = job.assembler.bestfit_layout(d, c, seq_len)
    lengths = job.assembler.chunk(d, c).doc_lengths
    out = []
    for p in range(int(layout.row_pieces[r]), int(layout.row_pieces[r + 1])):
        doc, off = int(layout.doc[p]), int(layout.offset[p])
        start, length = int(layout.start[p]), int(layout.length[p])
        a, b = max(off, bos), min(off + length, bos + int(lengths[doc]))  # body slots
        ra, rb = start + a - off, min(start + b - off, seq_len)  # inputs only
        if ra < rb:
            out.append((doc, a - bos, a - bos + rb - ra, ra, rb))
    return out
