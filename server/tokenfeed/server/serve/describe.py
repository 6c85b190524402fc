"""DescribeJob's answer: a job's description (its datasets, sizes, schedule and state) as a
message."""

from __future__ import annotations

import collections
from collections.abc import Callable
from fractions import Fraction

from tokenfeed.server.indexing.index import READY, DatasetIndex, JobState
from tokenfeed.server.jobs.job import Job
from tokenfeed.v1 import tokenfeed_pb2 as pb

_STATES = {
    JobState.INDEXING: pb.JOB_STATE_INDEXING,
    JobState.READY: pb.JOB_STATE_READY,
    JobState.FAILED: pb.JOB_STATE_FAILED,
}


def num_sources(idx: DatasetIndex) -> int:
    """Distinct source objects of a dataset's chunks: a walk over every chunk."""
    return len({p.source.uri for c in idx.chunks for p in c.pieces})


def _dataset_info(
    idx: DatasetIndex, weight: Fraction, sources: Callable[[DatasetIndex], int]
) -> pb.DatasetInfo:
    ready = idx.state == READY
    return pb.DatasetInfo(
        name=idx.dataset.name,
        weight=str(weight),
        fingerprint=idx.fingerprint,
        num_sources=sources(idx),
        num_chunks=len(idx.chunks),
        chunks_indexed=idx.chunks_indexed,
        num_documents=int(idx.num_docs[idx.num_docs > 0].sum()),
        num_tokens=int(idx.num_tokens[idx.num_tokens > 0].sum()),
        rows_per_epoch=idx.rows_per_epoch if ready else 0,
    )


def job_info(job: Job, sources: Callable[[DatasetIndex], int] = num_sources) -> pb.JobInfo:
    """DescribeJob's answer; `sources` counts a dataset's source objects (the servicer's
    remembers the count per planned chunk list)."""
    s = job.spec
    ready = job.state == READY
    datasets = [
        _dataset_info(i, w, sources) for i, w in zip(job.indexes, s.phases[0].weights, strict=True)
    ]
    bad = sum((i.bad_records for i in job.indexes), start=collections.Counter())
    return pb.JobInfo(
        name=job.name,
        fingerprint=job.fingerprint,
        state=_STATES[job.state],
        error=job.error,
        seq_len=s.seq_len,
        global_batch_size=s.global_batch_size,
        seed=s.seed,
        packing=s.packing,
        num_sources=sum(d.num_sources for d in datasets),
        num_chunks=job.num_chunks,
        chunks_indexed=job.chunks_indexed,
        num_documents=sum(d.num_documents for d in datasets),
        num_tokens=sum(d.num_tokens for d in datasets),
        rows_per_epoch=sum(d.rows_per_epoch for d in datasets) if ready else 0,
        steps_per_epoch=job.steps_per_epoch if ready else 0,
        bad_records=[pb.BadRecordCount(reason=r, count=c) for r, c in sorted(bad.items())],
        tensor_names=list(job.tensor_names),
        datasets=datasets,
        schedule=[
            pb.Phase(
                start_step=p.start_step,
                global_batch_size=p.global_batch_size,
                weights=[str(w) for w in p.weights],
            )
            for p in s.phases
        ],
    )
