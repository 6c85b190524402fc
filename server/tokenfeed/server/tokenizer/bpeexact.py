"""Which byte-level BPE tokenizer.json files tiktoken reproduces exactly, and their encoding.

`exact_encoding` builds a `tiktoken.Encoding` from the tokenizer's own JSON (nothing is
downloaded; `exact_encoder`: a maker of as many independent ones as are asked for) or raises
`NotExact` with the reason it cannot promise HF's ids:
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

import itertools
from collections.abc import Callable
from functools import partial
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


def exact_encoding(
    config: dict[str, Any], encode_special_tokens: bool = False
) -> tuple[Any, np.ndarray | None]:
    """(the `tiktoken.Encoding`, the HF id of each of its ranks or None where they are equal)
    of a tokenizer.json's parsed content; `NotExact` when it cannot be exact."""
    make, rank_to_id = exact_encoder(config, encode_special_tokens)
    return make(), rank_to_id


def exact_encoder(
    config: dict[str, Any], encode_special_tokens: bool = False
) -> tuple[Callable[[], Any], np.ndarray | None]:
    """`exact_encoding`, with a maker of the Encoding instead of one: each call makes a new,
    independent `tiktoken.Encoding` of the same ranks (fasttok.FastEngine gives each of its
    threads one of its own)."""
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
    make = partial(
        tiktoken.Encoding,
        "tokenfeed",
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    return make, None if identity else rank_to_id
