#!/usr/bin/env bash
# The GPU runs the seventeenth session left for the next machine (none was
# lent): on the device, after `../shared/gpu/pack` here (.gpu/bin,
# .gpu/tests) and, for step 3, a build of branch adaptive-window-moves as
# .gpu/bin/hkv-bench-moves (checkout, `cargo build --release -p hkv-shard
# --bin hkv-bench`, copy, checkout main again):
#   1. the whole shard-cuda suite at main: its new test
#      lookup_samples_carry_the_tables_answer (a find's sampled keys tagged
#      with the table's answer, kernels/lookup.cu) and the curve's CUDA tests;
#   2. the daemon's curve test on CUDA (the_curve_matches_replays_on_cuda)
#      and the backed-table tests of daemon-cuda_ipc;
#   3. main's hkv-bench against adaptive-window-moves', alternated, adaptive
#      at 32 Mi slots, then lru for reference (shard/BENCHMARKS.md,
#      "Adaptive fills"), if the branch's tests pass in step 1 of its own
#      build (run its shard-cuda `adaptive differential` first).
# Writes $OUT/next.txt. Run as: run carry [".gpu"] command "shard/bench/gpu-next.sh"
set -u
cd "$(dirname "$0")/../.."
export HKV_KERNEL_CACHE=/tmp/kc
export HKVD_BIN=$PWD/.gpu/bin/hkvd  # the daemon tests spawn it (no cargo there)
L=${OUT:-/tmp}/next.txt
step() { echo "== $*" >> "$L"; timeout 240 "$@" > /tmp/step.txt 2>&1; echo "rc=$? at ${SECONDS}s" >> "$L"; grep -E "^test .*(FAILED|ok)$|test result|panicked|^\| *[01]\.|^\| *λ" /tmp/step.txt | grep -v " ok$" | cut -c1-120 >> "$L"; }
step .gpu/tests/shard-cuda --ignored --test-threads 1
[ -x .gpu/tests/daemon-mrc ] && step .gpu/tests/daemon-mrc --ignored the_curve_matches_replays_on_cuda
if [ -x .gpu/bin/hkv-bench-moves ]; then
  for r in 1 2; do for b in hkv-bench hkv-bench-moves; do
    step .gpu/bin/$b --backend cuda --dims 32 --no-moka --capacity 33554432 --runs 3 --policy adaptive --lambdas 0.5,0.75,0.9,1.0 --ops insert_or_assign,find_or_insert,insert_and_evict,find
  done; done
  step .gpu/bin/hkv-bench --backend cuda --dims 32 --no-moka --capacity 33554432 --runs 3 --policy lru --lambdas 0.5,0.75,0.9,1.0 --ops insert_or_assign,find_or_insert,insert_and_evict,find
fi
echo "done at ${SECONDS}s" >> "$L"
