"""A server under test, run as a child process that announces itself through a ready file.

Both the real daemon (`tokenfeed serve --ready-file`) and the ceiling server (`bench.ceiling`)
write `{"address", "pid"}` as JSON once they accept calls, and drain and exit on SIGTERM. Output
goes to a log file, never to a pipe: a full pipe would stall the server mid-measurement.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench import child_env

POLL_SECONDS = 0.05
# Children start from the repository root, so `python -m bench.ceiling` resolves from anywhere.
ROOT = Path(__file__).resolve().parents[1]


class ServerError(RuntimeError):
    """A child server that did not start, or did not stop when asked."""


@dataclass(frozen=True)
class Stopped:
    returncode: int | None  # None: still running after the timeout, then killed
    seconds: float

    def describe(self) -> str:
        if self.returncode is None:
            return f"did not exit within {self.seconds:.1f}s of SIGTERM (killed)"
        return f"exit code {self.returncode} {self.seconds:.2f}s after SIGTERM"


class ServerProcess:
    def __init__(self, name: str, argv: list[str], workdir: Path):
        self.name = name
        self.argv = argv
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_path = workdir / f"{name}.log"
        self.address = ""
        self._proc: subprocess.Popen | None = None
        self.env: dict | None = None  # the child's environment (None: this process's)

    def start(self, timeout: float) -> str:
        """Launch the server and return its address once the ready file appears."""
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            argv = [*self.argv, "--ready-file", str(self.ready_file)]
            self._proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=child_env() if self.env is None else self.env,
            )
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with {self._proc.returncode} before "
                    f"serving:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise ServerError(
                    f"{self.name} not serving after {timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(POLL_SECONDS)
        info = json.loads(self.ready_file.read_text())
        if info["pid"] != self._proc.pid:
            raise ServerError(
                f"{self.name}: ready file names pid {info['pid']}, started {self._proc.pid}"
            )
        self.address = info["address"]
        return self.address

    def stop(self, timeout: float) -> Stopped:
        """SIGTERM, then wait; a server that outlives the timeout is killed and reported."""
        proc = self._proc
        if proc is None:
            raise ServerError(f"{self.name} was never started")
        start = time.monotonic()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        self._proc = None
        return Stopped(code, time.monotonic() - start)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        # Only reached with the process still set when a measurement failed part-way.
        self.kill()
