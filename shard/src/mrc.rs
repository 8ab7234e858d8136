//! Miss-ratio curves: the hit rate a fully associative LRU cache of another
//! size would have on the keys a table sees, estimated live at a small,
//! fixed cost (issue 27).
//!
//! The estimator is SHARDS (Waldspurger et al., FAST '15) in its fixed-size
//! variant with the SHARDS_adj correction:
//! - *Spatial sampling.* A key is sampled when `sample_hash(key, seed) <
//!   threshold` ([`Sampler`]); every access of a sampled key is, so the
//!   sample is a set of keys with all their accesses. The rate is
//!   `threshold / 2^64`.
//! - *Fixed size.* At most `max_keys` distinct sampled keys are tracked.
//!   When one more would be, the tracked key with the largest hash leaves
//!   and the threshold drops to its hash: the rate adapts so that the
//!   memory stays fixed whatever the key space.
//! - *Reuse distances.* For each sampled access, the number of distinct
//!   sampled keys accessed since the key's previous access ([`LruStack`]: a
//!   Fenwick tree over access times, O(log n) per access), divided by the
//!   rate at that access, is an estimate of its LRU stack distance. An LRU
//!   cache of `c` slots hits exactly the accesses whose distance is below
//!   `c`. Each sampled access weighs `1 / rate` in a histogram of distances
//!   (64 bins per octave).
//! - *Adjustment.* The sampled weight should sum to the accesses observed;
//!   the difference (a hot key in or out of the sample) is added to the
//!   shortest distance, as SHARDS_adj does: hot keys are hits at every size.
//!
//! Unsampled keys cost one hash and one comparison in [`Mrc::observe`], so
//! it can sit on the request path. A GPU kernel applies the same filter with
//! [`Sampler`] (the hash is specified byte for byte there) and hands the
//! sampled keys to [`Mrc::observe_sampled`].

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};

/// The capacity factors of a [`Curve`]: 1/8× to 8× a table's capacity.
pub const FACTORS: [f64; 7] = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// The default sampling seed (XORed into the key before the sampling mix).
pub const SAMPLE_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// The default number of distinct sampled keys tracked ([`MrcConfig::max_keys`]).
pub const DEFAULT_MAX_KEYS: usize = 16 * 1024;

/// The sampling hash: the splitmix64 finalizer (Stafford's "mix13") of
/// `key ^ seed`, all arithmetic on u64 wrapping:
///
/// ```text
/// z = key ^ seed
/// z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
/// z = (z ^ (z >> 27)) * 0x94d049bb133111eb
/// z =  z ^ (z >> 31)
/// ```
///
/// Independent of the table's hashes ([`crate::hash`]: Murmur3's fmix64 of
/// the key, of `key ^ DUAL_SEED` and of `key ^ SHARD_SEED`): other shifts
/// and multipliers and another seed, so which keys are sampled does not
/// depend on their bucket or shard. See [`SAMPLE_HASH_VECTORS`].
#[inline(always)]
pub const fn sample_hash(key: u64, seed: u64) -> u64 {
    let mut z = key ^ seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `(key, sample_hash(key, SAMPLE_SEED))` pairs, for a reimplementation
/// (a CUDA kernel) to check itself against.
pub const SAMPLE_HASH_VECTORS: [(u64, u64); 4] = [
    (0, 0x492b_8d60_66c0_9227),
    (1, 0x3564_b439_cd1e_1f16),
    (0x0123_4567_89ab_cdef, 0xbd41_03c0_d7ac_25a6),
    (u64::MAX - 4, 0x5aee_84d6_4944_46a1),
];

/// The sampling filter's parameters: a key is sampled when
/// `sample_hash(key, seed) < threshold`, compared as unsigned 64-bit
/// integers (`P = 2^64`; the rate is `threshold / 2^64`; a threshold of
/// `u64::MAX` samples every key but the one whose hash is `u64::MAX`).
/// A kernel reads these two words from [`Mrc::sampler`] before a batch;
/// keys it samples under an older threshold are filtered again by
/// [`Mrc::observe_sampled`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sampler {
    /// XORed into the key before the mix.
    pub seed: u64,
    /// Keys whose hash is below this are sampled.
    pub threshold: u64,
}

impl Sampler {
    /// Whether `key` is sampled.
    #[inline(always)]
    pub const fn sampled(self, key: u64) -> bool {
        sample_hash(key, self.seed) < self.threshold
    }

