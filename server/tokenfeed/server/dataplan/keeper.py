"""One job's plan log as this process knows it, and the only code that writes it.

The log is one blob (`plans/<job>.json`): in the cache directory for a lone server (every
process of the server shares it), under the shared store's prefix for a fleet. Every write is
conditional on the version read (S3's If-Match / If-None-Match, a locked compare on a
directory), so two writers never overwrite each other: the loser reads again and decides again.
No clocks, leases or consensus of our own (docs/data-plan.md):

- a server serves step s only from a log whose horizon H reaches s; to go further it moves H on
  itself, `freeze_ahead` steps past the furthest step it serves, by a conditional write
  (`frozen_through`): the plan through H can no longer change, so any server holding a log with
  H >= s has the final plan for s, however stale its copy otherwise is;
- a change appends a phase at a step after H, by a conditional write (`append`);
- a server that cannot read or write the log cannot confirm the plan past its copy's H: it
  refuses those steps (NotReadyError: UNAVAILABLE with a retry hint), never guesses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from tokenfeed.server.dataplan.model import (
    Amendment,
    PlanLog,
    PlanPhase,
    amend,
    identity,
    merge_config,
    new_log,
)
from tokenfeed.server.errors import LocalError, NotReadyError, PlanChangedError
from tokenfeed.server.settings.config import JobSpec
from tokenfeed.server.store.blobs import Conflict

log = logging.getLogger(__name__)

# Steps frozen past the furthest step a server serves when it moves the horizon on: a write
# per this many steps of a job, and how far ahead of the fleet a change must start
# (server.plan_freeze_steps).
FREEZE_AHEAD_STEPS = 64
RETRY_AFTER_SECONDS = 1.0  # the hint of a refusal while the log cannot be reached


class Blobs(Protocol):
    """Where the log lives (store/blobs.py): a directory or an `s3://` prefix."""

    def get_tagged(self, name: str) -> tuple[bytes | None, str]: ...

    def put_if(self, name: str, data: bytes, expected: str) -> str: ...

    def put(self, name: str, data: bytes) -> None: ...


class PlanKeeper:
    def __init__(
        self,
        spec: JobSpec,
        blobs: Blobs,
        where: str,
        origin: str = "<config>",
        freeze_ahead: int = FREEZE_AHEAD_STEPS,
    ):
        self.spec, self.blobs, self.origin = spec, blobs, origin
        self.name = f"plans/{spec.name}.json"
        self.where = f"{where.rstrip('/')}/{self.name}"  # for messages
        self.freeze_ahead = max(1, freeze_ahead)
        self.log: PlanLog | None = None
        self.note = ""  # what opening did with the config's plan
        self.listeners: list[Callable[[PlanLog], None]] = []  # told of each new version
        self._lock = threading.Lock()  # one writer per process; the blob's condition for all

    # ---------------------------------------------------------------- reading

    def _read(self) -> tuple[PlanLog | None, str]:
        try:
            raw, tag = self.blobs.get_tagged(self.name)
        except LocalError:
            raise
        except OSError as e:
            raise LocalError(f"plan log {self.where}: {e}") from e
        return (None, tag) if raw is None else (PlanLog.from_bytes(raw, self.where), tag)

    def _read_existing(self) -> tuple[PlanLog, str]:
        found, tag = self._read()
        if found is None:
            raise LocalError(f"plan log {self.where} is missing")
        return found, tag

    def _write(self, new: PlanLog, tag: str) -> str:
        try:
            return self.blobs.put_if(self.name, new.to_bytes(), tag)
        except (LocalError, Conflict):
            raise
        except OSError as e:
            raise LocalError(f"plan log {self.where}: {e}") from e

    def _adopt(self, new: PlanLog) -> PlanLog:
        old = self.log
        if old is None or (new.version, new.revision) > (old.version, old.revision):
            self.log = new
            if old is None or new.version != old.version:
                for listener in self.listeners:
                    listener(new)
        return self.log or new

    def open(self) -> PlanLog:
        """Blocking: load the job's log, creating it from the config if there is none, starting
        a new one if the config is another run (another seed, tokenizer or first datasets: the
        old log is kept beside it), or appending the config's later phases to it."""
        with self._lock:
            while True:
                found, tag = self._read()
                if found is None:
                    new = new_log(self.spec, self.origin)
                    self.note = "created from the config"
                elif found.identity != identity(self.spec):
                    # Another run under this job's name: the old record is kept, and clients
                    # that read the old run are refused from step 0 on by the fingerprints.
                    self.blobs.put(
                        f"plans/{self.spec.name}.{found.identity}.json", found.to_bytes()
                    )
                    new = new_log(self.spec, self.origin)
                    self.note = (
                        f"the config defines another run than the log's (kept as "
                        f"plans/{self.spec.name}.{found.identity}.json): started a new log"
                    )
                    log.warning("job %s: %s", self.spec.name, self.note)
                else:
                    merged, self.note = merge_config(found, self.spec)
                    if merged is None:
                        if "differs" in self.note:
                            log.warning("job %s: %s", self.spec.name, self.note)
                        return self._adopt(found)
                    new = found.with_plan(merged, {"what": f"{self.note} ({self.origin})"})
                try:
                    self._write(new, tag)
                except Conflict:
                    continue  # another server wrote it meanwhile: look again
                return self._adopt(new)

    def refresh(self) -> PlanLog:
        """Blocking: the newest log (a server picks up changes made elsewhere)."""
        found, _ = self._read()
        if found is None:
            raise LocalError(f"plan log {self.where} is gone")
        return self._adopt(found)

    # ---------------------------------------------------------------- serving

    def current(self) -> PlanLog | None:
        return self.log

    def covers(self, step: int) -> bool:
        """Whether this process's copy is final through `step` (no I/O)."""
        found = self.log
        return found is not None and found.horizon >= step

    def frozen_through(self, step: int) -> PlanLog:
        """Blocking: a log whose horizon reaches `step`, moving the horizon on if needed.
        NotReadyError when the log cannot be read or written now."""
        found = self.log
        if found is not None and found.horizon >= step:
            return found
        with self._lock:
            try:
                while True:
                    found, tag = self._read_existing()
                    if found.horizon >= step:
                        return self._adopt(found)
                    new = found.with_horizon(step + self.freeze_ahead, step)
                    try:
                        self._write(new, tag)
                    except Conflict:
                        continue
                    return self._adopt(new)
            except LocalError as e:
                raise self._unreachable(
                    f"this server cannot confirm the data plan for step {step} ({e}); retry, "
                    "or ask another server"
                ) from e

    # ---------------------------------------------------------------- changing

    def append(
        self, change: Amendment, who: str, expected_version: int = 0
    ) -> tuple[PlanLog, list[PlanPhase]]:
        """Blocking: the log with a phase appended (amend's checks), written conditionally;
        the phases it replaced. PlanChangedError when `expected_version` (0: any) is not the
        log's; NotReadyError when the log cannot be reached."""
        with self._lock:
            try:
                while True:
                    found, tag = self._read_existing()
                    if expected_version and found.version != expected_version:
                        raise PlanChangedError(
                            f"job {self.spec.name}: the plan is at version {found.version}, "
                            f"not {expected_version}; read it again and make the change "
                            "against what it is now"
                        )
                    plan, replaced = amend(
                        found.plan, change, found.horizon, found.served, self.spec
                    )
                    entry = {
                        "what": f"phase from step {change.start_step} appended"
                        + (f", replacing {len(replaced)} future phase(s)" if replaced else ""),
                        "by": who,
                    }
                    new = found.with_plan(plan, entry)
                    try:
                        self._write(new, tag)
                    except Conflict:
                        continue
                    log.info(
                        "job %s: plan version %d: %s by %s",
                        self.spec.name,
                        new.version,
                        entry["what"],
                        who,
                    )
                    return self._adopt(new), replaced
            except LocalError as e:
                raise self._unreachable(
                    f"the plan log {self.where} cannot be changed now ({e}); nothing changed, retry"
                ) from e

    def _unreachable(self, why: str) -> NotReadyError:
        """UNAVAILABLE with a retry hint: another server, or a later try, may do better."""
        return NotReadyError(f"job {self.spec.name}: {why}", retry_after=RETRY_AFTER_SECONDS)
