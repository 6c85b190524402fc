"""The texts an exact engine is checked against HF on when a tokenizer loads: where two engines
could part (spaces, digits, contractions, scripts, emoji, invisible and long runs), random mixes
of their characters, and every added token in and out of context; the same on every load."""

from __future__ import annotations

import random

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
