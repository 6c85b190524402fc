"""tiktoken as an exact engine for the byte-level BPE tokenizer.json files it can reproduce.

`FastEngine.from_config` builds a `tiktoken.Encoding` from the tokenizer's own JSON (nothing is
downloaded) or raises `NotExact` with the reason it cannot promise HF's ids:
- the model is a byte-level BPE: every vocabulary string maps back to bytes through GPT-2's
  byte<->unicode table, all 256 single bytes are in the vocabulary, and the mergeable ranks are
  those bytes followed by each merge's product in merge order (HF's merge priority);
- the pre-tokenizer is `ByteLevel(use_regex)` (GPT-2's pattern) or `Split(Regex) +
  ByteLevel(use_regex=false)` with a pattern of the known families below, as tiktoken's
  `pat_str`; no normalizer, no prefix space;
- the added tokens HF splits out of a document (with `add_special_tokens=False` too) become
  tiktoken's special tokens, all allowed; they must match plainly (no lstrip/rstrip/single_word)
  and never overlap, so tiktoken's first match is HF's leftmost-longest one.

Why the ranks agree. HF merges the adjacent pair of lowest merge rank; tiktoken the adjacent pair
whose concatenated bytes has the lowest rank, so it may also join a pair that is not the merge
that made the product. `_check_merges` requires, for each merge (u, v) -> X, that tiktoken's own
rule on X's bytes, with ranks below X's, ends at exactly [u, v]. Then inside any word, the parts
covering X's bytes evolve as on X alone, so whenever tiktoken joins two parts into X they are
u and v: every tiktoken step is an HF merge of the same (lowest) rank, leftmost first in both.
A merge table that breaks this (or a product made by two merges) is refused. tiktoken also
takes a whole pre-token found in its ranks as one token; by the same argument BPE would make that
token anyway. HF's `ignore_merges` does the same over its whole vocabulary, so it is allowed
only where no other entry can be found that way.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import random
import threading
from typing import Any

import numpy as np

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Split patterns tiktoken's regex engine reads as HF's Oniguruma does: GPT-4's (cl100k, as in
# Llama-3) and its variant with single digits. Any other pattern is refused.
SPLIT_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
# A thread task: up to this many documents, and no more characters than this (a longer
# document is a task of its own). Tasks go largest first, so a batch's long documents do not
# leave the other threads idle at its end: with documents of a few KB and a few of 100 KB or
# more, tasks of 32 documents left a build at 0.7 of bare tiktoken (bench/, tokenization).
_DOCS_PER_TASK = 32
_CHARS_PER_TASK = 64 * 1024


class NotExact(ValueError):
    """This tokenizer's ids cannot be reproduced exactly by tiktoken; the message says why."""


