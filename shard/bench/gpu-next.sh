#!/usr/bin/env bash
# The GPU runs the eighteenth session left for the next machine (none could
# be started after its first run): on the device, after, here,
#   ../shared/gpu/pack -p hkv-shard -p hkvd      (main: .gpu/bin, .gpu/tests)
# then a build of branch adaptive-moves-at-once (`git checkout
# adaptive-moves-at-once && cargo build --release -p hkv-shard --bin hkv-bench
# && cargo test --release -p hkv-shard --test cuda --no-run`), its hkv-bench
# copied to .gpu/bin/hkv-bench-next and its cuda test binary to
# .gpu/tests/shard-cuda-next (then `git checkout main`; strip both, and
# delete the test binaries below that are not run, to stay under 64 MiB):
#   1. the branch's adaptive tests, among them
#      adaptive_window_shrinks_by_many_as_the_cpu_backend (a fall of the
#      window share, GPU against the CPU backend slot for slot) and the
#      differential test: the branch moves all but a window's youngest at
#      once where a shrink is deep (kernels/table.cuh, hkv_window_youngest);
#   2. main's hkv-bench against the branch's, alternated, adaptive at 32 Mi
#      slots, then lru with reads refresh on for reference (shard/BENCHMARKS.md,
#      "The moves in one read, measured");
#   3. the daemon's GPU tests (HKVD_BIN set: they spawn the packed hkvd).
# Writes $OUT/next.txt. Run as: run carry [".gpu"] command "shard/bench/gpu-next.sh"
set -u
cd "$(dirname "$0")/../.."
export HKV_KERNEL_CACHE=/tmp/kc
export HKVD_BIN=$PWD/.gpu/bin/hkvd  # the daemon tests spawn it (no cargo there)
export HKV_SIM=$PWD/.gpu/bin/hkv-sim  # daemon-mrc replays with it
L=${OUT:-/tmp}/next.txt
n=0
step() { local t=$1; shift; n=$((n+1)); echo "== [$n] $*" >> "$L"; timeout "$t" "$@" > /tmp/step$n.txt 2>&1; echo "rc=$? at ${SECONDS}s" >> "$L"; grep -E "^test .*(FAILED|ok)$|test result|panicked|^\| [01]\." /tmp/step$n.txt | grep -v " ok$" | cut -c1-200 >> "$L"; }
[ -x .gpu/tests/shard-cuda-next ] && step 150 .gpu/tests/shard-cuda-next --ignored --test-threads 1 adaptive
[ -x .gpu/tests/shard-cuda-next ] && step 90 .gpu/tests/shard-cuda-next --ignored --test-threads 1 differential
B="--backend cuda --dims 32 --no-moka --capacity 33554432 --runs 3 --lambdas 0.5,0.75,0.9,1.0 --ops insert_or_assign,find_or_insert,insert_and_evict,find"
if [ -x .gpu/bin/hkv-bench-next ]; then
  for r in 1 2; do for b in hkv-bench hkv-bench-next; do step 70 .gpu/bin/$b $B --policy adaptive; done; done
  step 60 .gpu/bin/hkv-bench $B --policy lru --reads-refresh true
fi
for t in daemon-mrc daemon-cuda_ipc daemon-daemon daemon-shm daemon-hardening daemon-checkpoint; do
  [ -x .gpu/tests/$t ] && [ $SECONDS -lt ${LIMIT:-480} ] && step 100 .gpu/tests/$t --ignored --test-threads 1
done
echo "done at ${SECONDS}s" >> "$L"
(cd /tmp && tar czf "${OUT:-/tmp}/steps.tgz" step*.txt)
