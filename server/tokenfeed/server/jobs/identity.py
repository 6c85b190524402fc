"""What names a job's batches: its fingerprint (everything that decided their bytes as the run
started: the plan at version 1) and the chain of its plan's phases (each phase's start and the
fingerprint of the plan up to it), which every served batch carries (docs/data-plan.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenfeed.server.jobs.fingerprints import fixed_parts, job_fingerprint
from tokenfeed.server.jobs.jobplan import JobPlan
from tokenfeed.server.settings.config import JobSpec
from tokenfeed.server.tokenizer.tokenize import TextTokenizer


class _Planned(Protocol):
    @property
    def fingerprint(self) -> str: ...


class JobIdentity:
    """A job's fingerprint and plan chain, each made once (per plan version for the chain)."""

    def __init__(self, spec: JobSpec, plans: JobPlan):
        self.spec, self.plans = spec, plans
        self._fingerprint = ""
        self._chain: tuple[object, list[tuple[int, str]]] | None = None

    def fingerprint(self, tokenizer: TextTokenizer | None, indexes: Sequence[_Planned]) -> str:
        """Known once the plan log is open and every first dataset's chunks are planned
        (before they are tokenized), empty until then. Before the log is open (a job built by
        hand) it is the config's plan's, not kept."""
        if self._fingerprint:
            return self._fingerprint
        first = self.plans.first
        firsts = indexes[: len(first.datasets)]
        if tokenizer is None or not all(i.fingerprint for i in firsts):
            return ""
        made = job_fingerprint(self.spec, tokenizer, first, [i.fingerprint for i in firsts])
        if self.plans.is_open:
            self._fingerprint = made
        return made

    def chain(
        self, tokenizer: TextTokenizer | None, indexes: Sequence[_Planned]
    ) -> list[tuple[int, str]]:
        """(start step, fingerprint) of each phase of the plan in force (JobPlan.chain): known
        once the tokenizer is loaded and every dataset's chunks are planned, empty until then."""
        plan = self.plans.plan
        if self._chain is not None and self._chain[0] is plan:
            return self._chain[1]
        if tokenizer is None or not all(i.fingerprint for i in indexes):
            return []
        chain = self.plans.chain(
            fixed_parts(self.spec, tokenizer), [i.fingerprint for i in indexes]
        )
        self._chain = (plan, chain)
        return chain
