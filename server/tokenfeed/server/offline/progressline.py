"""The progress line of an offline build (`tokenfeed build`, and `--ray`'s): chunks, documents,
tokens, MB/s of source and ETA, redrawn in place on a TTY."""

from __future__ import annotations

import time
from typing import TextIO

from tokenfeed.server.offline.chunkbuild import Done


class ProgressLine:
    """One line: chunks, documents, tokens, MB/s of source, ETA; redrawn in place on a TTY."""

    def __init__(self, out: TextIO, total_chunks: int, total_bytes: int, interval=1.0):
        self.out, self.interval = out, interval
        self.total_chunks, self.total_bytes = total_chunks, total_bytes
        self.chunks = self.skipped = self.docs = self.tokens = self.bytes = self.tokenized = 0
        self.started = self._drawn = time.monotonic()
        self.tty = out.isatty()

    def add(self, done: Done) -> None:
        self.chunks += 1
        self.docs += done.entry.num_docs
        self.tokens += done.entry.num_tokens
        if done.tokenized:
            self.tokenized += 1
            self.bytes += done.raw_bytes
        else:
            self.skipped += 1
            self.total_bytes -= done.raw_bytes
        if time.monotonic() - self._drawn >= self.interval or self.chunks == self.total_chunks:
            self.draw()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.bytes / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.chunks / max(self.total_chunks, 1)
        return (
            f"[{pct:5.1f}%] {self.chunks}/{self.total_chunks} chunks, {self.docs:,} docs, "
            f"{self.tokens:,} tokens, {rate / 1e6:.2f} MB/s, "
            f"{self.tokens / elapsed / 1e6:.2f} M tokens/s, ETA {eta}"
        )

    def draw(self) -> None:
        self._drawn = time.monotonic()
        if self.tty:
            self.out.write("\r" + self.line() + "\x1b[K")
        else:
            self.out.write(self.line() + "\n")
        self.out.flush()
