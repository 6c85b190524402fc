"""tokenfeed's benchmarks: `python -m bench.<name>` (README, Benchmarks)."""

from __future__ import annotations

import os
import sys


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a process it starts, then `extra`; without the
    GRPC_EXPERIMENTS that this process's own client import set (tokenfeed/client/
    _grpcsetting.py), so that each consumer's client chooses for itself, as a trainer's would,
    and the bare transport keeps gRPC's defaults. A value the environment had stays."""
    env = dict(os.environ)
    setting = sys.modules.get("tokenfeed.client._grpcsetting")
    if setting is not None and setting.grpc_setting().startswith(f"{setting.ENV}="):
        env.pop(setting.ENV, None)
    return {**env, **(extra or {})}
