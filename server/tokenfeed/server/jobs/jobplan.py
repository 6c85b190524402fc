"""A job's data plan at run time: the version in force (its log's, or the config's until the log
is open), the schedule it makes, its fingerprints, and what each dataset gave the steps so far.

The plan only ever changes after its frozen horizon (dataplan/keeper.py), so a new version
agrees with the old one on every step a server may already serve: swapping it in is one
reference per attribute, safe from any thread.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
from tokenfeed.server.dataplan.keeper import PlanKeeper
from tokenfeed.server.dataplan.model import DataPlan, PlanLog
from tokenfeed.server.sampling.mixture import Phase, Schedule
from tokenfeed.server.settings.config import JobSpec


def schedule_of(plan: DataPlan, seed: int) -> Schedule:
    phases = [Phase(p.start_step, p.global_batch_size, p.weights) for p in plan.phases]
    return Schedule(phases, seed)


@dataclass(frozen=True)
class Consumed:
    """What the steps before `step` took from each dataset (rows, and rows x seq_len)."""

    step: int
    phase: int
    rows: tuple[int, ...]
    tokens: tuple[int, ...]


class JobPlan:
    def __init__(
        self,
        spec: JobSpec,
        keeper: PlanKeeper | None,
        on_change: Callable[[DataPlan, DataPlan], None],
    ):
        self.spec, self.keeper, self._on_change = spec, keeper, on_change
        self.plan = DataPlan.from_spec(spec)
        self.first = self.plan  # version 1 (the log's, once open): what job fingerprints cover
        self.version = 0  # 0: the config's plan, before the log is open
        self.schedule = schedule_of(self.plan, spec.seed)
        self._chains: dict[tuple[int, ...], list[tuple[int, str]]] = {}
        self._opened = asyncio.Event()
        if keeper is not None:
            keeper.listeners.append(self._adopt)

    def _adopt(self, log: PlanLog) -> None:
        """A new version of the log (any thread): the schedule first, then the job's parts."""
        old = self.plan
        self.schedule = schedule_of(log.plan, self.spec.seed)
        self.first = log.origin
        self.plan, self.version = log.plan, log.version
        self._on_change(old, log.plan)

    # ---------------------------------------------------------------- the log

    async def open(self, executor: Executor) -> None:
        """Load the log (blocking I/O, off the loop); nothing to do without one."""
        if self.keeper is not None:
            await asyncio.get_running_loop().run_in_executor(executor, self.keeper.open)
        self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set() or self.keeper is None

    async def opened(self) -> None:
        """Returns once the log is open (the job's build opens it first)."""
        await self._opened.wait()

    async def through(self, step: int, executor: Executor) -> None:
        """Returns once this process holds the final plan for `step` (the log's horizon
        reaches it); NotReadyError when that cannot be confirmed now."""
        keeper = self.keeper
        if keeper is None or keeper.covers(step):
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(executor, keeper.frozen_through, step)

    @property
    def horizon(self) -> int:
        log = self.keeper.current() if self.keeper is not None else None
        return log.horizon if log is not None else -1

    @property
    def served(self) -> int:
        log = self.keeper.current() if self.keeper is not None else None
        return log.served if log is not None else -1

    # ---------------------------------------------------------------- by step

    def phase_at(self, step: int) -> int:
        return self.plan.phase_at(step)

    def seq_len(self, step: int) -> int:
        return self.plan.phases[self.plan.phase_at(step)].seq_len

    def same_phase(self, a: int, b: int) -> bool:
        return self.plan.phase_at(a) == self.plan.phase_at(b)

    def phase_end(self, step: int) -> int | None:
        return self.plan.phase_end(step)

    def step_limit(self, max_step: int) -> int:
        """The first step past the servable ones: every row's stream units stay below
        `max_step` in every phase."""
        widest = max(p.global_batch_size * p.seq_len for p in self.plan.phases)
        return max_step // max(widest, 1)

    # ---------------------------------------------------------------- fingerprints

    def chain(self, base: list[str], datasets: list[str]) -> list[tuple[int, str]]:
        """(start step, fingerprint) of each phase: a hash chain whose first link covers the
        job's fixed parts (`base`) and each link a phase and the content fingerprints of the
        datasets it adds (`datasets`, one per dataset of the plan, in order). Equal chains up
        to a step mean equal batches up to that step."""
        plan = self.plan
        key = (id(plan), *map(hash, base), *map(hash, datasets))
        found = self._chains.get(key)
        if found is not None:
            return found
        link = hashlib.blake2b("\n".join(base).encode(), digest_size=16).digest()
        out, known = [], 0
        names = plan.names
        for p in plan.phases:
            added = datasets[known : len(p.weights)]
            known = len(p.weights)
            text = "\n".join(
                [
                    f"phase={p.start_step}|{p.global_batch_size}|{p.seq_len}",
                    *([f"packing={p.packing}"] if p.packing else []),
                    *(f"weight={n}={w}" for n, w in zip(names, p.weights, strict=False)),
                    *(f"dataset={fp}" for fp in added),
                ]
            )
            link = hashlib.blake2b(link + text.encode(), digest_size=16).digest()
            out.append((p.start_step, link.hex()))
        self._chains = {key: out}
        return out

    # ---------------------------------------------------------------- accounting

    def consumed(self, step: int) -> Consumed:
        """Rows and row tokens of each dataset in the global batches before `step`."""
        plan, schedule = self.plan, self.schedule
        n = len(plan.datasets)
        rows = np.zeros(n, dtype=np.int64)
        tokens = np.zeros(n, dtype=np.int64)
        starts = plan.starts()
        for k, p in enumerate(plan.phases):
            if p.start_step >= step and k:
                break
            end = min(step, starts[k + 1]) if k + 1 < len(starts) else step
            taken = schedule.consumed(end) - schedule.consumed(p.start_step)
            rows += taken
            tokens += taken * p.seq_len
        return Consumed(
            step, plan.phase_at(max(step, 0)), tuple(rows.tolist()), tuple(tokens.tolist())
        )