def byte_alphabet() -> dict[str, int]:
    """GPT-2's table: the printable character that stands for each byte in a vocabulary."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _pattern(pre: dict | None) -> str:
    def byte_level(p: dict, use_regex: bool) -> bool:
        if p.get("type") != "ByteLevel":
            return False
        if p.get("add_prefix_space"):
            raise NotExact("the ByteLevel pre-tokenizer adds a prefix space")
        return bool(p.get("use_regex", True)) == use_regex

    if pre is None:
        raise NotExact("there is no pre-tokenizer (not a byte-level BPE)")
    if byte_level(pre, True):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and byte_level(steps[1], False):
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise NotExact(f"the Split pre-tokenizer is {split.get('behavior')}, not Isolated")
        if regex not in SPLIT_PATTERNS:
            raise NotExact(f"the Split pattern {regex!r} is not one tiktoken is known to match")
        return regex
    raise NotExact(f"the pre-tokenizer {_describe(pre)} is not ByteLevel or Split + ByteLevel")


def _describe(part: dict) -> str:
    if part.get("type") == "Sequence":
        inner = part.get("pretokenizers") or part.get("normalizers") or []
        return "Sequence[" + ", ".join(_describe(p) for p in inner) + "]"
    return str(part.get("type"))


def _merge_rule(ranks: dict[bytes, int], piece: bytes, limit: int) -> list[bytes]:
    """tiktoken's rule on one piece, using only ranks below `limit`: join the adjacent parts
    whose bytes have the lowest rank, leftmost first, until none is below `limit`."""
    bounds = list(range(len(piece) + 1))
    pairs = [ranks.get(piece[i : i + 2], limit) for i in range(len(piece) - 1)]
    while pairs and (best := min(pairs)) < limit:
        i = pairs.index(best)
        del bounds[i + 1], pairs[i]
        if i > 0:
            pairs[i - 1] = ranks.get(piece[bounds[i - 1] : bounds[i + 1]], limit)
        if i < len(pairs):
            pairs[i] = ranks.get(piece[bounds[i] : bounds[i + 2]], limit)
    return [piece[a:b] for a, b in itertools.pairwise(bounds)]


def _check_merges(ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]]) -> None:
    for i, (u, v) in enumerate(merges):
        if len(u) == len(v) == 1:
            continue  # two bytes: nothing else to join
        parts = _merge_rule(ranks, u + v, 256 + i)
        if parts != [u, v]:
            raise NotExact(
                f"merge {i} ({u!r} + {v!r}) is not how tiktoken's rank rule splits {u + v!r} "
                f"(it reaches {parts!r})"
            )


def _added_tokens(config: dict, encode_special_tokens: bool) -> dict[str, int]:
    """The added tokens HF splits out of documents, by content, with their ids."""
    found = {}
    for t in config.get("added_tokens") or []:
        if t.get("special") and encode_special_tokens:
            continue  # HF encodes these as text
        content = t["content"]
        flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)]
        if flags:
            raise NotExact(f"the added token {content!r} matches with {', '.join(flags)}")
        if not content:
            raise NotExact(f"the added token {t['id']} is empty")
        found[content] = int(t["id"])
    starts: dict[str, list[str]] = {}
    for b in found:
        for k in range(1, len(b)):
            starts.setdefault(b[:k], []).append(b)
    for a in found:
        inside = [b for b in found if a != b and a in b]
        ends = [b for k in range(1, len(a)) for b in starts.get(a[k:], ()) if b != a]
        if inside or ends:
            raise NotExact(f"the added tokens {a!r} and {(inside + ends)[0]!r} overlap")
    return found


class FastEngine:
    """A tiktoken Encoding with the HF ids of its ranks, encoding documents on a thread pool
    (tiktoken releases the GIL while it encodes)."""

    def __init__(self, encoding, rank_to_id: np.ndarray | None, threads: int | None = None):
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self._luts: dict[np.dtype, np.ndarray] = {}
        self._allowed = frozenset(encoding.special_tokens_set)
        self._threads = threads or len(os.sched_getaffinity(0))
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: dict[str, Any], encode_special_tokens: bool = False):
        """From a tokenizer.json's parsed content; `NotExact` when it cannot be exact."""
        import tiktoken  # only where the engine is asked for

        if config.get("normalizer") is not None:
            raise NotExact(f"the tokenizer has a normalizer ({_describe(config['normalizer'])})")
        model = config.get("model") or {}
        if model.get("type") != "BPE":
            raise NotExact(f"the model is {model.get('type')}, not BPE")
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise NotExact(f"the BPE model sets {key}={model[key]!r}")
        if model.get("byte_fallback"):
            raise NotExact("the BPE model sets byte_fallback")
        pat_str = _pattern(config.get("pre_tokenizer"))
        alphabet = byte_alphabet()
        vocab: dict[str, int] = model.get("vocab") or {}

        def to_bytes(s: str) -> bytes:
            try:
                return bytes(alphabet[c] for c in s)
            except KeyError as e:
                raise NotExact(f"the vocabulary entry {s!r} is not byte-level") from e

        missing = [c for c in alphabet if c not in vocab]
        if missing:
            raise NotExact(f"{len(missing)} single bytes are not in the vocabulary")
        ranks = {bytes([b]): b for b in range(256)}
        ids = [vocab[s] for s, _ in sorted(alphabet.items(), key=lambda kv: kv[1])]
        merges = []
        for m in model.get("merges") or []:
            u, v = m.split(" ") if isinstance(m, str) else m
            if u not in vocab or v not in vocab or u + v not in vocab:
                raise NotExact(f"the merge {u!r} + {v!r} names a token not in the vocabulary")
            product = to_bytes(u + v)
            if product in ranks:
                raise NotExact(f"the token {u + v!r} is made by two merges")
            ranks[product] = len(ids)
            ids.append(vocab[u + v])
            merges.append((to_bytes(u), to_bytes(v)))
        _check_merges(ranks, merges)
        added = _added_tokens(config, encode_special_tokens)
        if model.get("ignore_merges"):
            # HF takes a whole pre-token found in its vocabulary as one token. Safe for the
            # mergeable ones, for entries no pre-token can spell (a character outside the byte
            # table), and for added tokens of printable ASCII (a document spelling one has it
            # split out before pre-tokenizing); any other entry would be HF's alone.
            stray = [
                s
                for s in vocab
                if all(c in alphabet for c in s)
                and to_bytes(s) not in ranks
                and not (s in added and all("!" <= c <= "~" for c in s))
            ]
            if stray:
                raise NotExact(f"ignore_merges with {len(stray)} unmergeable entries: {stray[0]!r}")
        specials = {content: len(ids) + k for k, content in enumerate(added)}
        ids.extend(added.values())
        rank_to_id = np.asarray(ids, dtype=np.int64)
        identity = bool((rank_to_id == np.arange(len(ids))).all())
        encoding = tiktoken.Encoding(
            "tokenfeed", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials
        )
        return cls(encoding, None if identity else rank_to_id)

    def _encode_group(self, texts: list[str]) -> list[np.ndarray]:
        enc = self.encoding.encode_to_numpy
        return [enc(t, allowed_special=self._allowed, disallowed_special=()) for t in texts]

    def encode(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """All documents' HF ids concatenated in `dtype`, and each document's length (int32)."""
        with self._pool_lock:
            # A forked child inherits the pool object but none of its threads.
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = cf.ThreadPoolExecutor(self._threads, thread_name_prefix="tiktoken")
                self._pool_pid = os.getpid()
        groups = _tasks(texts)
        pool = self._pool
        by_size = sorted(range(len(groups)), key=lambda g: -sum(map(len, groups[g])))
        futures = {g: pool.submit(self._encode_group, groups[g]) for g in by_size}
        arrays = [a for g in range(len(groups)) for a in futures[g].result()]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int32, count=len(arrays))
        ranks = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)
        if self.rank_to_id is None:
            return ranks.astype(dtype), lengths
        lut = self._luts.get(dtype)
        if lut is None:
            lut = self._luts[dtype] = self.rank_to_id.astype(dtype)
        return lut[ranks], lengths


