"""tokenfeed's benchmarks: `python -m bench.<name>` (README, Benchmarks)."""

from __future__ import annotations

import os

# The environment's own GRPC_EXPERIMENTS, read before anything here imports tokenfeed.client,
# which may set it in this process (tokenfeed/client/_grpcsetting.py). The processes a benchmark
# starts get the environment's value back (`child_env`): each consumer's client then chooses for
# itself, as a trainer's would, and the bare transport keeps gRPC's defaults.
_GRPC_EXPERIMENTS = os.environ.get("GRPC_EXPERIMENTS")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a process it starts, with the environment's own
    GRPC_EXPERIMENTS (not one this process's client import set), then `extra`."""
    env = dict(os.environ)
    env.pop("GRPC_EXPERIMENTS", None)
    if _GRPC_EXPERIMENTS is not None:
        env["GRPC_EXPERIMENTS"] = _GRPC_EXPERIMENTS
    return {**env, **(extra or {})}
