//! Model-based test: random sequences of every operation, in both bucket
//! modes and all policies, through the CPU table and through the simple
//! model in `common/model.rs`, compared result by result and slot by slot.
//! Batches stay below `SEQUENTIAL_BATCH`, so the table processes them in
//! index order and every per-key outcome is deterministic.

mod common;

use std::collections::HashSet;

use common::model::Model;
use hkv_shard::cpu::CpuTable;
use hkv_shard::hash::{bucket1, bucket2, digest};
use hkv_shard::score::ManualClock;
use hkv_shard::{BucketMode, Filter, LfuTies, Lost, Outcome, ScorePolicy, Shard, TableConfig};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Step {
    Insert { keys: Vec<u64>, vals: Vec<u8>, scores: Vec<u64> },
    InsertEvict { keys: Vec<u64>, vals: Vec<u8>, scores: Vec<u64> },
    FindOrInsert { keys: Vec<u64>, vals: Vec<u8>, scores: Vec<u64> },
    Load { keys: Vec<u64>, vals: Vec<u8>, scores: Vec<u64> },
    Find { keys: Vec<u64> },
    Contains { keys: Vec<u64> },
    Assign { keys: Vec<u64>, vals: Vec<u8>, scores: Option<Vec<u64>> },
    AssignScores { keys: Vec<u64>, scores: Option<Vec<u64>> },
    Accum { keys: Vec<u64>, vals: Vec<u8>, scores: Vec<u64> },
    Erase { keys: Vec<u64> },
    EraseIf { mask: u64, pattern: u64, below: u64 },
    Export { offset: u64, n: u64, min_score: u64 },
    Clear,
    Reserve { factor: u64 },
    Tick { ns: u64 },
    Epoch { e: u32 },
}

fn unique(mut v: Vec<u64>) -> Vec<u64> {
    let mut seen = HashSet::new();
    v.retain(|k| seen.insert(*k));
    v
}

fn keys(space: u64) -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..space, 0..96).prop_map(unique)
}

/// A batch: keys, one small-integer value seed per key, one score per key.
fn batch(space: u64) -> impl Strategy<Value = (Vec<u64>, Vec<u8>, Vec<u64>)> {
    keys(space).prop_flat_map(|k| {
        let n = k.len();
        (Just(k), prop::collection::vec(any::<u8>(), n), prop::collection::vec(0u64..40, n))
    })
}

fn step(space: u64) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => batch(space).prop_map(|(keys, vals, scores)| Step::Insert { keys, vals, scores }),
        3 => batch(space).prop_map(|(keys, vals, scores)| Step::InsertEvict { keys, vals, scores }),
        3 => batch(space).prop_map(|(keys, vals, scores)| Step::FindOrInsert { keys, vals, scores }),
        1 => batch(space).prop_map(|(keys, vals, scores)| Step::Load { keys, vals, scores }),
        3 => keys(space).prop_map(|keys| Step::Find { keys }),
        1 => keys(space).prop_map(|keys| Step::Contains { keys }),
        2 => (batch(space), any::<bool>()).prop_map(|((keys, vals, scores), with)| Step::Assign { keys, vals, scores: with.then_some(scores) }),
        2 => (batch(space), any::<bool>()).prop_map(|((keys, _, scores), with)| Step::AssignScores { keys, scores: with.then_some(scores) }),
        2 => batch(space).prop_map(|(keys, vals, scores)| Step::Accum { keys, vals, scores }),
        2 => keys(space).prop_map(|keys| Step::Erase { keys }),
        1 => (0u64..4, 0u64..4, 0u64..30).prop_map(|(mask, pattern, below)| Step::EraseIf { mask, pattern: pattern & mask, below }),
        1 => (0u64..1200, 1u64..700, 0u64..30).prop_map(|(offset, n, min_score)| Step::Export { offset, n, min_score }),
        1 => Just(Step::Clear),
        1 => (1u64..5).prop_map(|factor| Step::Reserve { factor }),
        3 => (0u64..(3 << 20)).prop_map(|ns| Step::Tick { ns }),
        1 => (0u32..4).prop_map(|e| Step::Epoch { e }),
    ]
}

fn config() -> impl Strategy<Value = TableConfig> {
    (
        1u64..5,
        prop_oneof![Just(0u64), Just(4u64)],
        1usize..4,
        // Adaptive is left out: its victims follow its sketch and window
        // rule, not the minimum score the model evicts (its own tests are
        // in tests/cpu.rs).
        prop::sample::select(ScorePolicy::ALL.into_iter().filter(|p| *p != ScorePolicy::Adaptive).collect::<Vec<_>>()),
        prop::sample::select(vec![BucketMode::Single, BucketMode::Dual]),
        prop_oneof![Just(0.5f64), Just(0.9), Just(1.0)],
        prop::sample::select(LfuTies::ALL.to_vec()),
    )
        .prop_map(|(buckets, grow, dim, policy, mode, lf, lfu_ties)| TableConfig {
            capacity: buckets * 128,
            max_capacity: buckets * 128 * grow,
            max_load_factor: lf,
            dim,
            policy,
            mode,
            fast_tier_bytes: None,
            lfu_ties,
            tuning: Default::default(),
            reads_refresh: None,
        })
}