    /// The share of keys sampled, `threshold / 2^64`.
    pub fn rate(self) -> f64 {
        self.threshold as f64 / TWO_64
    }
}

/// `sample_hash(key, seed) < threshold`: [`Sampler::sampled`] as a plain function.
#[inline(always)]
pub const fn sampled(key: u64, seed: u64, threshold: u64) -> bool {
    sample_hash(key, seed) < threshold
}

const TWO_64: f64 = 18_446_744_073_709_551_616.0;

/// How an [`Mrc`] samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MrcConfig {
    /// Distinct sampled keys tracked at most (the memory budget: about
    /// [`Mrc::BYTES_PER_KEY`] bytes each).
    pub max_keys: usize,
    /// The sampling hash's seed.
    pub seed: u64,
    /// The rate to start at, in (0, 1]; it only ever drops from there.
    pub initial_rate: f64,
}

impl Default for MrcConfig {
    fn default() -> Self {
        MrcConfig { max_keys: DEFAULT_MAX_KEYS, seed: SAMPLE_SEED, initial_rate: 1.0 }
    }
}

/// The estimated hit rate at one capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MrcPoint {
    /// The capacity as a factor of the table's.
    pub factor: f64,
    /// Slots.
    pub capacity: u64,
    /// Estimated hit rate of a fully associative LRU cache of `capacity`
    /// slots, in [0, 1].
    pub hit_rate: f64,
}

/// A miss-ratio curve: the hit rates at [`FACTORS`] of a capacity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Curve {
    /// One point per factor of [`FACTORS`], in that order.
    pub points: Vec<MrcPoint>,
    /// Accesses observed (sampled or not).
    pub accesses: u64,
    /// Accesses of sampled keys.
    pub sampled_accesses: u64,
    /// Distinct sampled keys tracked now.
    pub tracked_keys: u64,
    /// The sampling rate now.
    pub rate: f64,
}

/// Histogram bins per octave of distance: a bin spans 1.1 % of its distance.
const SUB: f64 = 64.0;
/// Bin 0 holds distances below 1; bin `1 + floor(log2(d) * SUB)` the others.
const BINS: usize = 1 + 64 * SUB as usize;

#[inline]
fn bin_of(d: f64) -> usize {
    if d < 1.0 {
        0
    } else {
        (1 + (d.log2() * SUB) as usize).min(BINS - 1)
    }
}

/// The SHARDS estimator of one table's miss-ratio curve. See the module docs.
#[derive(Debug, Clone)]
pub struct Mrc {
    cfg: MrcConfig,
    threshold: u64,
    stack: LruStack,
    /// Tracked keys by hash, the largest first (the next to leave).
    by_hash: BinaryHeap<(u64, u64)>,
    /// Weight of sampled accesses per distance bin.
    hist: Vec<f64>,
    /// Weight of sampled accesses of all kinds (with first accesses).
    weight: f64,
    accesses: u64,
    sampled_accesses: u64,
}

impl Mrc {
    /// Bytes of memory per tracked key, about: the stack's map entry (16
    /// bytes and a control byte, at a load of 1/2 to 7/8), its four Fenwick
    /// cells (16) and the hash heap's entry (16).
    pub const BYTES_PER_KEY: usize = 72;

    /// An estimator with nothing observed.
    pub fn new(cfg: MrcConfig) -> Mrc {
        let cfg = MrcConfig { max_keys: cfg.max_keys.max(1), ..cfg };
        Mrc {
            threshold: Self::initial_threshold(&cfg),
            stack: LruStack::with_capacity(cfg.max_keys + 1),
            by_hash: BinaryHeap::with_capacity(cfg.max_keys + 1),
            hist: vec![0.0; BINS],
            weight: 0.0,
            accesses: 0,
            sampled_accesses: 0,
            cfg,
        }
    }

