//! The estimator's unit tests.

use super::*;
use std::collections::HashMap;

/// The hash matches its written-out test vectors (for a kernel to copy).
#[test]
fn sample_hash_vectors() {
    for (k, h) in SAMPLE_HASH_VECTORS {
        assert_eq!(sample_hash(k, SAMPLE_SEED), h, "key {k:#x}");
    }
}

/// The entry map against a HashMap, through inserts and removals that
/// wrap around the table and shift runs back.
#[test]
fn slots_match_a_hash_map() {
    let mut slots = Slots::new(300);
    let mut model: HashMap<u64, u32> = HashMap::new();
    let mut x = 3u64;
    for i in 0..200_000u32 {
        x = sample_hash(x, i as u64);
        // Few distinct keys, some sequential: long runs.
        let key = if i % 3 == 0 { x % 400 } else { (x % 400) * 0x9e37_79b9_7f4a_7c15 };
        if model.len() < 300 && i % 2 == 0 {
            if let std::collections::hash_map::Entry::Vacant(v) = model.entry(key) {
                v.insert(i);
                slots.insert(key, i);
            }
        } else {
            assert_eq!(slots.remove(key), model.remove(&key), "remove {key} at {i}");
        }
        assert_eq!(slots.len(), model.len());
        let probe = x.rotate_left(7) % 400;
        for k in [key, probe, probe * 0x9e37_79b9_7f4a_7c15] {
            assert_eq!(slots.get(k), model.get(&k).copied(), "get {k} at {i}");
        }
    }
}

/// The Fenwick stack against a plain recency list, across compactions.
#[test]
fn stack_distances_match_a_plain_list() {
    let mut stack = LruStack::new();
    let mut list: Vec<u64> = Vec::new(); // most recent last
    let mut x = 7u64;
    for i in 0..20_000u64 {
        x = sample_hash(x, i);
        let key = x % 700;
        if i % 97 == 0 {
            stack.remove(key);
            list.retain(|&k| k != key);
            continue;
        }
        let want = list.iter().rposition(|&k| k == key).map(|p| (list.len() - 1 - p) as u64);
        assert_eq!(stack.access(key), want, "access {i}");
        list.retain(|&k| k != key);
        list.push(key);
        assert_eq!(stack.len(), list.len());
    }
}

/// With a budget above the distinct keys nothing is dropped: the
/// estimate is exact and the rate stays 1.
#[test]
fn full_sample_is_exact() {
    let mut m = Mrc::new(MrcConfig { max_keys: 1 << 12, ..MrcConfig::default() }, 100);
    let keys: Vec<u64> = (0..10_000u64).map(|i| i % 100).collect();
    m.observe(&keys);
    let c = m.curve();
    assert!(c.rate > 0.999_999);
    // A cycle over 100 keys: every repeat hits at 1× and above, none below.
    assert!((c.points[3].hit_rate - 0.99).abs() < 1e-9, "{:?}", c.points);
    assert!(c.points[2].hit_rate < 1e-9);
    assert_eq!(c.tracked_keys, 100);
}

/// The tracked keys never pass the budget, and reset forgets all.
#[test]
fn budget_is_kept() {
    let mut m = Mrc::new(MrcConfig { max_keys: 256, ..MrcConfig::default() }, 1000);
    let keys: Vec<u64> = (0..100_000u64).collect();
    m.observe(&keys);
    let c = m.curve();
    assert!(c.tracked_keys <= 256);
    assert!(c.rate < 0.01, "{}", c.rate);
    assert!(m.by_hash.len() == m.map.len());
    assert!(m.lists.iter().all(|l| l.len <= l.cap));
    m.reset();
    assert_eq!(m.curve().accesses, 0);
    // Back at the start: 2 × 256 of the 1000 slots' keys.
    assert!((m.rate() - START_SPAN * 256.0 / 1000.0).abs() < 1e-9, "{}", m.rate());
}

/// A new table's estimator starts at `START_SPAN × max_keys / capacity`
/// (rate 1 where that is above 1), and on a stream of more distinct keys
/// than that start can hold its curve is the one a start at rate 1 gives.
#[test]
fn start_rate_follows_the_capacity() {
    let cfg = MrcConfig { max_keys: 1024, ..MrcConfig::default() };
    assert_eq!(Mrc::new(cfg, 1024).sampler().threshold, u64::MAX);
    assert!((Mrc::new(cfg, 1 << 16).rate() - 1.0 / 32.0).abs() < 1e-9);
    assert!((Mrc::new(MrcConfig { initial_rate: 0.01, ..cfg }, 1 << 16).rate() - 0.01).abs() < 1e-9);
    // Zipf-like over 200 Ki keys through a 16 Ki-slot table, in batches.
    let mut capped = Mrc::new(cfg, 1 << 14);
    let mut from_one = Mrc::new(cfg, 1 << 14);
    from_one.threshold = u64::MAX;
    let mut x = 1u64;
    for b in 0..200u64 {
        let keys: Vec<u64> = (0..2048u64)
            .map(|i| {
                x = sample_hash(x, b * 4096 + i);
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                (200_000.0 * u.powi(3)) as u64
            })
            .collect();
        capped.observe(&keys);
        from_one.observe(&keys);
    }
    let (a, b) = (capped.curve(), from_one.curve());
    assert!(a.tracked_keys > 900 && b.tracked_keys > 900, "{} {}", a.tracked_keys, b.tracked_keys);
    for (p, q) in a.points.iter().zip(&b.points) {
        assert!((p.hit_rate - q.hit_rate).abs() < 0.01, "{:?}\n{:?}", a.points, b.points);
    }
}
