"""The one checkpoint record of every trainer adapter: where the data stream resumes.

A batch is a pure function of (step, rank, world size) on the servers, so the next global step
is all a run needs to resume, at the same or another data-parallel size. The job's name guards
against loading a checkpoint into the wrong job; `job_fingerprint` (the servers' definition of
the job when the run started, empty before the first batch) against a job whose definition
changed since; `plan` (the data plan's links of the phases the run read: start step and
fingerprint, docs/data-plan.md) against a plan that decides a step the run read otherwise,
while accepting one amended for later steps. A field added here reaches every adapter at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The version of the record's layout; a record of a newer version is refused, not guessed at.
# 2: `plan` (a record of version 1 has none: nothing of the plan is checked on resume).
VERSION = 2


@dataclass(frozen=True)
class FeedState:
    next_step: int
    job: str
    job_fingerprint: str = ""
    plan: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.next_step, int) or self.next_step < 0:
            raise ValueError(f"next_step must be an integer >= 0, got {self.next_step!r}")
        if not self.job:
            raise ValueError("job must be named")

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (ints, strings and lists of them): every checkpoint format
        stores them."""
        out = {"version": VERSION, **asdict(self)}
        out["plan"] = [[int(s), str(f)] for s, f in self.plan]
        return out

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
        links = raw.get("plan") or ()
        try:
            plan = tuple((int(s), str(f)) for s, f in links)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"tokenfeed state: plan must be [[step, fingerprint], ...]: {e}"
            ) from None
        return cls(
            next_step=int(raw["next_step"]),
            job=str(raw["job"]),
            job_fingerprint=str(raw.get("job_fingerprint", "") or ""),
            plan=plan,
        )
