"""The serving process's allocator (client/memory.py): on glibc, blocks up to 32 MiB come from
the heap and stay there once freed, so a row buffer's memory is reused, not faulted in again;
`TOKENFEED_KEEP_FREED_MEMORY=0` leaves the defaults. Run in a child process: the tuning is
process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, resource, sys
import numpy as np
from tokenfeed.client import keep_freed_memory
tuned = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def epoch():  # a window of row buffers laid out, read, then dropped together
    held = [np.ones((1 << 17) + 4096 * k, dtype=np.int64) for k in range(16)]
    del held
epoch()  # the first buffers are new memory either way
before = faults()
for _ in range(20):
    epoch()
print(tuned, faults() - before)
"""


def _run(env: dict) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_row_buffer_memory_is_reused_not_faulted_in_again():
    env = {k: v for k, v in os.environ.items() if k != "TOKENFEED_KEEP_FREED_MEMORY"}
    tuned, faults = _run(env)
    untuned, untuned_faults = _run({**env, "TOKENFEED_KEEP_FREED_MEMORY": "0"})
    assert tuned and not untuned
    # 20 rounds of 16 buffers of about 1 MiB: untuned, freed together they go back to the
    # kernel and each round faults their pages in again (about 4,000 a round); tuned, a few.
    assert untuned_faults > 20 * 2000
    assert faults < untuned_faults // 10