fn values(seeds: &[u8], dim: usize) -> Vec<f32> {
    seeds.iter().flat_map(|&s| (0..dim).map(move |d| (s as usize * 3 + d) as f32)).collect()
}

/// Structural invariants of the real table, read from its raw slots.
fn check_invariants(t: &CpuTable, cfg: &TableConfig) {
    let (nb, slots) = t.dump_slots();
    let mut seen = HashSet::new();
    for &(b, _, key, dg, _) in &slots {
        assert!(seen.insert(key), "key {key} stored twice");
        assert_eq!(dg, digest(key), "digest of key {key} disagrees");
        let home = b == bucket1(key, nb) || (cfg.mode == BucketMode::Dual && b == bucket2(key, nb));
        assert!(home, "key {key} sits in bucket {b}, not one of its candidates");
    }
    assert_eq!(t.size(), slots.len() as u64, "size counter disagrees with the slots");
    assert!(t.size() <= t.capacity());
    assert_eq!(t.stats().lock.violations, 0);
}

fn run(cfg: TableConfig, steps: Vec<Step>) {
    let clock = ManualClock::new(1 << 20);
    let table = CpuTable::with_clock(cfg.clone(), clock.clone()).unwrap();
    let mut model = Model::new(cfg.clone());
    let dim = cfg.dim;
    let policy = cfg.policy;
    let takes = policy.takes_scores();
    let opt = |s: &Vec<u64>| takes.then(|| s.clone());
    for st in steps {
        let now = clock.now();
        match st {
            Step::Insert { keys, vals, scores } => {
                let v = values(&vals, dim);
                let sc = opt(&scores);
                let mut out = vec![Outcome::Absent; keys.len()];
                let sum = table.insert_or_assign(&keys, &v, sc.as_deref(), Some(&mut out)).unwrap();
                let (want, _) = model.upsert(&keys, &v, sc.as_deref(), now, false);
                assert_eq!(out, want, "insert_or_assign outcomes");
                assert_eq!(sum.inserted + sum.updated + sum.evicted + sum.rejected, keys.len() as u64);
            }
            Step::InsertEvict { keys, vals, scores } => {
                let v = values(&vals, dim);
                let sc = opt(&scores);
                let size0 = table.size();
                let mut out = vec![Outcome::Absent; keys.len()];
                let ev = table.insert_and_evict(&keys, &v, sc.as_deref(), Some(&mut out)).unwrap();
                let (want, lost) = model.upsert(&keys, &v, sc.as_deref(), now, false);
                assert_eq!(out, want, "insert_and_evict outcomes");
                assert_eq!(ev.keys, lost.iter().map(|(s, _)| s.key).collect::<Vec<_>>());
                assert_eq!(ev.scores, lost.iter().map(|(s, _)| s.score).collect::<Vec<_>>());
                assert_eq!(ev.kinds, lost.iter().map(|(_, l)| *l).collect::<Vec<_>>());
                assert_eq!(ev.values, lost.iter().flat_map(|(s, _)| s.value.clone()).collect::<Vec<_>>());
                // Conservation: new keys = size growth + evicted entries.
                let new = out.iter().filter(|o| matches!(o, Outcome::Inserted | Outcome::Evicted)).count() as u64;
                let evicted = ev.kinds.iter().filter(|k| **k == Lost::Evicted).count() as u64;
                assert_eq!(size0 + new, table.size() + evicted);
            }
            Step::FindOrInsert { keys, vals, scores } => {
                let mut v = values(&vals, dim);
                let mut mv = v.clone();
                let sc = opt(&scores);
                let mut out = vec![Outcome::Absent; keys.len()];
                table.find_or_insert(&keys, &mut v, sc.as_deref(), Some(&mut out)).unwrap();
                let want = model.find_or_insert(&keys, &mut mv, sc.as_deref(), now);
                assert_eq!(out, want, "find_or_insert outcomes");
                assert_eq!(v, mv, "find_or_insert values");
            }
            Step::Load { keys, vals, scores } => {
                let v = values(&vals, dim);
                table.load(&keys, &v, &scores).unwrap();
                model.upsert(&keys, &v, Some(&scores), now, true);
            }
            Step::Find { keys } => {
                let mut v = vec![-1.0; keys.len() * dim];
                let mut found = vec![false; keys.len()];
                let mut sc = vec![0; keys.len()];
                let hits = table.find(&keys, &mut v, &mut found, Some(&mut sc)).unwrap();
                let want = model.find(&keys);
                assert_eq!(hits, want.iter().filter(|w| w.is_some()).count());
                for (i, w) in want.iter().enumerate() {
                    assert_eq!(found[i], w.is_some());
                    match w {
                        Some((val, s)) => {
                            assert_eq!(&v[i * dim..(i + 1) * dim], &val[..]);
                            assert_eq!(sc[i], *s);
                        }
                        None => assert!(v[i * dim..(i + 1) * dim].iter().all(|&x| x == -1.0), "miss wrote values"),
                    }
                }
            }
            Step::Contains { keys } => {
                let mut found = vec![false; keys.len()];
                table.contains(&keys, &mut found).unwrap();
                let want: Vec<bool> = keys.iter().map(|&k| model.get(k).is_some()).collect();
                assert_eq!(found, want);
            }
            Step::Assign { keys, vals, scores } => {
                let v = values(&vals, dim);
                let sc = scores.filter(|_| takes);
                let mut out = vec![Outcome::Absent; keys.len()];
                table.assign(&keys, &v, sc.as_deref(), Some(&mut out)).unwrap();
                assert_eq!(out, model.assign(&keys, Some(&v), sc.as_deref(), now));
            }
            Step::AssignScores { keys, scores } => {
                let sc = scores.filter(|_| takes);
                let mut out = vec![Outcome::Absent; keys.len()];
                table.assign_scores(&keys, sc.as_deref(), Some(&mut out)).unwrap();
                assert_eq!(out, model.assign(&keys, None, sc.as_deref(), now));
            }
            Step::Accum { keys, vals, scores } => {
                let v = values(&vals, dim);
                let sc = opt(&scores);
                let mut out = vec![Outcome::Absent; keys.len()];
                table.accum_or_assign(&keys, &v, sc.as_deref(), Some(&mut out)).unwrap();
                assert_eq!(out, model.accum_or_assign(&keys, &v, sc.as_deref(), now));
            }
            Step::Erase { keys } => {
                let mut erased = vec![false; keys.len()];
                let n = table.erase(&keys, Some(&mut erased)).unwrap();
                let want = model.erase(&keys);
                assert_eq!(erased, want);
                assert_eq!(n, want.iter().filter(|&&b| b).count());
            }
            Step::EraseIf { mask, pattern, below } => {
                let f = Filter { key_mask: mask, key_pattern: pattern, ..Filter::score_below(below) };
                assert_eq!(table.erase_if(&f).unwrap(), model.erase_if(&f));
            }
            Step::Export { offset, n, min_score } => {
                let f = Filter::score_at_least(min_score);
                let e = table.export_batch_if(offset, n, &f).unwrap();
                let (k, v, s) = model.export(offset, n, &f);
                assert_eq!((e.keys, e.values, e.scores), (k, v, s));
            }
            Step::Clear => {
                table.clear().unwrap();
                model.clear();
            }
            Step::Reserve { factor } => {
                let want = cfg.capacity * factor;
                match table.reserve(want) {
                    Ok(()) => {
                        while model.capacity() < want && model.nb() * 2 <= cfg.max_buckets() {
                            model.rehash(model.nb() * 2);
                        }
                    }
                    Err(_) => assert!(want > cfg.max_buckets() * 128),
                }
            }
            Step::Tick { ns } => clock.advance(ns),
            Step::Epoch { e } => {
                table.set_global_epoch(e);
                model.epoch = e;
            }
        }
        assert_eq!(table.capacity(), model.capacity(), "capacity");
        let (_, slots) = table.dump_slots();
        let got: Vec<(u64, usize, u64, u64)> = slots.iter().map(|&(b, s, k, _, sc)| (b, s, k, sc)).collect();
        assert_eq!(got, model.slots(), "slot contents differ from the model");
        let all = table.export_batch(0, u64::MAX).unwrap();
        assert_eq!(all.values, model.export(0, u64::MAX, &Filter::ALL).1, "values differ from the model");
        check_invariants(&table, &cfg);
    }
}

trait Now {
    fn now(&self) -> u64;
}
impl Now for ManualClock {
    fn now(&self) -> u64 {
        use hkv_shard::score::Clock;
        self.now_ns()
    }
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

proptest! {
    // PROPTEST_CASES raises the count for soak runs.
    #![proptest_config(ProptestConfig { cases: cases(160), max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn table_matches_model(cfg in config(), steps in prop::collection::vec(step(900), 1..60)) {
        run(cfg, steps);
    }
}

/// A table much smaller than the key space with heavy eviction, many steps.
#[test]
fn long_eviction_heavy_sequences_match_model() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config { cases: cases(160) / 6, ..Config::default() });
    let strat = (config(), prop::collection::vec(step(4000), 100..200));
    runner
        .run(&strat, |(cfg, steps)| {
            run(cfg, steps);
            Ok(())
        })
        .unwrap();
}