def _tasks(texts: list[str]) -> list[list[str]]:
    """The texts cut, in order, into runs of at most _DOCS_PER_TASK documents and (but for a
    longer document alone) _CHARS_PER_TASK characters."""
    out: list[list[str]] = []
    run: list[str] = []
    chars = 0
    for t in texts:
        if run and (len(run) == _DOCS_PER_TASK or chars + len(t) > _CHARS_PER_TASK):
            out.append(run)
            run, chars = [], 0
        run.append(t)
        chars += len(t)
    if run:
        out.append(run)
    return out


# The load-time parity sample, by theme: where two engines could part.
_SPACES = (" ", "  ", "   x", "\t", "\t\t x", "\n", "\n\n\n", "\r\n", " \r\n\t \n", "a \n\n b")
_MORE_SPACES = ("x   \t\n  y", "ends   ", "  \n  ", "\xa0\u2003\u3000\x85\u2028\u2029\u1680\u202f")
_DIGITS = ("0", "12", "123", "1234", "1234567890123", "3.14159", "1,000,000", "x2y3z", "v1.2.3")
_OTHER_DIGITS = ("\u0663\u0664\u0665 \u2460\u2461 \u216b \xbd \uff11\uff12",)
_CONTRACTIONS = ("I'm you're we've they'll he'd it's", "can't I'M YOU'RE It'S ''s 's' rock'n'roll")
_LATIN = ("na\xefve caf\xe9 \xdf \u1e9e", "e\u0301\u0301 a\u0308o\u0323\u0302 \u0915\u094d\u0937")
_SCRIPTS = (
    "\u65e5\u672c\u8a9e\u306e\u4e2d\u6587\u3002",
    "\ud55c\uad6d\uc5b4 \u0e44\u0e17\u0e22 \u05e2\u05d1 \u0645",
)
_EMOJI = ("\U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb",)
_INVISIBLE = (
    "\u200b\u200d\ufeff\u2060\u180e",
    "\x00\x01\x7f\x1b[0m\x0b\x0c",
    "\U0001d518\U00010348",
)
_LONG = ("-" * 1000, " " * 700 + "x", "\n" * 300, "A" * 3000, "abc" * 1500, "\xe9" * 900)
_WORD = "pneumonoultramicroscopicsilicovolcanoconiosis"


def edge_sample(added: tuple[str, ...] = ()) -> list[str]:
    """The texts above, random mixes and long words of their characters and of others across
    the code space, and every added token in and out of context; the same on every load."""
    fixed = [
        *(_SPACES + _MORE_SPACES + _DIGITS + _OTHER_DIGITS + _CONTRACTIONS + _LATIN),
        *(_SCRIPTS + _EMOJI + _INVISIBLE + _LONG + (_WORD * 40,)),
    ]
    rng = random.Random(0x70CE)
    pool = [c for t in fixed for c in t] + [chr(rng.randrange(0x20, 0x30000)) for _ in range(400)]
    pool = [c for c in pool if not 0xD800 <= ord(c) < 0xE000]
    mixed = ["".join(rng.choices(pool, k=rng.randint(1, 120))) for _ in range(300)]
    letters = [c for c in pool if c.isalpha()]
    words = ["".join(rng.choices(letters, k=rng.randint(100, 2000))) for _ in range(10)]
    contexts = [s for t in added for s in (t, t + t, f"x{t}y", f" {t} \n", t[:-1], t[1:])]
    return fixed + mixed + words + contexts
