"""The client's choice of gRPC transport (tokenfeed/client/_grpcsetting.py) takes effect and
changes no byte: a trainer process that imports the client first reads its stream on the
thread that waits for each message (gRPC's EventEngine threads stay idle), and one that keeps
gRPC's default (GRPC_EXPERIMENTS set, here empty) reads the same batches through them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from tokenfeed.client import Client

STEPS = 1000

# A trainer's process: the client imported first, one stream read; then where its threads'
# CPU went (/proc: schedstat's first field, ns on a CPU).
PROBE = """
import hashlib, json, os, sys
import tokenfeed.client as tc

def on_cpu():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            out[t] = (name, int(open(f"/proc/self/task/{t}/schedstat").read().split()[0]))
        except OSError:
            pass
    return out

target, steps = sys.argv[1], int(sys.argv[2])
digest = hashlib.sha256()
with tc.Client(target, job="main") as c:
    c.describe()
    before = on_cpu()
    for batch in c.iter_batches(0, steps):
        digest.update(batch.fingerprint.encode())
    after = on_cpu()
spent = {t: after[t][1] - before.get(t, ("", 0))[1] for t in after}
engine = sum(ns for t, ns in spent.items() if after[t][0] == "event_engine")
print(json.dumps({"setting": tc.grpc_setting(), "digest": digest.hexdigest(),
                  "engine_ns": engine, "total_ns": sum(spent.values())}))
"""


def _probe(address: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, address, str(STEPS)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_client_reads_on_its_own_thread_and_the_bytes_do_not_change(server):
    with Client(server.address, job="main") as c:
        expected = hashlib.sha256()
        for batch in c.iter_batches(0, STEPS):
            expected.update(batch.fingerprint.encode())
    chosen = _probe(server.address)
    default = _probe(server.address, GRPC_EXPERIMENTS="")
    assert chosen["setting"].startswith("GRPC_EXPERIMENTS=-event_engine_client"), chosen
    assert default["setting"] == "left alone: GRPC_EXPERIMENTS is set ('')", default
    assert chosen["digest"] == default["digest"] == expected.hexdigest()
    # gRPC's EventEngine threads read the default's stream (measured: about half its CPU) and
    # stay idle with the client's setting (well under a millisecond in all).
    assert chosen["engine_ns"] < 0.05 * chosen["total_ns"], chosen
    assert default["engine_ns"] > 0.2 * default["total_ns"], default