    fn initial_threshold(cfg: &MrcConfig) -> u64 {
        if cfg.initial_rate >= 1.0 || cfg.initial_rate.is_nan() {
            u64::MAX
        } else {
            (cfg.initial_rate.max(0.0) * TWO_64) as u64
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MrcConfig {
        &self.cfg
    }

    /// The filter in force now.
    pub fn sampler(&self) -> Sampler {
        Sampler { seed: self.cfg.seed, threshold: self.threshold }
    }

    /// The sampling rate now.
    pub fn rate(&self) -> f64 {
        self.sampler().rate()
    }

    /// Bytes held, about.
    pub fn memory_bytes(&self) -> usize {
        self.cfg.max_keys * Self::BYTES_PER_KEY + BINS * 8
    }

    /// Observes accesses of `keys`, in order. Unsampled keys cost one hash
    /// and one comparison.
    #[inline]
    pub fn observe(&mut self, keys: &[u64]) {
        self.accesses += keys.len() as u64;
        let seed = self.cfg.seed;
        for &k in keys {
            let h = sample_hash(k, seed);
            if h < self.threshold {
                self.sample(k, h);
            }
        }
    }

    /// Observes `accesses` accesses of which `keys` (in order) are the ones
    /// a filter with an earlier [`sampler`](Mrc::sampler) kept (a GPU
    /// kernel's ring): they are filtered again at the current threshold.
    pub fn observe_sampled(&mut self, keys: &[u64], accesses: u64) {
        self.accesses += accesses;
        for &k in keys {
            let h = sample_hash(k, self.cfg.seed);
            if h < self.threshold {
                self.sample(k, h);
            }
        }
    }

    /// One access of a sampled key.
    #[cold]
    fn sample(&mut self, key: u64, h: u64) {
        let rate = self.rate();
        let w = 1.0 / rate;
        self.sampled_accesses += 1;
        self.weight += w;
        match self.stack.access(key) {
            Some(d) => self.hist[bin_of(d as f64 / rate)] += w,
            None => {
                self.by_hash.push((h, key));
                if self.stack.len() > self.cfg.max_keys {
                    // The largest hash leaves; the threshold drops to it so
                    // that key (and every larger one) is no longer sampled.
                    let (h, k) = self.by_hash.pop().expect("a tracked key");
                    self.threshold = h;
                    self.stack.remove(k);
                }
            }
        }
    }

    /// The estimated hit rate of a fully associative LRU cache of
    /// `capacity` slots on the accesses observed (0 before any).
    pub fn hit_rate(&self, capacity: u64) -> f64 {
        if self.accesses == 0 || capacity == 0 {
            return 0.0;
        }
        // Accesses with a distance below `capacity`: whole bins, then the
        // share of the bin holding `capacity`, linear in log distance.
        let c = capacity as f64;
        let pos = c.log2() * SUB;
        let full = 1 + pos as usize;
        let mut hits: f64 = self.hist[..full.min(BINS)].iter().sum();
        if full < BINS {
            hits += self.hist[full] * pos.fract();
        }
        // SHARDS_adj: the weight the sample is missing (or has too much of)
        // belongs to hot keys, which hit at every size.
        hits += self.accesses as f64 - self.weight;
        (hits / self.accesses as f64).clamp(0.0, 1.0)
    }

    /// The curve at [`FACTORS`] of `capacity` slots.
    pub fn curve(&self, capacity: u64) -> Curve {
        let points = FACTORS
            .iter()
            .map(|&factor| {
                let c = (capacity as f64 * factor).round() as u64;
                MrcPoint { factor, capacity: c, hit_rate: self.hit_rate(c) }
            })
            .collect();
        Curve {
            points,
            accesses: self.accesses,
            sampled_accesses: self.sampled_accesses,
            tracked_keys: self.stack.len() as u64,
            rate: self.rate(),
        }
    }

    /// Forgets everything observed; the rate starts again at the initial one.
    pub fn reset(&mut self) {
        *self = Mrc::new(self.cfg);
    }
}

/// Hashes u64 keys for the stack's map with one multiply-xorshift round
/// (the keys may be sequential integers; SipHash would cost more than the
/// rest of a sampled access).
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    #[inline]
    fn write_u64(&mut self, k: u64) {
        let z = (k ^ (k >> 32)).wrapping_mul(0xd6e8_feb8_6659_fd93);
        self.0 = z ^ (z >> 32);
    }
}

type KeyMap = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

/// Exact LRU stack distances: for each access, how many distinct other keys
/// were accessed since the key's previous access. A fully associative LRU
/// cache of `c` slots hits an access exactly when its distance is below `c`.
///
/// Each tracked key's last access time is marked in a Fenwick tree; the
/// distance is the count of marks after the key's own. Times are indices in
/// a window of about four times the tracked keys; when it fills, the times
/// are renumbered densely (amortised O(log n) per access).
#[derive(Debug, Clone, Default)]
pub struct LruStack {
    last: KeyMap,
    /// Fenwick tree over times: `tree[i]` (1-based) sums its range of marks.
    tree: Vec<u32>,
    now: u32,
}

impl LruStack {
    const MIN_WINDOW: usize = 1024;

