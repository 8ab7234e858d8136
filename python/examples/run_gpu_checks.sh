#!/usr/bin/env bash
# GPU checks of the Python client's CUDA IPC transport, on a host with a GPU,
# PyTorch (and optionally CuPy):
#   1. starts hkvd on the CUDA backend (one shard) on a temporary socket,
#   2. runs python/tests/test_cuda.py against it (pytest, or the file as a
#      script where pytest is missing),
#   3. runs python/examples/train_loop.py with --transport cuda-ipc, shm and
#      socket (STEPS steps each, 300 by default; ~1 min in all),
#   4. runs python/examples/train_bench.py (native embeddings against
#      hkvd.torch.Embedding over each transport, SGD then row-wise Adagrad,
#      BENCH_STEPS steps, 2 rounds; --device cuda unless BACKEND=cpu),
#   5. stops the daemon (also on failure or Ctrl-C).
# Everything goes to LOG; the last line printed (to stdout too) says how many
# steps failed, and the exit status is non-zero when any did.
#
#   python/examples/run_gpu_checks.sh LOG [HKVD_BIN]     # HKVD_BIN: the repo's .gpu/bin/hkvd by default
#
# Each step has a time limit (150 s for the tests, 90 s per loop, 300 s per
# benchmark), so the whole run ends within about 18 minutes even when
# something hangs.
#
# Environment: PYTHON (python3), STEPS (300), BATCH (4096), DIM (32),
# BENCH_STEPS (120), VOCAB (ids per field in the benchmark, 200000),
# BACKEND (cuda; cpu runs the same steps against a CPU daemon, where the GPU
# tests skip and train_loop falls back).
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LOG=${1:?usage: run_gpu_checks.sh LOG [HKVD_BIN]}
BIN=${2:-$ROOT/.gpu/bin/hkvd}
PY=${PYTHON:-python3}
STEPS=${STEPS:-300}
BATCH=${BATCH:-4096}
DIM=${DIM:-32}
BACKEND=${BACKEND:-cuda}
case "$BIN" in /*) ;; *) BIN="$PWD/$BIN" ;; esac
case "$LOG" in /*) ;; *) LOG="$PWD/$LOG" ;; esac

TMP=$(mktemp -d /tmp/hkvd-gpu-checks.XXXXXX)
SOCK="$TMP/hkvd.sock"
DAEMON=""
FAILED=0

stop_daemon() {
    if [ -n "$DAEMON" ] && kill -0 "$DAEMON" 2>/dev/null; then
        kill -TERM "$DAEMON" 2>/dev/null
        for _ in $(seq 1 100); do
            kill -0 "$DAEMON" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$DAEMON" 2>/dev/null
        wait "$DAEMON" 2>/dev/null
    fi
    DAEMON=""
}
cleanup() {
    stop_daemon
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'echo "interrupted" >>"$LOG"; exit 130' INT TERM

exec 3>&1 >>"$LOG" 2>&1

step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, logs and counts failures
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "=== $name FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
        FAILED=$((FAILED + 1))
    else
        echo "=== $name ok"
    fi
    return 0
}

echo "=== hkvd Python GPU checks, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "repo $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')), hkvd $BIN"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' \
    || echo "(torch does not import)"
"$PY" -c 'import cupy; print("cupy", cupy.__version__)' 2>/dev/null || echo "(no cupy)"

if [ ! -x "$BIN" ]; then
    echo "=== no hkvd binary at $BIN"
    echo "run_gpu_checks: no hkvd binary at $BIN" >&3
    exit 2
fi

echo
echo "=== starting hkvd ($BACKEND backend, one shard) on $SOCK"
"$BIN" serve --backend "$BACKEND" --shards 1 --socket "$SOCK" --state-dir "$TMP/state" --restore none --log warn \
    </dev/null >"$TMP/daemon.log" 2>&1 &
DAEMON=$!
READY=0
for _ in $(seq 1 100); do
    if ! kill -0 "$DAEMON" 2>/dev/null; then
        break
    fi
    if [ -S "$SOCK" ] && PYTHONPATH="$ROOT/python" timeout 10 "$PY" -c \
        "import sys, hkvd; hkvd.Client(sys.argv[1], timeout=5).ping()" "$SOCK" 2>/dev/null; then
        READY=1
        break
    fi
    sleep 0.5
done
if [ "$READY" -ne 1 ]; then
    echo "=== hkvd did not start; its log:"
    cat "$TMP/daemon.log"
    echo "run_gpu_checks: hkvd did not start (see $LOG)" >&3
    exit 2
fi
echo "hkvd is up (pid $DAEMON)"

export HKVD_GPU_SOCKET="$SOCK"
export PYTHONUNBUFFERED=1
if "$PY" -c 'import pytest' 2>/dev/null; then
    step "test_cuda.py (pytest)" 150 "$PY" -m pytest -v -rs -p no:cacheprovider "$ROOT/python/tests/test_cuda.py"
else
    step "test_cuda.py (script)" 150 "$PY" "$ROOT/python/tests/test_cuda.py"
fi

for t in cuda-ipc shm socket; do
    step "train_loop.py --transport $t" 90 "$PY" "$ROOT/python/examples/train_loop.py" --socket "$SOCK" \
        --table "train_${t//-/_}" --fresh --transport "$t" --steps "$STEPS" --batch "$BATCH" --dim "$DIM" --json
done

BENCH_DEVICE=cuda
[ "$BACKEND" = cpu ] && BENCH_DEVICE=cpu
for opt in sgd rowwise_adagrad; do
    step "train_bench.py --optimizer $opt" 300 "$PY" "$ROOT/python/examples/train_bench.py" --socket "$SOCK" \
        --device "$BENCH_DEVICE" --optimizer "$opt" --steps "${BENCH_STEPS:-120}" --warmup 20 --rounds 2 \
        --batch "$BATCH" --dim "$DIM" --vocab "${VOCAB:-200000}"
done

stop_daemon
echo
echo "=== hkvd's log (warnings and errors)"
cat "$TMP/daemon.log"
echo
echo "=== done: $FAILED step(s) failed"
echo "run_gpu_checks: $FAILED step(s) failed; log in $LOG" >&3
[ "$FAILED" -eq 0 ]
