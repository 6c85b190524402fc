"""Whether a call lets other Python threads run (lets go of the GIL), told without timing: a
thread waits for the GIL while forced switches are off, so it can run inside the call only if
the call lets go of the GIL."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def lets_others_run(call: Callable[[], object]) -> bool:
    inside, seen, go = [False], [], threading.Event()

    def look() -> None:
        go.wait()
        seen.append(inside[0])

    was = sys.getswitchinterval()
    thread = threading.Thread(target=look)
    thread.start()
    sys.setswitchinterval(1000.0)
    try:
        inside[0] = True
        go.set()
        call()
        inside[0] = False
    finally:
        sys.setswitchinterval(was)
    thread.join()
    return seen[0]