    /// An empty stack.
    pub fn new() -> LruStack {
        Self::with_capacity(0)
    }

    /// An empty stack with room for `keys` keys.
    pub fn with_capacity(keys: usize) -> LruStack {
        let window = (4 * keys).max(Self::MIN_WINDOW);
        LruStack { last: KeyMap::with_capacity_and_hasher(keys, Default::default()), tree: vec![0; window + 1], now: 0 }
    }

    /// Keys tracked.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    /// Records an access of `key`: its stack distance, or `None` for a
    /// key's first access (or the first since its removal).
    #[inline]
    pub fn access(&mut self, key: u64) -> Option<u64> {
        if self.now as usize + 1 >= self.tree.len() {
            self.compact();
        }
        let t = self.now;
        self.now += 1;
        let prev = self.last.insert(key, t);
        let d = prev.map(|t0| {
            // Marks are at times below `t`, one per tracked key.
            let d = self.last.len() as u64 - self.prefix(t0) as u64;
            self.add(t0, -1);
            d
        });
        self.add(t, 1);
        d
    }

    /// Stops tracking `key`.
    pub fn remove(&mut self, key: u64) {
        if let Some(t) = self.last.remove(&key) {
            self.add(t, -1);
        }
    }

    /// Marks at times `0..=t`.
    #[inline]
    fn prefix(&self, t: u32) -> u32 {
        let mut i = t as usize + 1;
        let mut s = 0;
        while i > 0 {
            s += self.tree[i];
            i &= i - 1;
        }
        s
    }

    #[inline]
    fn add(&mut self, t: u32, v: i32) {
        let mut i = t as usize + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add_signed(v);
            i += i & i.wrapping_neg();
        }
    }

    /// Renumbers the tracked keys' times `0..len` in their order and sizes
    /// the window to four times the keys.
    fn compact(&mut self) {
        let mut times: Vec<u32> = self.last.values().copied().collect();
        times.sort_unstable();
        for t in self.last.values_mut() {
            *t = times.binary_search(t).expect("a tracked time") as u32;
        }
        let n = times.len();
        let window = (4 * n).max(Self::MIN_WINDOW);
        assert!(window < u32::MAX as usize, "LruStack tracks fewer than 2^30 keys");
        // A Fenwick tree of ones at 0..n: cell i sums (i - lowbit(i), i].
        self.tree.clear();
        self.tree.resize(window + 1, 0);
        for i in 1..=window {
            let lo = i - (i & i.wrapping_neg());
            self.tree[i] = (i.min(n)).saturating_sub(lo) as u32;
        }
        self.now = n as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash matches its written-out test vectors (for a kernel to copy).
    #[test]
    fn sample_hash_vectors() {
        for (k, h) in SAMPLE_HASH_VECTORS {
            assert_eq!(sample_hash(k, SAMPLE_SEED), h, "key {k:#x}");
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
    /// estimate is exact (up to binning) and the rate stays 1.
    #[test]
    fn full_sample_is_exact() {
        let mut m = Mrc::new(MrcConfig { max_keys: 1 << 12, ..MrcConfig::default() });
        let keys: Vec<u64> = (0..10_000u64).map(|i| i % 100).collect();
        m.observe(&keys);
        let c = m.curve(100);
        assert!(c.rate > 0.999_999);
        // A cycle over 100 keys: distance 99 for every repeat.
        assert!((m.hit_rate(100) - 0.99).abs() < 1e-9, "{}", m.hit_rate(100));
        assert!(m.hit_rate(90) < 1e-9);
        assert_eq!(c.tracked_keys, 100);
    }

    /// The tracked keys never pass the budget, and reset forgets all.
    #[test]
    fn budget_is_kept() {
        let mut m = Mrc::new(MrcConfig { max_keys: 256, ..MrcConfig::default() });
        let keys: Vec<u64> = (0..100_000u64).collect();
        m.observe(&keys);
        let c = m.curve(1000);
        assert!(c.tracked_keys <= 256);
        assert!(c.rate < 0.01, "{}", c.rate);
        assert!(m.by_hash.len() == m.stack.len());
        m.reset();
        assert_eq!(m.curve(1000).accesses, 0);
        assert_eq!(m.sampler().threshold, u64::MAX);
    }
}
