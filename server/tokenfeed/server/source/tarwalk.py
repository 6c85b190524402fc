"""The tar format as WebDataset shards use it (ustar, pax and GNU long names), read with the
standard library's view of it: a walk over the 512-byte headers that yields each regular
member's name, data offset and size, or the damage that ends it (a header cut short, with
unreadable numbers, or failing its checksum). `walked` verifies the checksums a batch at a time
in numpy and gives the same result as `members`, which verifies each header."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

_BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")
_META = (b"x", b"L", b"g", b"K")
_WINDOW = 2**20


@dataclass(frozen=True)
class Member:
    header: int  # offset of its first header block (pax or long-name headers included)
    name: str
    data: int  # offset of its data
    size: int  # its data's size, as its header says
    end: int  # offset of the next header


@dataclass(frozen=True)
class Damage:
    at: int  # offset of the header that cannot be read
    why: str


def _number(raw: bytes) -> int:
    if raw and raw[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(raw[1:], "big")
    text = raw.split(b"\0", 1)[0].strip(b" \0")
    return int(text, 8) if text else 0


def _pax(payload: bytes) -> dict[bytes, bytes]:
    out, pos = {}, 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        length = int(payload[pos:space])
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        out[key] = value
        pos += length
    return out


class _Window:
    """Reads of a file through a window of `_WINDOW` bytes: a walk over many small members
    costs one read per window, not one per header."""

    def __init__(self, f: BinaryIO):
        self.f, self.lo, self.buf = f, 0, b""

    def read(self, pos: int, n: int) -> bytes:
        at = pos - self.lo
        if at < 0 or at + n > len(self.buf):
            self.f.seek(pos)
            self.lo, self.buf, at = pos, self.f.read(max(n, _WINDOW)), 0
        return self.buf[at : at + n]


def members(f: BinaryIO, size: int, pos: int = 0) -> Iterator[Member | Damage]:
    """The regular-file members from `pos` on, in order; a header that cannot be read ends
    the walk with a `Damage`."""
    return _walk(f, size, pos, None)


def walked(f: BinaryIO, size: int) -> list[Member | Damage]:
    """`list(members(f, size))`, with the headers' checksums verified a batch at a time in numpy
    instead of one Python sum a header (the walk's largest cost). A batch with a header that
    fails walks the tar again header by header, so the result is always `members`'."""
    batch = _Checksums()
    found = []
    try:
        for m in _walk(f, size, 0, batch):
            found.append(m)
            if not batch.hold():
                return list(members(f, size))
    except ValueError:  # a header read before its checksum was (or one with a large payload):
        return list(members(f, size))  # the walk that checks each header says why
    return found if batch.hold(final=True) else list(members(f, size))


class _Checksums:
    """Headers waiting for their checksums to be verified together."""

    BATCH = 4096

    def __init__(self) -> None:
        self.blocks: list[bytes] = []

    def add(self, block: bytes) -> None:
        self.blocks.append(block)

    def hold(self, final: bool = False) -> bool:
        """Whether every header so far holds its checksum (verified once BATCH are waiting,
        or all that wait when `final`); False too for a checksum field that is not a number."""
        if not self.blocks or (len(self.blocks) < self.BATCH and not final):
            return True
        raw = np.frombuffer(b"".join(self.blocks), dtype=np.uint8).reshape(-1, _BLOCK)
        checks, plain = _octal(raw[:, 148:156])
        try:
            for i in np.nonzero(~plain)[0].tolist():
                checks[i] = _number(self.blocks[i][148:156])
        except ValueError:
            return False
        sums = raw.sum(axis=1, dtype=np.int64) - raw[:, 148:156].sum(axis=1, dtype=np.int64)
        bad = np.nonzero(sums + 256 != checks)[0].tolist()
        ok = all(int(checks[i]) == _signed(self.blocks[i]) for i in bad)
        self.blocks = []
        return ok


def _octal(fields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_number` of each row of header fields ([n, width] bytes), and which rows are plain:
    octal digits after spaces, ending at a NUL or spaces (the rest, e.g. base-256 or signs,
    is left to `_number`)."""
    rows = len(fields)
    value = np.zeros(rows, dtype=np.int64)
    started, trailing, nul, odd = (np.zeros(rows, dtype=bool) for _ in range(4))
    for col in fields.T:
        live = ~nul
        digit = live & (col >= 48) & (col <= 55)
        space = live & (col == 32)
        odd |= (digit & trailing) | (live & ~digit & ~space & (col != 0))
        value = np.where(digit, value * 8 + (col.astype(np.int64) - 48), value)
        started |= digit
        trailing |= space & started
        nul |= col == 0
    return value, ~odd


def _walk(
    f: BinaryIO, size: int, pos: int, deferred: _Checksums | None
) -> Iterator[Member | Damage]:
    """`members`; with `deferred`, each header's checksum is left to it (not verified here)."""
    first, long_name, pax = -1, b"", {}
    window = _Window(f)
    while pos < size:
        block = window.read(pos, _BLOCK)
        if len(block) < _BLOCK:
            yield Damage(pos, f"a header cut short at byte {size}")
            return
        if block == bytes(_BLOCK):
            return  # the end-of-archive marker
        try:
            # Deferred, the checksum field is read with the batch's (a field that is not a
            # number fails the batch, and the walk that checks says so).
            check = _number(block[148:156]) if deferred is None else 0
            n = _number(block[124:136])
        except ValueError:
            yield Damage(pos, "a header with unreadable numbers")
            return
        # A header whose payload is read (pax, long names) is checked before a large read.
        if deferred is not None and not (block[156:157] in _META and n > _WINDOW):
            deferred.add(block)
        elif deferred is not None:  # `walked` then walks with the checks, header by header
            raise ValueError(f"a header payload of {n} bytes at byte {pos}")
        elif check != sum(block) - sum(block[148:156]) + 256 and check != _signed(block):
            yield Damage(pos, "a header that fails its checksum")
            return
        kind, head = block[156:157], first if first >= 0 else pos
        if kind in _META:
            payload = window.read(pos + _BLOCK, n) if kind in (b"x", b"L") else b""
            if kind == b"x":
                pax = _pax(payload)
            elif kind == b"L":
                long_name = payload.split(b"\0", 1)[0]
            first, pos = head, pos + _BLOCK + -(-n // _BLOCK) * _BLOCK
            continue
        if b"size" in pax:
            n = int(pax[b"size"])
        name = pax.get(b"path") or long_name or block[:100].split(b"\0", 1)[0]
        if block[257:262] == b"ustar" and not (pax.get(b"path") or long_name):
            prefix = block[345:500].split(b"\0", 1)[0]
            name = prefix + b"/" + name if prefix else name
        end = pos + _BLOCK + -(-n // _BLOCK) * _BLOCK
        if kind in _REGULAR:
            yield Member(head, name.decode("utf-8", "replace"), pos + _BLOCK, n, end)
        first, long_name, pax, pos = -1, b"", {}, end


def _signed(block: bytes) -> int:
    """The checksum as some old tars compute it, over signed bytes (only when the usual one
    fails: it costs a Python loop over the header)."""
    return sum(b - 256 if b > 127 else b for b in block[:148] + b" " * 8 + block[156:])


def key_of(name: str) -> tuple[str, str] | None:
    """(sample key, lower-cased extension) of a member, as webdataset groups them; None for a
    name without an extension (webdataset skips those)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return None if dot <= slash + 1 else (name[:dot], name[dot + 1 :].lower())
