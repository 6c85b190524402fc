"""The one checkpoint record of every trainer adapter: where the data stream resumes.

A batch is a pure function of (step, rank, world size) on the servers, so the next global step
is all a run needs to resume, at the same or another data-parallel size. The job's name guards
against loading a checkpoint into the wrong job; `job_fingerprint` (the servers' definition of
the job when the checkpoint was taken, empty before the first batch) against a job whose
definition changed since. A field added here reaches every adapter at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The version of the record's layout; a record of a newer version is refused, not guessed at.
VERSION = 1


@dataclass(frozen=True)
class FeedState:
    next_step: int
    job: str
    job_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.next_step, int) or self.next_step < 0:
            raise ValueError(f"next_step must be an integer >= 0, got {self.next_step!r}")
        if not self.job:
            raise ValueError("job must be named")

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (ints and strings): every checkpoint format stores them."""
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> FeedState:
        """A record from `to_dict`'s output, as a checkpoint gives it back (numbers may come
        back as tensors or numpy scalars); ValueError saying what is wrong."""
        if not hasattr(raw, "get"):
            raise ValueError(f"tokenfeed state must be a mapping, got {type(raw).__name__}")
        version = int(raw.get("version", VERSION))
        if version > VERSION:
            raise ValueError(
                f"tokenfeed state of version {version}: this client reads up to {VERSION}; "
                "upgrade tokenfeed-client"
            )
        if "next_step" not in raw or "job" not in raw:
            raise ValueError(f"tokenfeed state needs next_step and job, got {sorted(raw)}")
        return cls(
            next_step=int(raw["next_step"]),
            job=str(raw["job"]),
            job_fingerprint=str(raw.get("job_fingerprint", "") or ""),
        )
