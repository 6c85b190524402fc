"""A dataset's packed chunk keys: each chunk's key by number (kept as str for recent ones), the
number of a key, and nothing for what is not one of them."""

from __future__ import annotations

import hashlib

from tokenfeed.server.indexing import chunkkeys
from tokenfeed.server.indexing.chunkkeys import ChunkKeys


def keys_of(n: int) -> list[str]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(n)]


def test_every_key_is_named_and_found_past_the_kept_names():
    keys = keys_of(chunkkeys.NAMED + 700)
    packed = ChunkKeys(keys)
    for _ in range(2):  # the second pass reads kept names, then names made again after a clear
        assert [packed[i] for i in range(len(keys))] == keys
        assert [packed.get(k) for k in keys] == list(range(len(keys)))
    assert packed[-1] == keys[-1]
    assert list(packed) == keys
    assert len(packed) == len(keys)


def test_what_is_not_a_key_of_the_dataset_is_not_found():
    keys = keys_of(50)
    packed = ChunkKeys(keys)
    assert packed.get(keys_of(51)[-1]) is None
    assert packed.get("zz" * 16) is None  # not hex
    assert packed.get(keys[0][:-2]) is None  # too short
    assert ChunkKeys([]).get(keys[0]) is None
