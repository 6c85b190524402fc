"""Which server answers which rank: target parsing, DNS resolution and rendezvous hashing.

A target names one server (`host:port`), a static list (`host1:port,host2:port`), or a DNS
name that resolves to many addresses (`dns:///tokenfeed.data.svc:50051`, e.g. a Kubernetes
headless Service). Servers are stateless and all load the same jobs from their config, so any
of them can answer any request; the ranking only keeps each (job, rank) on the same server
while it is up, so that server's caches stay warm, and spreads ranks across the fleet.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable

# Status codes after which the next server in the ranking is tried. UNAVAILABLE covers a dead,
# draining or restarting server and a dropped connection; DEADLINE_EXCEEDED a hung one.
FAILOVER_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def _split_host_port(addr: str) -> tuple[str, str]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), port


def parse_target(target: str) -> tuple[str, list[str]]:
    """("static", addresses) or ("dns", [host:port]) for a target string."""
    target = target.strip()
    if not target:
        raise ValueError(
            "empty target: give host:port, a comma-separated list, or dns:///name:port"
        )
    if target.startswith("dns:"):
        name = target[len("dns:") :].lstrip("/")
        if "/" in name:  # dns://authority/name:port: the authority is not supported
            raise ValueError(f"{target!r}: use dns:///name:port (no DNS authority)")
        _split_host_port(name)
        return "dns", [name]
    addrs = [a.strip() for a in target.split(",") if a.strip()]
    for addr in addrs:
        _split_host_port(addr)
    return "static", sorted(set(addrs))


def resolve(name: str) -> list[str]:
    """Every address a DNS name resolves to, as sorted host:port strings."""
    host, port = _split_host_port(name)
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out = set()
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


def rendezvous(addresses: list[str], job: str, rank: int) -> list[str]:
    """Addresses ranked for (job, rank): highest random weight first, stable per address."""

    def weight(addr: str) -> bytes:
        return hashlib.blake2b(f"{job}\0{rank}\0{addr}".encode(), digest_size=8).digest()

    return sorted(addresses, key=weight, reverse=True)


class Fleet:
    """The current set of server addresses; DNS targets are re-resolved at most every
    `refresh_seconds`, and whenever a caller has tried every known server."""

    def __init__(
        self,
        target: str,
        refresh_seconds: float = 30.0,
        resolver: Callable[[str], list[str]] | None = None,
    ):
        self.target = target
        self.kind, self._names = parse_target(target)
        self.refresh_seconds = refresh_seconds
        # name:port -> host:port addresses; DNS unless the caller brings its own service
        # discovery (a fleet that grows and shrinks in a test, a registry).
        self._resolve = resolver or resolve
        self._lock = threading.Lock()
        self._addresses: list[str] = [] if self.kind == "dns" else list(self._names)
        self._resolved_at = -float("inf")

    def addresses(self, force: bool = False) -> list[str]:
        if self.kind == "static":
            return self._addresses
        with self._lock:
            stale = time.monotonic() - self._resolved_at > self.refresh_seconds
            if force or stale or not self._addresses:
                try:
                    found = self._resolve(self._names[0])
                except OSError:
                    found = []
                if found:  # keep the last good answer through a DNS hiccup
                    self._addresses, self._resolved_at = found, time.monotonic()
            return list(self._addresses)

    def ranked(self, job: str, rank: int, force: bool = False) -> list[str]:
        return rendezvous(self.addresses(force), job, rank)
