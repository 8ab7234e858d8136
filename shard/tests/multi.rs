//! A table over every GPU of the host (`GpuGroup`): with `--ignored` on a
//! GPU host, every group operation on both routes equals the CPU backend
//! sharded the way the daemon's router shards, and resharding from N GPUs
//! onto M keeps every entry with its value and score. On one GPU the same
//! tests run a group of one.

use hkv_shard::cpu::CpuTable;
use hkv_shard::cuda;
use hkv_shard::cuda_table::DeviceOp;
use hkv_shard::hash::shard_of;
use hkv_shard::multi::{nccl_version, GpuGroup, RankBatch, Route};
use hkv_shard::{BucketMode, LfuTies, ScorePolicy, Shard, TableConfig};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const DIM: usize = 6;

/// Every GPU of the host, after the set-up a binary's `main` does: NCCL's
/// settings in the environment, the kernel cache.
fn gpus() -> Vec<usize> {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        for (k, v) in hkv_shard::multi::NCCL_ENV_DEFAULTS {
            if std::env::var_os(k).is_none() {
                std::env::set_var(k, v);
            }
        }
        if let Some(dir) = cuda::default_kernel_cache_dir(None, |k| std::env::var_os(k)) {
            cuda::set_cache_dir(dir);
        }
    });
    let n = cuda::probe().expect("a CUDA device").len().min(hkv_shard::multi::MAX_GPUS);
    (0..n).collect()
}

/// Lfu with plain frequencies: scores that do not depend on the clock, so
/// that the group's tables and the CPU reference (each on its own system
/// clock) agree on every score.
fn config(mode: BucketMode) -> TableConfig {
    TableConfig::new(1 << 14, DIM).policy(ScorePolicy::Lfu).lfu_ties(LfuTies::LowestSlot).mode(mode)
}

fn row(k: u64, salt: u64) -> Vec<f32> {
    (0..DIM).map(|j| (k.wrapping_mul(31).wrapping_add(salt * 7 + j as u64) % 100_003) as f32).collect()
}

/// Every entry of some shards, sorted by key: (key, row, score).
fn entries<'a>(shards: impl Iterator<Item = &'a dyn Shard>) -> Vec<(u64, Vec<f32>, u64)> {
    let mut all = vec![];
    for s in shards {
        let e = s.export_batch(0, s.capacity()).unwrap();
        for (i, &k) in e.keys.iter().enumerate() {
            all.push((k, e.values[i * DIM..(i + 1) * DIM].to_vec(), e.scores[i]));
        }
    }
    all.sort_by_key(|e| e.0);
    all
}

/// The CPU reference: one CpuTable per GPU, each fed its part of every batch
/// in request order, as the daemon's router does.
struct Reference {
    shards: Vec<CpuTable>,
}

impl Reference {
    fn apply(&self, op: DeviceOp, keys: &[u64], values: &mut [f32], found: &mut [bool]) {
        let n = self.shards.len() as u64;
        for (d, shard) in self.shards.iter().enumerate() {
            let idx: Vec<usize> = (0..keys.len()).filter(|&i| shard_of(keys[i], n) == d as u64).collect();
            let k: Vec<u64> = idx.iter().map(|&i| keys[i]).collect();
            let mut v: Vec<f32> = idx.iter().flat_map(|&i| values[i * DIM..(i + 1) * DIM].to_vec()).collect();
            let mut f = vec![false; k.len()];
            match op {
                DeviceOp::Find => drop(shard.find(&k, &mut v, &mut f, None).unwrap()),
                DeviceOp::Contains => drop(shard.contains(&k, &mut f).unwrap()),
                DeviceOp::InsertOrAssign => drop(shard.insert_or_assign(&k, &v, None, None).unwrap()),
                DeviceOp::FindOrInsert => drop(shard.find_or_insert(&k, &mut v, None, None).unwrap()),
                DeviceOp::Assign => drop(shard.assign(&k, &v, None, None).unwrap()),
                DeviceOp::Erase => drop(shard.erase(&k, Some(&mut f)).unwrap()),
                _ => unreachable!(),
            }
            for (j, &i) in idx.iter().enumerate() {
                found[i] = f[j];
                values[i * DIM..(i + 1) * DIM].copy_from_slice(&v[j * DIM..(j + 1) * DIM]);
            }
        }
    }
}

