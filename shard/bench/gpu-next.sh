#!/usr/bin/env bash
# The GPU runs the twenty-first session left for the next machine (its
# machine went back after two runs, and none could be had for the last):
# on the device, after, here,
#   ../shared/gpu/pack -p hkv-shard -p hkvd -p hkv-client   (then delete from .gpu/ the
#   test binaries not named below, to stay under 64 MiB)
#   1. the adaptive find_or_insert dip at λ 0.75, call by call
#      (HKV_BENCH_CALLS: each timed call's µs and the window share after
#      it; shard/BENCHMARKS.md, "The λ 0.75 dip call by call"): is it the
#      transient after the share falls, as on the CPU backend, or a
#      steady cost? 4 Mi slots, then 32 Mi (the bar's size);
#   2. the daemon's GPU tests (HKVD_BIN set: they spawn the packed hkvd),
#      among them the live-restore gate's paths (929b3b5) over CUDA IPC;
#   3. python/tests/test_cuda.py and train_bench (SGD) with MPS: the
#      Python client's thread-safety changes (556f018, 7272e2c) were never
#      run on a GPU.
# Writes $OUT/next.txt. Run as: run carry [".gpu"] command "shard/bench/gpu-next.sh"
set -u
cd "$(dirname "$0")/../.."
export HKV_KERNEL_CACHE=/tmp/kc
export HKVD_BIN=$PWD/.gpu/bin/hkvd  # the daemon tests spawn it (no cargo there)
export HKV_SIM=$PWD/.gpu/bin/hkv-sim  # daemon-mrc replays with it
L=${OUT:-/tmp}/next.txt
n=0
step() { local t=$1; shift; n=$((n+1)); echo "== [$n] $*" >> "$L"; timeout "$t" "$@" > /tmp/step$n.txt 2>&1; echo "rc=$? at ${SECONDS}s" >> "$L"; grep -E "^test .*(FAILED|ok)$|test result|panicked|^\| [01]\.|^call " /tmp/step$n.txt | grep -v " ok$" | cut -c1-200 >> "$L"; }
B=.gpu/bin/hkv-bench
export HKV_BENCH_CALLS=1
step 150 $B --backend cuda --capacity 4194304 --batch 131072 --dims 32 --lambdas 0.5,0.75 --ops find_or_insert,insert_or_assign --policy adaptive --no-moka --runs 5
step 120 $B --backend cuda --capacity 33554432 --dims 32 --lambdas 0.5,0.75,0.9 --ops insert_or_assign,find_or_insert --policy adaptive --no-moka --runs 5
unset HKV_BENCH_CALLS
for t in daemon-cuda_ipc daemon-shm daemon-daemon daemon-mrc daemon-hardening daemon-checkpoint; do
  [ -x .gpu/tests/$t ] && [ $SECONDS -lt ${LIMIT:-330} ] && step 100 .gpu/tests/$t --ignored --test-threads 1
done
mkdir -p /tmp/mps /tmp/mpslog
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
nvidia-cuda-mps-control -d
STEPS=60 BENCH_STEPS=150 VOCAB=1923077 timeout 300 python/examples/run_gpu_checks.sh "${OUT:-/tmp}/py.log" "$HKVD_BIN"
echo "python checks rc=$? at ${SECONDS}s" >> "$L"
grep -E "passed|failed|^native|^cuda-ipc" "${OUT:-/tmp}/py.log" | head -20 >> "$L"
echo quit | nvidia-cuda-mps-control
echo "done at ${SECONDS}s" >> "$L"
(cd /tmp && tar czf "${OUT:-/tmp}/steps.tgz" step*.txt)
