//! The miss-ratio-curve estimator against exact fully associative LRU
//! caches simulated one access at a time (issue 27's bar at a small size:
//! mean absolute error ≤ 1 pp and worst point ≤ 2 pp with the default
//! budget, on Zipf streams of α 0.75 and 0.99 over a key space 10× the
//! capacity, 5× the capacity in accesses).

use std::collections::{BTreeSet, HashMap};

use hkv_shard::mrc::{sample_hash, Mrc, MrcConfig, Sampler, FACTORS, SAMPLE_SEED};
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};

const CAPACITY: u64 = 16 * 1024;

/// `n` accesses drawn from Zipf(alpha) over `keyspace` keys, the ranks
/// scattered over u64 so that the keys carry no order.
fn zipf_stream(alpha: f64, keyspace: u64, n: usize, seed: u64) -> Vec<u64> {
    let zipf = Zipf::new(keyspace, alpha).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| (zipf.sample(&mut rng) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 1).collect()
}

/// Hit rate of a fully associative LRU cache of `cap` entries: a
/// recency-ordered set, the least recent evicted when full.
fn lru_hit_rate(keys: &[u64], cap: usize) -> f64 {
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut order: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut hits = 0;
    for (t, &k) in keys.iter().enumerate() {
        if let Some(t0) = last.insert(k, t) {
            hits += 1;
            order.remove(&(t0, k));
        } else if order.len() == cap {
            let (_, old) = order.pop_first().unwrap();
            last.remove(&old);
        }
        order.insert((t, k));
    }
    hits as f64 / keys.len() as f64
}

/// (mean absolute error, worst error) in percentage points of the curve
/// against the exact LRU at every factor.
fn errors(cfg: MrcConfig, keys: &[u64]) -> (f64, f64) {
    let mut m = Mrc::new(cfg);
    for b in keys.chunks(1000) {
        m.observe(b);
    }
    let curve = m.curve(CAPACITY);
    assert_eq!(curve.points.len(), FACTORS.len());
    assert_eq!(curve.accesses, keys.len() as u64);
    assert!(curve.tracked_keys as usize <= cfg.max_keys);
    let (mut sum, mut worst) = (0.0f64, 0.0f64);
    for p in &curve.points {
        let exact = lru_hit_rate(keys, p.capacity as usize);
        let e = (p.hit_rate - exact).abs() * 100.0;
        eprintln!("factor {:>6}: shards {:.4} exact {exact:.4} ({e:.3} pp)", p.factor, p.hit_rate);
        sum += e;
        worst = worst.max(e);
    }
    (sum / curve.points.len() as f64, worst)
}

#[test]
fn shards_curve_matches_exact_lru_on_zipf() {
    for alpha in [0.75, 0.99] {
        for seed in [1, 2] {
            let keys = zipf_stream(alpha, 10 * CAPACITY, 5 * CAPACITY as usize, seed);
            for max_keys in [MrcConfig::default().max_keys, 8 * 1024] {
                let cfg = MrcConfig { max_keys, seed: SAMPLE_SEED ^ seed, ..MrcConfig::default() };
                let (mae, worst) = errors(cfg, &keys);
                eprintln!("alpha {alpha} seed {seed} max_keys {max_keys}: mae {mae:.3} pp, worst {worst:.3} pp");
                assert!(mae <= 1.0, "alpha {alpha} seed {seed} max_keys {max_keys}: mae {mae:.3} pp");
                assert!(worst <= 2.0, "alpha {alpha} seed {seed} max_keys {max_keys}: worst {worst:.3} pp");
            }
        }
    }
}

/// What a kernel applying [`Sampler`] to a batch hands over gives the same
/// curve as observing the batch on the host, even when the threshold drops
/// between the kernel's filter and the host's.
#[test]
fn observe_sampled_equals_observe() {
    let keys = zipf_stream(0.9, 1 << 16, 1 << 15, 3);
    let cfg = MrcConfig { max_keys: 512, ..MrcConfig::default() };
    let (mut host, mut device) = (Mrc::new(cfg), Mrc::new(cfg));
    for b in keys.chunks(4096) {
        host.observe(b);
        let s: Sampler = device.sampler();
        let picked: Vec<u64> = b.iter().copied().filter(|&k| s.sampled(k)).collect();
        device.observe_sampled(&picked, b.len() as u64);
    }
    assert_eq!(host.curve(4096), device.curve(4096));
    let s = host.sampler();
    assert!(keys.iter().all(|&k| s.sampled(k) == (sample_hash(k, s.seed) < s.threshold)));
}

/// The curve travels as JSON (daemon stats) and comes back equal.
#[test]
fn curve_round_trips_through_json() {
    let mut m = Mrc::new(MrcConfig::default());
    m.observe(&zipf_stream(0.99, 1 << 14, 1 << 13, 4));
    let c = m.curve(1024);
    let back: hkv_shard::mrc::Curve = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    // Hit rates never fall as the capacity grows.
    assert!(c.points.windows(2).all(|w| w[0].hit_rate <= w[1].hit_rate + 1e-12));
}

/// `hkv-sim --mrc` prints the estimate beside the exact LRU; its JSON line
/// carries the errors, within the bar at a small size.
#[test]
fn hkv_sim_mrc_reports_the_errors() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hkv-sim"))
        .args(["--mrc", "--capacity", "4096", "--alpha", "0.9", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("mean absolute error"), "{text}");
    let j: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(j["points"].as_array().unwrap().len(), FACTORS.len());
    assert!(j["mae_pp"].as_f64().unwrap() <= 1.0, "{text}");
    assert!(j["worst_pp"].as_f64().unwrap() <= 2.0, "{text}");
}
