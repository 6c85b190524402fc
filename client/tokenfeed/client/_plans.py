"""What a client knows of each job's data plan (docs/data-plan.md), and the checks it makes.

A plan is seen as its chain: (start step, fingerprint) of each phase, the fingerprint covering
the plan up to and including the phase. Two chains decide a step the same way when the
fingerprint of the phase in force at that step is the same in both. From that:

- every batch shows the link of its step (`Batch.plan_phase_start`, `plan_fingerprint`); two
  batches of one phase with two fingerprints mean two plans for one step: refused;
- a checkpoint records the links of the steps it read; on resume they are compared with a
  server's chain, and a plan that decides any of those steps otherwise is refused, naming the
  first step that would change (an amendment of later steps is accepted);
- where servers keep their own plan logs (no shared store), the client compares the chains of
  every server of its target, when a rank reaches a new phase and every `plan_check_seconds`:
  from the first step where they differ, batches are held back until they agree again (a
  rolling change), or the call fails.

No I/O here: the clients fetch the chains (GetPlan) and call these.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from tokenfeed.client.errors import JobMismatch, PlanConflict, PlanRewritten

Link = tuple[int, str]  # (start step of a phase, fingerprint of the plan up to it)
Chain = tuple[Link, ...]


def links_of(phases: Iterable[Any]) -> Chain:
    """A plan's chain from GetPlan's phases (each with start_step and fingerprint)."""
    return tuple(sorted((int(p.start_step), str(p.fingerprint)) for p in phases))


def at(chain: Sequence[Link], step: int) -> str | None:
    """The fingerprint of the phase in force at `step` (None before the first phase)."""
    i = bisect.bisect_right([s for s, _ in chain], step) - 1
    return chain[i][1] if i >= 0 else None


def first_difference(
    a: Sequence[Link], b: Sequence[Link], through: int | None = None
) -> int | None:
    """The first step (at most `through`) that the two chains decide differently, or None."""
    for step in sorted({s for s, _ in a} | {s for s, _ in b} | {0}):
        if through is not None and step > through:
            return None
        if at(a, step) != at(b, step):
            return step
    return None


class PlanWatch:
    """The plan links a client's batches showed, per job, and the step from which the servers
    of its target disagree (set by the fleet check)."""

    def __init__(self) -> None:
        self._links: dict[str, dict[int, tuple[str, str]]] = {}  # job -> start -> (fp, server)
        self._conflicts: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def saw(self, job: str, step: int, start: int, fingerprint: str, server: str) -> bool:
        """Note a batch's link; True if its phase is new to this client. JobMismatch when the
        phase already showed another fingerprint."""
        if not fingerprint:  # a server of an earlier version
            return False
        known = self._links.get(job, {}).get(start)  # a phase seen under this plan: no lock
        if known is not None and known[0] == fingerprint:
            return False
        with self._lock:
            links = self._links.setdefault(job, {})
            seen = links.get(start)
            if seen is None:
                links[start] = (fingerprint, server)
                return True
        if seen[0] != fingerprint:
            raise JobMismatch(
                f"job {job!r}: step {step} came from server {server} under plan {fingerprint} "
                f"(its phase from step {start}), but server {seen[1]} served that phase under "
                f"{seen[0]}: the servers hold two plans for it; their plan logs must agree "
                "(a shared store keeps one)"
            )
        return False

    def links(self, job: str, before: int) -> Chain:
        """The links of the phases of steps before `before` this client has read."""
        with self._lock:
            found = self._links.get(job, {})
            return tuple(sorted((s, fp) for s, (fp, _) in found.items() if s < before))

    def conflict(self, job: str) -> tuple[int, str] | None:
        return self._conflicts.get(job)  # one lookup, atomic: asked for every batch

    def compare(self, job: str, chains: dict[str, Chain]) -> tuple[int, str] | None:
        """The servers' chains compared: (the first step two of them decide differently, why),
        remembered for the job, or None (then a remembered conflict is cleared)."""
        found: tuple[int, str] | None = None
        items = sorted(chains.items())
        for i, (a, ca) in enumerate(items):
            for b, cb in items[i + 1 :]:
                step = first_difference(ca, cb)
                if step is not None and (found is None or step < found[0]):
                    found = (
                        step,
                        f"servers {a} and {b} hold different plans from step {step} "
                        f"({at(ca, step)} and {at(cb, step)})",
                    )
        with self._lock:
            if found is None:
                self._conflicts.pop(job, None)
            else:
                self._conflicts[job] = found
        return found


def check_resume(job: str, recorded: Sequence[Link], next_step: int, server: Chain) -> None:
    """A checkpoint's links against a server's chain: PlanRewritten naming the first step the
    run read (before `next_step`) that the server's plan decides otherwise."""
    if not recorded or not server:
        return
    step = first_difference(recorded, server, through=next_step - 1)
    if step is not None:
        raise PlanRewritten(
            f"job {job!r}: the servers' data plan decides step {step} otherwise than when this "
            f"run read it (checkpoint at step {next_step}: plan {at(recorded, step)}, now "
            f"{at(server, step)}); a change may only start after the steps a run has read: "
            "restore the plan (or the job's seed and sources), or start a new run",
            step,
        )


