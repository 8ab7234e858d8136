#!/usr/bin/env bash
# 128 Mi entries of dim 32 (run on the GPU host: HKVD_BIN_DIR=.gpu/bin, CPU backend
# until the CUDA backend exists): checkpoint and restore throughput beside dd.
set -u
B=${HKVD_BIN_DIR:-target/release}
out=${OUT:-/tmp}
log() { echo "[$(date +%T)] $*" | tee -a "$out/ckbench.log"; }
log "cores $(nproc), $(free -g | awk '/Mem/{print $2}') GiB, disk: $(df -h . | tail -1)"
root=$(mktemp -d -p "$PWD" .ck.XXXX)
S=$root/s.sock
start() {
  $B/hkvd serve --backend cpu --socket $S --state-dir $root/state --checkpoint-keep 1 --checkpoint-full-every 0 --log info 2>>$root/daemon.log &
  hp=$!
  for i in $(seq 3000); do $B/hkvctl --socket $S ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "daemon did not start"; exit 1
}
t0=$(date +%s.%N); start; log "daemon up in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
N=134217728
$B/hkvctl --socket $S create-table bench --dim 32 --capacity 150994944 --dual | tee -a $out/ckbench.log
t0=$(date +%s.%N)
for i in 0 1 2 3 4 5 6 7; do $B/hkvctl --socket $S fill bench --count $((N/8)) --start $((i*N/8)) --batch 1048576 >> $out/ckbench.log & done
wait $(jobs -p | grep -v "^$hp$") 2>/dev/null
log "filled $N keys in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
$B/hkvctl --socket $S tables | tee -a $out/ckbench.log
$B/hkvctl --socket $S checkpoint --wait --full 2>&1 | tee -a $out/ckbench.log
$B/hkvctl --socket $S checkpoints | tee -a $out/ckbench.log
du -sh $root/state/checkpoints | tee -a $out/ckbench.log
bytes=$(du -sb $root/state/checkpoints/chunks | cut -f1)
log "dd of $bytes bytes (8 MiB blocks, fsync)"
dd if=/dev/zero of=$root/raw bs=8M count=$((bytes/8388608+1)) conv=fsync 2>&1 | tail -1 | tee -a $out/ckbench.log
rm -f $root/raw
kill $hp; wait $hp
t0=$(date +%s.%N); start; log "daemon up with restore in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s"
grep "checkpoint restored" $root/daemon.log | tee -a $out/ckbench.log
$B/hkvctl --socket $S tables | tee -a $out/ckbench.log
kill $hp; wait $hp
cp $root/daemon.log $out/ 2>/dev/null
rm -rf $root