fn upload(group: &GpuGroup, b: &mut [RankBatch], keys: &[Vec<u64>], values: &[Vec<f32>]) {
    for r in 0..b.len() {
        let s = group.stream(r);
        if !keys[r].is_empty() {
            s.memcpy_htod(&keys[r], &mut b[r].keys.slice_mut(..keys[r].len())).unwrap();
            s.memcpy_htod(&values[r], &mut b[r].values.slice_mut(..values[r].len())).unwrap();
            s.memset_zeros(&mut b[r].found).unwrap();
        }
        s.synchronize().unwrap();
    }
}

fn download(group: &GpuGroup, b: &[RankBatch], n: &[usize]) -> (Vec<Vec<f32>>, Vec<Vec<u8>>) {
    let mut vs = vec![];
    let mut fs = vec![];
    for r in 0..b.len() {
        let s = group.stream(r);
        let mut v = vec![0f32; n[r] * DIM];
        let mut f = vec![0u8; n[r]];
        if n[r] > 0 {
            s.memcpy_dtoh(&b[r].values.slice(..n[r] * DIM), &mut v).unwrap();
            s.memcpy_dtoh(&b[r].found.slice(..n[r]), &mut f).unwrap();
        }
        s.synchronize().unwrap();
        vs.push(v);
        fs.push(f);
    }
    (vs, fs)
}

