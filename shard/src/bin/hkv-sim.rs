//! hkv-sim: cache quality of the table under a Zipfian key stream.
//!
//! Replays `stream-multiple × capacity` accesses drawn from Zipf(alpha) over
//! `keyspace` keys, in batches: each batch is first looked up (hits counted),
//! then written with insert_or_assign. Beside the table, the same stream runs
//! through an ideal fully associative cache of the same capacity and policy
//! with the same batch semantics. Prints the hit rates, the load factor at
//! the first eviction, and the top-N retention of the paper's Table 11: the
//! share of the ideal highest-scored N = capacity keys — the final contents
//! of the ideal fully associative cache of the same policy — that the table
//! holds at the end. For Lru these are exactly the N most recently accessed
//! keys. Also printed: the share of the N most frequently accessed keys held
//! (`popular_n_retention`), the same figure for the ideal cache, and the hit
//! rate ceiling (the probability mass of the `capacity` most popular keys).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use hkv_shard::cpu::CpuTable;
use hkv_shard::score::ManualClock;
use hkv_shard::{BucketMode, Outcome, ScorePolicy, Shard, TableConfig};
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};

#[derive(Parser, Debug)]
#[command(name = "hkv-sim", about = "Cache quality of the HKV table vs an ideal fully associative cache")]
struct Args {
    /// Table capacity in slots (a multiple of 128 keeps it exact).
    #[arg(long, default_value_t = 1 << 20)]
    capacity: u64,
    /// Zipf exponent of the key popularity.
    #[arg(long, default_value_t = 0.99)]
    alpha: f64,
    /// Distinct keys in the stream's universe (default: 10 × capacity).
    #[arg(long)]
    keyspace: Option<u64>,
    /// Accesses = stream-multiple × capacity.
    #[arg(long, default_value_t = 5.0)]
    stream_multiple: f64,
    /// Score policy: lru or lfu.
    #[arg(long, default_value = "lru")]
    policy: String,
    /// Bucket mode: single or dual.
    #[arg(long, default_value = "single")]
    mode: String,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keys per batch.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Ideal fully associative cache with the table's batch semantics.
trait Ideal {
    fn contains(&self, key: u64) -> bool;
    /// Every key held.
    fn keys(&self) -> Vec<u64>;
    /// Writes one key (refresh or insert, evicting the global minimum).
    fn write(&mut self, key: u64, now: u64);
}

/// Exact LRU: a recency-ordered set.
struct IdealLru {
    cap: usize,
    last: HashMap<u64, u64>,
    order: BTreeSet<(u64, u64)>,
}

impl Ideal for IdealLru {
    fn contains(&self, key: u64) -> bool {
        self.last.contains_key(&key)
    }
    fn keys(&self) -> Vec<u64> {
        self.last.keys().copied().collect()
    }
    fn write(&mut self, key: u64, now: u64) {
        if let Some(t) = self.last.insert(key, now) {
            self.order.remove(&(t, key));
        } else if self.last.len() > self.cap {
            let (t, victim) = self.order.pop_first().expect("non-empty");
            debug_assert!(t <= now);
            self.last.remove(&victim);
        }
        self.order.insert((now, key));
    }
}

/// Exact LFU with the table's rules: count while resident, newcomers always
/// admitted with count 1, the minimum count (least recent on ties) evicted.
struct IdealLfu {
    cap: usize,
    entry: HashMap<u64, (u64, u64)>,
    order: BTreeSet<(u64, u64, u64)>,
}

impl Ideal for IdealLfu {
    fn contains(&self, key: u64) -> bool {
        self.entry.contains_key(&key)
    }
    fn keys(&self) -> Vec<u64> {
        self.entry.keys().copied().collect()
    }
    fn write(&mut self, key: u64, now: u64) {
        match self.entry.get(&key).copied() {
            Some((c, t)) => {
                self.order.remove(&(c, t, key));
                self.entry.insert(key, (c + 1, now));
                self.order.insert((c + 1, now, key));
            }
            None => {
                if self.entry.len() == self.cap {
                    let (_, _, victim) = self.order.pop_first().expect("non-empty");
                    self.entry.remove(&victim);
                }
                self.entry.insert(key, (1, now));
                self.order.insert((1, now, key));
            }
        }
    }
}

/// Σ_{r=1..n} r^-alpha, summed from the small terms up for accuracy.
fn harmonic(n: u64, alpha: f64) -> f64 {
    (1..=n).rev().map(|r| (r as f64).powf(-alpha)).sum()
}

fn main() -> Result<()> {
    let a = Args::parse();
    let policy: ScorePolicy = a.policy.parse().context("--policy")?;
    if !matches!(policy, ScorePolicy::Lru | ScorePolicy::Lfu) {
        bail!("--policy must be lru or lfu (the ideal cache is defined for those)");
    }
    let mode = match a.mode.as_str() {
        "single" => BucketMode::Single,
        "dual" => BucketMode::Dual,
        m => bail!("--mode must be single or dual, not {m:?}"),
    };
    if a.capacity == 0 || a.batch == 0 {
        bail!("--capacity and --batch must be positive");
    }
    let keyspace = a.keyspace.unwrap_or(a.capacity * 10);
    if a.alpha.is_nan() || a.alpha <= 0.0 || keyspace == 0 {
        bail!("--alpha must be > 0 and --keyspace positive");
    }
    let total = (a.stream_multiple * a.capacity as f64) as u64;
    let started = Instant::now();

    let clock = ManualClock::new(1);
    let cfg = TableConfig { dim: 1, ..TableConfig::new(a.capacity, 1) }.policy(policy).mode(mode);
    let table = CpuTable::with_clock(cfg, clock.clone() as Arc<_>)?;
    let capacity = table.capacity();
    let mut ideal: Box<dyn Ideal> = match policy {
        ScorePolicy::Lru => Box::new(IdealLru { cap: capacity as usize, last: HashMap::new(), order: BTreeSet::new() }),
        _ => Box::new(IdealLfu { cap: capacity as usize, entry: HashMap::new(), order: BTreeSet::new() }),
    };

    let zipf = Zipf::new(keyspace, a.alpha).context("zipf parameters")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    // Per key: (latest access, accesses) — the ideal scores for top-N.
    let mut truth: HashMap<u64, (u64, u64)> = HashMap::new();
    let (mut hits, mut ideal_hits, mut done) = (0u64, 0u64, 0u64);
    let mut first_eviction: Option<f64> = None;
    let mut keys = Vec::with_capacity(a.batch);
    let mut found = vec![false; a.batch];
    let mut vals = vec![0.0f32; a.batch];
    let mut outcomes = vec![Outcome::Absent; a.batch];
    let ones = vec![1u64; a.batch];
    let mut step = 0u64;
    while done < total {
        let n = a.batch.min((total - done) as usize);
        keys.clear();
        for _ in 0..n {
            let rank = zipf.sample(&mut rng) as u64;
            keys.push(splitmix64(rank ^ a.seed.rotate_left(32)) >> 1);
        }
        hits += table.find(&keys, &mut vals[..n], &mut found[..n], None)? as u64;
        ideal_hits += keys.iter().filter(|&&k| ideal.contains(k)).count() as u64;
        step += 1;
        clock.set(step);
        let size0 = table.size();
        let scores = (policy == ScorePolicy::Lfu).then(|| &ones[..n]);
        table.insert_or_assign(&keys, &vals[..n], scores, Some(&mut outcomes[..n]))?;
        if first_eviction.is_none() {
            if let Some(i) = outcomes[..n].iter().position(|o| matches!(o, Outcome::Evicted | Outcome::Rejected)) {
                let placed = outcomes[..i].iter().filter(|o| **o == Outcome::Inserted).count() as u64;
                first_eviction = Some((size0 + placed) as f64 / capacity as f64);
            }
        }
        for (i, &k) in keys.iter().enumerate() {
            let at = done + i as u64;
            ideal.write(k, at);
            let e = truth.entry(k).or_insert((0, 0));
            *e = (at, e.1 + 1);
        }
        done += n as u64;
    }

    // Top-N: the ideal cache's final contents, held by the table?
    let retention = |keys: &[u64]| -> Result<f64> {
        let mut present = vec![false; keys.len()];
        table.contains(keys, &mut present)?;
        Ok(if keys.is_empty() { 1.0 } else { present.iter().filter(|&&p| p).count() as f64 / keys.len() as f64 })
    };
    let top_n_retention = retention(&ideal.keys())?;
    // The N most frequently accessed keys (latest access breaks ties).
    let mut ranked: Vec<(u64, u64, u64)> = truth.iter().map(|(&k, &(last, count))| (count, last, k)).collect();
    let n_top = (capacity as usize).min(ranked.len());
    if n_top < ranked.len() {
        ranked.select_nth_unstable_by(n_top - 1, |a, b| b.cmp(a));
    }
    let popular: Vec<u64> = ranked[..n_top].iter().map(|t| t.2).collect();
    let popular_n_retention = retention(&popular)?;
    let ideal_popular = popular.iter().filter(|&&k| ideal.contains(k)).count() as f64 / n_top.max(1) as f64;

    let hit_rate = hits as f64 / total as f64;
    let ideal_hit_rate = ideal_hits as f64 / total as f64;
    let ceiling = harmonic(capacity.min(keyspace), a.alpha) / harmonic(keyspace, a.alpha);
    let first = first_eviction.unwrap_or(table.load_factor());
    let secs = started.elapsed().as_secs_f64();

    println!("hkv-sim: {} mode, {} policy, capacity {capacity}, keyspace {keyspace}, alpha {}, {total} accesses in batches of {}, seed {}",
        a.mode, a.policy, a.alpha, a.batch, a.seed);
    println!("{:<34} {:>10}", "metric", "value");
    println!("{:<34} {:>9.3}%", "hit rate (table)", hit_rate * 100.0);
    println!("{:<34} {:>9.3}%", "hit rate (ideal fully assoc.)", ideal_hit_rate * 100.0);
    println!("{:<34} {:>9.3}%", "hit rate ceiling (top-capacity mass)", ceiling * 100.0);
    println!("{:<34} {:>+9.3} pp", "table - ideal", (hit_rate - ideal_hit_rate) * 100.0);
    match first_eviction {
        Some(f) => println!("{:<34} {:>10.4}", "first-eviction load factor", f),
        None => println!("{:<34} {:>10}", "first-eviction load factor", "none"),
    }
    println!("{:<34} {:>9.3}%", "top-N retention", top_n_retention * 100.0);
    println!("{:<34} {:>9.3}%", "popular-N retention (table)", popular_n_retention * 100.0);
    println!("{:<34} {:>9.3}%", "popular-N retention (ideal)", ideal_popular * 100.0);
    println!("{:<34} {:>10.4}", "final load factor", table.load_factor());
    println!("{:<34} {:>9.1}s", "wall time", secs);
    if a.json {
        let j = serde_json::json!({
            "mode": a.mode, "policy": a.policy, "capacity": capacity, "keyspace": keyspace,
            "alpha": a.alpha, "accesses": total, "batch": a.batch, "seed": a.seed,
            "hit_rate": hit_rate, "ideal_hit_rate": ideal_hit_rate, "ceiling_hit_rate": ceiling,
            "first_eviction_load_factor": first, "evicted": first_eviction.is_some(),
            "top_n_retention": top_n_retention, "popular_n_retention": popular_n_retention,
            "ideal_popular_n_retention": ideal_popular, "final_load_factor": table.load_factor(), "seconds": secs,
        });
        println!("{j}");
    }
    Ok(())
}