def held(watch: PlanWatch, job: str, step: int) -> tuple[int, str] | None:
    """The servers' disagreement a batch of `step` is held back by, if any."""
    conflict = watch.conflict(job)
    return conflict if conflict is not None and step >= conflict[0] else None


def held_too_long(job: str, step: int, conflict: tuple[int, str]) -> PlanConflict:
    if conflict[0] == 0:  # no change of plan starts at step 0: the job itself differs
        return PlanConflict(
            f"job {job!r}: {conflict[1]}: the servers define this job differently (another "
            "seed, tokenizer or sources); give them one config",
            0,
        )
    return PlanConflict(
        f"job {job!r}: step {step} not handed over: {conflict[1]}; make the servers' plans "
        "agree (tokenfeed plan show/append on each), or give them a shared store",
        conflict[0],
    )


def check_agreed(job: str, step: int, fingerprint: str, server: str, chains: dict) -> None:
    """Once the servers agree: a batch made under a plan they no longer hold is refused."""
    agreed = next(iter(chains.values()), ())
    if at(agreed, step) not in (None, fingerprint):
        raise PlanConflict(
            f"job {job!r}: step {step} came from server {server} under a plan the servers no "
            f"longer hold ({fingerprint}); ask for it again",
            step,
        )


class ReadRecord:
    """What one rank has read, for its checkpoint: the job's fingerprint (the first seen binds
    the run) and the plan links of the phases read (the trainer adapters and the torch
    dataset keep one each)."""

    def __init__(self, job: str):
        self.job, self.job_fingerprint = job, ""
        self.plan_links: dict[int, str] = {}  # phase start -> plan fingerprint

    def check(self, fingerprint: str, source: str) -> None:
        """Adopt the first job fingerprint seen; refuse any other after it."""
        if self.job_fingerprint and fingerprint and fingerprint != self.job_fingerprint:
            raise JobMismatch(
                f"job {self.job!r}: {source} has job fingerprint {fingerprint}, but this run "
                f"(or its checkpoint) read {self.job_fingerprint}; the job's definition "
                "changed since the checkpoint"
            )
        self.job_fingerprint = self.job_fingerprint or fingerprint

    def saw(
        self, job_fingerprint: str, phase_start: int, plan_fingerprint: str, server: str
    ) -> None:
        self.check(job_fingerprint, f"server {server}")
        if plan_fingerprint:
            self.plan_links[phase_start] = plan_fingerprint

    def links(self, next_step: int) -> Chain:
        """The links of the phases of the steps read (those before `next_step`)."""
        return tuple(sorted((s, f) for s, f in self.plan_links.items() if s < next_step))