#[test]
fn nccl_loads_or_says_why() {
    match nccl_version() {
        Ok(v) => assert!(v >= 20000, "{v}"),
        Err(e) => assert!(matches!(e, hkv_shard::Error::Unavailable(_) | hkv_shard::Error::Device(_)), "{e}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn group_operations_equal_the_cpu_backend_on_every_route() {
    let all = gpus();
    let mut sets = vec![all.clone()];
    if all.len() > 1 {
        sets.push(vec![all[all.len() - 1]]);
    }
    for ordinals in sets {
        for mode in [BucketMode::Single, BucketMode::Dual] {
            for route in [Route::Device, Route::Host, Route::Peer, Route::Auto] {
                let cfg = config(mode);
                let group = GpuGroup::new(cfg.clone(), &ordinals).unwrap();
                let reference =
                    Reference { shards: ordinals.iter().map(|_| CpuTable::new(cfg.clone()).unwrap()).collect() };
                let nr = ordinals.len();
                let per_gpu = 3000;
                let mut b = group.batch(per_gpu).unwrap();
                if route == Route::Peer && nr > 1 && !group.peer_access() {
                    let e = group.run(DeviceOp::Find, route, &mut b, &vec![1; nr]).unwrap_err();
                    assert!(e.to_string().contains("peer access"), "{e}");
                    continue;
                }
                let mut rng = rand::rngs::StdRng::seed_from_u64(11 + nr as u64);
                // Keys stay below half the capacity: no eviction, so every
                // result is determined whatever order a batch's keys run in.
                let universe: Vec<u64> = (0..(6000 * nr as u64)).map(|i| i * 2_654_435_761 + 5).collect();
                let ops = [
                    DeviceOp::InsertOrAssign,
                    DeviceOp::Find,
                    DeviceOp::FindOrInsert,
                    DeviceOp::Assign,
                    DeviceOp::Contains,
                    DeviceOp::Erase,
                ];
                for round in 0..40u64 {
                    let op = if round < 4 { DeviceOp::InsertOrAssign } else { ops[rng.gen_range(0..ops.len())] };
                    let n: Vec<usize> = (0..nr).map(|_| rng.gen_range(0..=per_gpu)).collect();
                    // Distinct keys over the whole batch (every GPU's part).
                    let mut pick = universe.clone();
                    pick.shuffle(&mut rng);
                    let mut at = 0;
                    let keys: Vec<Vec<u64>> = n
                        .iter()
                        .map(|&m| {
                            at += m;
                            pick[at - m..at].to_vec()
                        })
                        .collect();
                    let values: Vec<Vec<f32>> =
                        keys.iter().map(|ks| ks.iter().flat_map(|&k| row(k, round)).collect()).collect();
                    upload(&group, &mut b, &keys, &values);
                    let run = group.run(op, route, &mut b, &n).unwrap();
                    let (gv, gf) = download(&group, &b, &n);
                    let flat_keys: Vec<u64> = keys.concat();
                    let mut rv: Vec<f32> = values.concat();
                    let mut rf = vec![false; flat_keys.len()];
                    reference.apply(op, &flat_keys, &mut rv, &mut rf);
                    let (gv, gf) = (gv.concat(), gf.concat());
                    let what = format!("{ordinals:?} {mode:?} {route:?} round {round} {op:?}");
                    if matches!(op, DeviceOp::Find | DeviceOp::Contains | DeviceOp::Erase) {
                        let gfb: Vec<bool> = gf.iter().map(|&x| x != 0).collect();
                        assert_eq!(gfb, rf, "{what}: found flags");
                        assert_eq!(
                            run.counts.hits as usize + run.counts.erased as usize,
                            rf.iter().filter(|&&x| x).count(),
                            "{what}"
                        );
                    }
                    if matches!(op, DeviceOp::Find | DeviceOp::FindOrInsert) {
                        assert_eq!(gv, rv, "{what}: rows");
                    }
                    let sizes: Vec<u64> = group.tables().iter().map(|t| t.size()).collect();
                    let want: Vec<u64> = reference.shards.iter().map(|t| t.size()).collect();
                    assert_eq!(sizes, want, "{what}: sizes per GPU");
                }
                let g = entries(group.tables().iter().map(|t| t as &dyn Shard));
                let c = entries(reference.shards.iter().map(|t| t as &dyn Shard));
                assert_eq!(g, c, "{ordinals:?} {mode:?} {route:?}: every entry, row and score");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn resharding_keeps_every_entry() {
    let all = gpus();
    // N -> M over the GPUs there are: all -> last one -> all, and (with one
    // GPU) a group of one onto itself.
    let plan: Vec<Vec<usize>> = if all.len() > 1 {
        vec![all.clone(), vec![all[all.len() - 1]], all.iter().rev().copied().collect()]
    } else {
        vec![all.clone(), all.clone()]
    };
    let cfg = TableConfig::new(1 << 17, DIM).policy(ScorePolicy::Lfu);
    let group = GpuGroup::new(cfg, &plan[0]).unwrap();
    let nr = plan[0].len();
    let per_gpu = 8000;
    let mut b = group.batch(per_gpu).unwrap();
    for round in 0..3u64 {
        let keys: Vec<Vec<u64>> = (0..nr)
            .map(|r| (0..per_gpu as u64).map(|i| (round * 1_000_003 + r as u64 * 77_777 + i) * 0x9e37_79b1).collect())
            .collect();
        let values: Vec<Vec<f32>> = keys.iter().map(|ks| ks.iter().flat_map(|&k| row(k, 0)).collect()).collect();
        upload(&group, &mut b, &keys, &values);
        let n = vec![per_gpu; nr];
        group.run(DeviceOp::InsertOrAssign, Route::Device, &mut b, &n).unwrap();
        if round == 2 {
            // Scores differ between entries (Lfu: found twice).
            group.run(DeviceOp::Find, Route::Device, &mut b, &n).unwrap();
        }
    }
    let before = entries(group.tables().iter().map(|t| t as &dyn Shard));
    assert_eq!(before.len() as u64, group.size());
    assert_eq!(before.len(), 3 * per_gpu * nr, "every key inserted");
    let mut current = group;
    for next in &plan[1..] {
        let (moved_to, moved) = current.reshard(next).unwrap();
        assert_eq!(moved, before.len() as u64, "{:?} -> {next:?}", current.ordinals());
        let after = entries(moved_to.tables().iter().map(|t| t as &dyn Shard));
        assert_eq!(after, before, "{:?} -> {next:?}: every entry, row and score", current.ordinals());
        for (r, t) in moved_to.tables().iter().enumerate() {
            let e = t.export_batch(0, t.capacity()).unwrap();
            assert!(e.keys.iter().all(|&k| shard_of(k, next.len() as u64) == r as u64), "owners after {next:?}");
        }
        current = moved_to;
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn features_hashed_on_the_gpus_take_the_device_route() {
    use hkv_shard::features::{hash_features_cpu, Features, HashKind};
    let ordinals = gpus();
    let nr = ordinals.len();
    let group = GpuGroup::new(TableConfig::new(1 << 15, DIM).policy(ScorePolicy::Lfu), &ordinals).unwrap();
    let per_gpu = 5000;
    let mut b = group.batch(per_gpu).unwrap();
    let buckets = 1u64 << 40;
    let ints: Vec<Vec<i64>> =
        (0..nr).map(|r| (0..per_gpu as i64).map(|i| i * 7919 - r as i64 * 1_000_000).collect()).collect();
    let mut host_keys = vec![];
    for (r, f) in ints.iter().enumerate() {
        let n = group.hash_features(r, Features::Int64(f), HashKind::Fingerprint64, buckets, &mut b[r]).unwrap();
        assert_eq!(n, per_gpu);
        let mut want = vec![0u64; per_gpu];
        hash_features_cpu(Features::Int64(f), HashKind::Fingerprint64, buckets, &mut want, false).unwrap();
        let mut got = vec![0u64; per_gpu];
        let s = group.stream(r);
        s.memcpy_dtoh(&b[r].keys.slice(..per_gpu), &mut got).unwrap();
        s.synchronize().unwrap();
        assert_eq!(got, want, "keys hashed on GPU {r}");
        let rows: Vec<f32> = want.iter().flat_map(|&k| row(k, 1)).collect();
        s.memcpy_htod(&rows, &mut b[r].values.slice_mut(..rows.len())).unwrap();
        s.synchronize().unwrap();
        host_keys.push(want);
    }
    let n = vec![per_gpu; nr];
    let w = group.run(DeviceOp::InsertOrAssign, Route::Device, &mut b, &n).unwrap();
    assert_eq!(w.counts.summary.inserted as usize, per_gpu * nr);
    // Hash again on the GPUs and find: every row comes back.
    for (r, f) in ints.iter().enumerate() {
        group.hash_features(r, Features::Int64(f), HashKind::Fingerprint64, buckets, &mut b[r]).unwrap();
    }
    let found = group.run(DeviceOp::Find, Route::Device, &mut b, &n).unwrap();
    assert_eq!(found.counts.hits as usize, per_gpu * nr);
    let (values, _) = download(&group, &b, &n);
    for r in 0..nr {
        let want: Vec<f32> = host_keys[r].iter().flat_map(|&k| row(k, 1)).collect();
        assert_eq!(values[r], want, "rows found from GPU {r}'s features");
    }
    // Bad input is refused before any key is written.
    let e = group.hash_features(0, Features::Int64(&[1]), HashKind::Fingerprint64, 0, &mut b[0]).unwrap_err();
    assert!(matches!(e, hkv_shard::Error::Features(_)), "{e}");
    let e = group.hash_features(nr, Features::Int64(&[1]), HashKind::Fingerprint64, 8, &mut b[0]).unwrap_err();
    assert!(matches!(e, hkv_shard::Error::Config(_)), "{e}");
}

// On an error part-way through the device and peer routes (here a GPU's
// table failing to grow after the other GPUs had launched their parts),
// the lock groups held for the launched parts were let go before their
// streams were synchronised, so a grow right after could free the storage
// under kernels still running. Now a launched part waits for its streams
// before its lock group goes: the error comes back, every table keeps its
// entries, and the group grows and answers afterwards.
#[test]
#[ignore = "needs a CUDA device"]
fn an_error_part_way_through_a_route_leaves_every_table_whole() {
    let ordinals = gpus();
    let nr = ordinals.len();
    for route in [Route::Device, Route::Peer] {
        let cfg = config(BucketMode::Single).max_capacity(1 << 20);
        let group = GpuGroup::new(cfg, &ordinals).unwrap();
        if route == Route::Peer && !group.peer_access() {
            continue;
        }
        let mut b = group.batch(8000).unwrap();
        let first: Vec<Vec<u64>> = (0..nr as u64).map(|r| (0..1000).map(|i| (r << 32) + i * 7 + 1).collect()).collect();
        let rows = |ks: &[Vec<u64>]| -> Vec<Vec<f32>> {
            ks.iter().map(|k| k.iter().flat_map(|&k| row(k, 0)).collect()).collect()
        };
        upload(&group, &mut b, &first, &rows(&first));
        group.run(DeviceOp::InsertOrAssign, route, &mut b, &vec![1000; nr]).unwrap();
        let before = entries(group.tables().iter().map(|t| t as &dyn Shard));
        assert_eq!(before.len(), 1000 * nr);

        // Enough keys to make every table grow; the last one's grow fails.
        let more: Vec<Vec<u64>> =
            (0..nr as u64).map(|r| (0..8000).map(|i| (r << 32) + (1 << 31) + i * 7 + 1).collect()).collect();
        upload(&group, &mut b, &more, &rows(&more));
        group.tables()[nr - 1].fail_next_grow();
        let e = group.run(DeviceOp::InsertOrAssign, route, &mut b, &vec![8000; nr]).unwrap_err();
        assert!(matches!(e, hkv_shard::Error::Device(_)), "{route:?}: {e}");
        // Grow every table at once, right after the error.
        for t in group.tables() {
            t.reserve(t.capacity() * 2).unwrap();
        }
        let after = entries(group.tables().iter().map(|t| t as &dyn Shard));
        // The GPUs whose part ran keep what it inserted, and everything from before.
        for e in &before {
            assert!(after.contains(e), "{route:?}: {e:?} lost");
        }
        upload(&group, &mut b, &more, &rows(&more));
        group.run(DeviceOp::InsertOrAssign, route, &mut b, &vec![8000; nr]).unwrap();
        upload(&group, &mut b, &first, &rows(&first));
        let run = group.run(DeviceOp::Find, route, &mut b, &vec![1000; nr]).unwrap();
        assert_eq!(run.counts.hits, 1000 * nr as u64, "{route:?}");
        assert_eq!(group.size(), 9000 * nr as u64, "{route:?}");
    }
}

/// Every route samples each key of a lookup or write once, on the GPU that
/// owns it (miss-ratio curves, issue 27), and none of an erase.
#[test]
#[ignore = "needs a CUDA device"]
fn routes_sample_each_key_once() {
    use hkv_shard::mrc::Sampler;
    let ordinals = gpus();
    let nr = ordinals.len();
    for route in [Route::Device, Route::Host, Route::Peer, Route::Auto] {
        let group = GpuGroup::new(config(BucketMode::Single), &ordinals).unwrap();
        if route == Route::Peer && nr > 1 && !group.peer_access() {
            continue;
        }
        group.set_sampler(Some(Sampler { seed: 3, threshold: u64::MAX }));
        let per_gpu = 2000;
        let mut b = group.batch(per_gpu).unwrap();
        let n = vec![per_gpu; nr];
        let keys: Vec<Vec<u64>> =
            (0..nr as u64).map(|r| (0..per_gpu as u64).map(|i| (r * 1_000_003 + i) * 7919 + 1).collect()).collect();
        let values: Vec<Vec<f32>> = keys.iter().map(|ks| ks.iter().flat_map(|&k| row(k, 0)).collect()).collect();
        upload(&group, &mut b, &keys, &values);
        let mut want: Vec<u64> = keys.concat();
        want.sort_unstable();
        for op in [DeviceOp::InsertOrAssign, DeviceOp::Find, DeviceOp::Contains, DeviceOp::Assign, DeviceOp::Erase] {
            group.run(op, route, &mut b, &n).unwrap();
            let mut samples = hkv_shard::mrc::Samples::default();
            let d = group.drain_samples(&mut samples);
            let mut out = samples.keys;
            out.sort_unstable();
            if op == DeviceOp::Erase {
                assert_eq!(d, hkv_shard::SampleDrain::default(), "{route:?} {op:?}");
                assert!(out.is_empty());
            } else {
                // Only lookups count as accesses (issue 32).
                let lookups = if matches!(op, DeviceOp::Find | DeviceOp::Contains) { want.len() as u64 } else { 0 };
                assert_eq!((d.accesses, d.sampled, d.dropped), (lookups, want.len() as u64, 0), "{route:?} {op:?}");
                assert_eq!(out, want, "{route:?} {op:?}");
            }
        }
    }
}
