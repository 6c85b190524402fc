#!/usr/bin/env bash
# The 16-core tables of issue 26, for a lent machine with a fresh checkout (about 6-8 minutes
# on 16 cores, `make env` included):
#   - serving as training reads it (bench/wire.py): 1 consumer at [8, 2048] and [32, 4096] with
#     one worker, then 16 ranks of one job in 16 consumer processes with server.workers
#     1, 2, 4, 8 and 16, each against the bare transport with as many serving processes, and
#     the workers' aggregate against linear from one worker (target: >= 0.7 at 8 workers);
#   - the build on 16 cores (bench/tokenization.py): tokenfeed build --workers 16 with each
#     backend against bare tokenizers and bare tiktoken on 16 threads.
#
#     OUT=/some/dir bash bench/cores16.sh
#
# WORKERS (1,2,4,8,16), RANKS (16), TOKENS (128000000 a measured stream), WARM_MB (640 MiB of
# tokens each job streams before the rounds: bench/wire.py) and MB (31) change the
# sizes, e.g. to try the script on a small machine first; SERVE_S (300) and BUILD_S (150) its
# steps' time limits; TABLES (serving,tokenization) the tables it runs; PY skips `make env`
# (see below).
# Writes to $OUT: machine.txt (cores, CPU, load before and after, Python), serving.txt,
# tokenization.txt, and each step's log (make-env.log, *.err). A step that runs out of its time
# is stopped and its file says so; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory the tables go to}"
mkdir -p "$OUT"
began=$(date +%s)

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    echo "cores (affinity): $(nproc)"
    grep -m1 "model name" /proc/cpuinfo || true
    echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "python: $(python3 --version 2>&1)"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$OUT/machine.txt"

step() { # name, seconds, command...: the command's stdout into $OUT/name.txt
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout --signal=INT --kill-after=20 "$limit" "$@" >"$OUT/$name.txt" 2>"$OUT/$name.err"
    local rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0))s (limit ${limit}s)" | tee -a "$OUT/machine.txt"
    if [ "$rc" -ne 0 ]; then
        echo "(stopped or failed with exit $rc: see $name.err)" >>"$OUT/$name.txt"
    fi
}

# PY names a Python that already has the project's packages on its path (a machine without
# a package registry: wheels carried and PYTHONPATH set); otherwise `make env` makes .venv.
if [ -z "${PY:-}" ]; then
    step make-env 240 make env
    PY=.venv/bin/python
fi
echo "python used: $("$PY" --version 2>&1)" >>"$OUT/machine.txt"

# 128 M tokens a measured stream: 16 consumers read 8 M tokens each (about 490 steps), a second
# or more on 16 cores, so a stream's first batches (its pipeline filling) weigh little.
case ",${TABLES:-serving,tokenization}," in *,serving,*) ;; *) SKIP_SERVING=1 ;; esac
case ",${TABLES:-serving,tokenization}," in *,tokenization,*) ;; *) SKIP_BUILD=1 ;; esac
[ -n "${SKIP_SERVING:-}" ] || step serving "${SERVE_S:-300}" "$PY" -m bench.wire --quick --workers "${WORKERS:-1,2,4,8,16}" \
    --ranks "${RANKS:-16}" --tokens "${TOKENS:-128000000}" --warm-up-mb "${WARM_MB:-640}"
# The 31 MB corpus, 2 rounds, no Ray cluster.
[ -n "${SKIP_BUILD:-}" ] || step tokenization "${BUILD_S:-150}" "$PY" -m bench.tokenization --quick --no-ray --mb "${MB:-31}" --rounds 2

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/machine.txt"
echo "total: $(($(date +%s) - began))s" >>"$OUT/machine.txt"
cat "$OUT/machine.txt"
