"""The bearer tokens a server accepts, and which jobs and calls each one may make.

Tokens come from `server.auth.tokens_file` (re-read when its modification time, size or inode
changes, looked at no more than once a second, so a rotated file takes effect without a
restart) and `server.auth.tokens_env` (read once, at start). A line `token:job1,job2` limits a
token to those jobs. The scope `+admin` (`token:+admin`, or `token:job1,+admin`) lets a token
change a job's data plan (AmendPlan).

Tokens are compared as SHA-256 digests with `hmac.compare_digest`, against every token each
time: neither the content nor the length of a configured token shows in the time a refusal
takes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import AuthSpec

log = logging.getLogger(__name__)

# The scope that lets a token change a job's data plan (auth.py's ADMIN_METHODS).
ADMIN = "+admin"
# A rotated file is seen within this long; a stat() per second costs nothing measurable.
RELOAD_SECONDS = 1.0
# Visible ASCII without the separators of the file format (`:`, `,`, `#`).
_TOKEN_RE = re.compile(r"[!-~]+")
_JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Token:
    digest: bytes  # SHA-256 of the token: only digests are kept and compared
    jobs: frozenset[str] | None = None  # None: every job
    admin: bool = False  # may change a job's data plan

    def allows(self, job: str) -> bool:
        return self.jobs is None or job in self.jobs


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_tokens(text: str, where: str) -> list[Token]:
    """The tokens of a file (or variable): one per line, `token` or `token:job1,job2`; `#`
    starts a comment; blank lines are skipped. Errors name the line, never the token."""
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        secret, sep, scope = line.partition(":")
        if not _TOKEN_RE.fullmatch(secret) or "," in secret:
            raise ConfigError(
                f"{where} line {n}: expected a token of visible ASCII "
                "characters without ':', ',' or '#', then optionally "
                ":job1,job2"
            )
        jobs, admin = None, False
        if sep:
            items = [j.strip() for j in scope.split(",")]
            admin = ADMIN in items
            names = [j for j in items if j != ADMIN]
            bad = [j for j in names if not _JOB_RE.fullmatch(j)]
            if bad:
                raise ConfigError(
                    f"{where} line {n}: expected job names (or {ADMIN}) after ':', got {bad[0]!r}"
                )
            jobs = frozenset(names) if names else None
        tokens.append(Token(digest(secret), jobs, admin))
    return tokens


def match(tokens: list[Token], presented: str) -> Token | None:
    """The token equal to `presented`, comparing against every token (no early exit)."""
    wanted = digest(presented)
    found = None
    for token in tokens:
        if hmac.compare_digest(token.digest, wanted) and found is None:
            found = token
    return found


class TokenSet:
    """The accepted tokens: the file's, re-read when it changes, plus the variable's."""

    def __init__(
        self,
        spec: AuthSpec,
        environ: Mapping[str, str],
        origin: str = "<config>",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = spec.tokens_file
        self._clock = clock
        self._static: list[Token] = []
        self._file: list[Token] = []
        if spec.tokens_env:
            value = environ.get(spec.tokens_env, "")
            where = f"{origin}: server.auth.tokens_env: ${spec.tokens_env}"
            # A variable holds one token per line, or several on one line separated by spaces.
            self._static = parse_tokens("\n".join(value.split()), where)
            if not self._static:
                raise ConfigError(f"{where}: not set or holds no token")
        self._stamp: tuple | None = None
        self._checked = -float("inf")
        if self.path:
            try:
                self._stamp, self._file = self._read()
            except OSError as e:
                raise ConfigError(
                    f"{origin}: server.auth.tokens_file: cannot read {self.path!r}: {e.strerror}"
                ) from None
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
            if not self._file and not self._static:
                raise ConfigError(
                    f"{origin}: server.auth.tokens_file: {self.path!r} holds "
                    "no token: every call would be refused"
                )
            self._checked = clock()

    def _read(self) -> tuple[tuple, list[Token]]:
        st = os.stat(self.path)
        text = Path(self.path).read_text(encoding="utf-8", errors="replace")
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
        return stamp, parse_tokens(text, f"server.auth.tokens_file {self.path}")

    def _refresh(self) -> None:
        now = self._clock()
        if not self.path or now - self._checked < RELOAD_SECONDS:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            if (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev) == self._stamp:
                return
            stamp, tokens = self._read()
        except (OSError, ConfigError) as e:
            # Mid-rotation (a file briefly missing or half written): keep the tokens we have.
            log.warning("server.auth.tokens_file: keeping the previous tokens: %s", e)
            return
        if not tokens:
            log.warning(
                "server.auth.tokens_file: %s holds no token; keeping the previous "
                "tokens (taken for a partly written file)",
                self.path,
            )
            return
        self._stamp, self._file = stamp, tokens
        log.info("server.auth.tokens_file: loaded %d token(s) from %s", len(tokens), self.path)

    def __len__(self) -> int:
        return len(self._static) + len(self._file)

    def check(self, presented: str) -> Token | None:
        self._refresh()
        return match(self._static + self._file, presented)
