//! Miss-ratio curves: the hit rate a fully associative LRU cache of another
//! size would have on the lookups a table sees, estimated live at a small,
//! fixed cost (issues 27 and 32).
//!
//! The estimator is SHARDS (Waldspurger et al., FAST '15) in its fixed-size
//! variant with the SHARDS_adj correction, its caches simulated in
//! miniature (Waldspurger et al., ATC '17):
//! - *Spatial sampling.* A key is sampled when `sample_hash(key, seed) <
//!   threshold` ([`Sampler`]); every operation on a sampled key is, so the
//!   sample is a set of keys with all their operations. The rate is
//!   `threshold / 2^64`.
//! - *Fixed size.* At most `max_keys` distinct sampled keys are tracked.
//!   When one more would be, the tracked key with the largest hash leaves
//!   and the threshold drops to its hash: the rate adapts so that the
//!   memory stays fixed whatever the key space.
//! - *References and writes* (issue 32). Each sample carries its
//!   operation's [`Kind`] and its batch ([`tag`]). Lookups (find, contains,
//!   find_or_insert) are the references: counted, as the table counts its
//!   hits and misses. Writes are not references; they place or refresh
//!   keys, as in the table, whose LRU score is set by writes and
//!   find_or_insert, not by finds. A write of a key looked up in the
//!   batch before answers that lookup (the client's write-back of a hit,
//!   or its fill of a miss); a lookup no write answers before the next
//!   lookup batch moves nothing. A write no lookup asked for places the
//!   key.
//! - *Miniature caches.* For each factor of [`FACTORS`] a cache of
//!   `factor × capacity × rate` sampled keys, a recency list, runs the
//!   sampled operations: a lookup hits where its key is held. At a size
//!   where the lookup's outcome differs from the table's own (1×), the
//!   client is taken to do what it was last seen doing for that outcome
//!   (writing back hits or not, filling misses or not, learnt from the
//!   writes that follow lookups), so that a client that inserts only its
//!   misses fills a miss at 1/8× that hit the table. A stack-distance
//!   histogram (the first version) could not: a cache whose hits are not
//!   refreshed is not a stack algorithm. Each sampled lookup weighs
//!   `1 / rate`.
//! - *Adjustment.* The sampled lookup weight should sum to the lookups
//!   observed; the difference (a hot key in or out of the sample) counts as
//!   hits at every size, as SHARDS_adj does.
//!
//! Unsampled keys cost one hash and one comparison in [`Mrc::observe`] or
//! in a shard's filter ([`crate::sample`]). A GPU kernel applies the same
//! filter with [`Sampler`] (the hash is specified byte for byte there) and
//! tags; drains reach [`Mrc::observe_samples`]. [`LruStack`] (exact LRU
//! stack distances) serves `hkv-sim`'s exact curves.

use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

mod kind;
mod slots;
mod stack;
#[cfg(test)]
mod tests;

pub use kind::{batch_of, outcome, tag, with_outcome, Kind, Samples, OUTCOME_HIT, OUTCOME_KNOWN};
use slots::Slots;
pub use stack::LruStack;

/// The capacity factors of a [`Curve`]: 1/8× to 8× a table's capacity.
pub const FACTORS: [f64; 7] = [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0];

/// The default sampling seed (XORed into the key before the sampling mix).
pub const SAMPLE_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// A new estimator samples at most `START_SPAN × max_keys / capacity` of
/// the keys ([`Mrc::new`]).
pub const START_SPAN: f64 = 2.0;

/// The fewest distinct sampled keys a curve is worth estimating from (the
/// least [`MrcConfig::max_keys`] the daemon and `hkv-sim` take).
pub const MIN_KEYS: usize = 256;
/// The most distinct sampled keys tracked (120 MiB per table).
pub const MAX_KEYS: usize = 1 << 20;

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
/// [`Mrc::observe_samples`].
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
    /// The rate to start at, in (0, 1], at most [`START_SPAN`] ×
    /// `max_keys` / capacity ([`Mrc::new`]); it only ever drops from there.
    pub initial_rate: f64,
    /// Whether the table's find hits refresh scores (its reads refresh:
    /// `TableConfig::refreshes_reads`): then a lookup that hits one of the
    /// simulated caches makes the key its most recent, as the table's find
    /// does, whatever the client writes after it.
    pub reads_refresh: bool,
}

impl Default for MrcConfig {
    fn default() -> Self {
        MrcConfig { max_keys: DEFAULT_MAX_KEYS, seed: SAMPLE_SEED, initial_rate: 1.0, reads_refresh: false }
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
    /// Sampled keys the shard's buffer lost (full) before they reached
    /// the estimator, since it started: 0 unless the sampler fell behind.
    #[serde(default)]
    pub dropped: u64,
    /// Lookups those dropped keys stood for, left out of `accesses`: the
    /// lookups the shard served while sampling are `accesses` plus these.
    #[serde(default)]
    pub dropped_lookups: u64,
}

const NIL: u32 = u32::MAX;
const N: usize = FACTORS.len();
/// The factor whose simulated cache stands for the table itself (1×).
const ONE: usize = 3;
/// The weight of one observation in the learnt client behaviour.
const LEARN: f64 = 1.0 / 32.0;

/// One tracked key: its place in each simulated cache's recency list and
/// its lookup awaiting the client's answer. One 64-byte line: a list
/// operation reads the entry and its neighbours, often the same entries in
/// every list.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct Entry {
    /// Per simulated cache: toward the most and the least recent.
    prev: [u32; N],
    next: [u32; N],
    /// The lookup's place in [`Mrc::pending`] (while `pending`).
    pending_pos: u32,
    /// Bit i: the key is in cache i.
    member: u8,
    /// Bit i: the key was in cache i at its last lookup, not yet answered
    /// by a write (see [`Mrc`]). Every lookup of a batch is answered or
    /// settled before the next lookup batch begins.
    pending: Option<u8>,
    /// The table's answer to that lookup where its tag said it
    /// ([`kind::outcome`]): 0 not said, 1 a miss, 2 a hit.
    pending_real: u8,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 64);

/// One simulated cache of sampled keys: a recency list through
/// [`Entry::prev`] / [`Entry::next`].
#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
    cap: usize,
}

/// The SHARDS estimator of one table's miss-ratio curve. See the module docs.
#[derive(Debug, Clone)]
pub struct Mrc {
    cfg: MrcConfig,
    threshold: u64,
    capacity: u64,
    map: Slots,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Tracked keys by hash, the largest first (the next to leave).
    by_hash: BinaryHeap<(u64, u64)>,
    lists: [List; N],
    /// Sampled lookup weight that hit in each simulated cache.
    hits: [f64; N],
    /// Weight of sampled lookups.
    weight: f64,
    /// Entries of this lookup batch's lookups, in order, and how many of
    /// them have been answered or settled.
    pending: Vec<u32>,
    answered: usize,
    /// The tag of the last sample.
    last_tag: Option<u8>,
    /// Learnt: how often the client writes a key after a lookup that
    /// missed (fills) and after one that hit (refreshes).
    fill: f64,
    refresh: f64,
    accesses: u64,
    sampled_accesses: u64,
    dropped: u64,
    dropped_lookups: u64,
    /// Keys untracked so far (an entry index found before may be stale).
    untracked: u64,
    /// A drain's sampled keys, their entries found ahead.
    todo: Vec<Todo>,
}

/// A sampled key of a drain: its hash, tag and entry (`NIL`: not tracked
/// when the drain began).
#[derive(Debug, Clone, Copy)]
struct Todo {
    key: u64,
    h: u64,
    e: u32,
    t: u8,
}

/// How many sampled keys ahead a drain fetches neighbours.
const AHEAD: usize = 4;

impl Mrc {
    /// Bytes of memory per tracked key, about: the map's entry (12 bytes
    /// and a control byte, at a load of 1/2 to 7/8), the entry with its
    /// seven pairs of links (80) and the hash heap's entry (16).
    pub const BYTES_PER_KEY: usize = 120;

    /// An estimator for a table of `capacity` slots with nothing observed.
    pub fn new(cfg: MrcConfig, capacity: u64) -> Mrc {
        let cfg = MrcConfig { max_keys: cfg.max_keys.max(1), ..cfg };
        let mut m = Mrc {
            threshold: Self::initial_threshold(&cfg, capacity),
            capacity,
            map: Slots::new(cfg.max_keys + 1),
            entries: Vec::with_capacity(cfg.max_keys + 1),
            free: Vec::new(),
            by_hash: BinaryHeap::with_capacity(cfg.max_keys + 1),
            lists: [List { head: NIL, tail: NIL, len: 0, cap: 0 }; N],
            hits: [0.0; N],
            weight: 0.0,
            pending: Vec::new(),
            answered: 0,
            last_tag: None,
            fill: 1.0,
            refresh: 1.0,
            accesses: 0,
            sampled_accesses: 0,
            dropped: 0,
            dropped_lookups: 0,
            untracked: 0,
            todo: Vec::new(),
            cfg,
        };
        m.size_lists();
        m
    }

    /// The threshold a new estimator starts at: `cfg.initial_rate`, but no
    /// more than [`START_SPAN`] × `max_keys` / `capacity`. A table that
    /// sees at least `capacity / START_SPAN` distinct keys ends at a rate
    /// below that start anyway (`max_keys` / distinct keys), so its curve
    /// is the same; one that sees fewer tracks fewer keys (2 Ki at a
    /// sixteenth of its capacity). What the cap saves is the warm-up: from
    /// rate 1, every key of a new table's first requests was sampled,
    /// tracked and then untracked again as the rate fell.
    fn initial_threshold(cfg: &MrcConfig, capacity: u64) -> u64 {
        let span = START_SPAN * cfg.max_keys as f64 / capacity.max(1) as f64;
        let rate = if cfg.initial_rate.is_nan() { 1.0 } else { cfg.initial_rate }.min(span);
        if rate >= 1.0 {
            u64::MAX
        } else {
            (rate.max(0.0) * TWO_64) as u64
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

    /// The table's capacity the curve's factors apply to.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The table grew (or shrank): the simulated caches follow, keeping
    /// what they hold (shrinking drops their least recent keys).
    pub fn set_capacity(&mut self, capacity: u64) {
        if capacity != self.capacity {
            self.capacity = capacity;
            self.size_lists();
        }
    }

    /// Bytes held, about.
    pub fn memory_bytes(&self) -> usize {
        self.cfg.max_keys * Self::BYTES_PER_KEY
    }

    /// Observes plain references to `keys`, in order: each one a lookup
    /// that leaves the key most recent (find_or_insert; an LRU cache's
    /// accesses). Unsampled keys cost one hash and one comparison.
    #[inline]
    pub fn observe(&mut self, keys: &[u64]) {
        self.accesses += keys.len() as u64;
        let seed = self.cfg.seed;
        for &k in keys {
            let h = sample_hash(k, seed);
            if h < self.threshold {
                self.sample(k, h, Kind::FindOrInsert as u8, None);
            }
        }
    }

    /// Observes what a shard's sampler kept since the last drain: `samples`
    /// passed an earlier [`sampler`](Mrc::sampler) (a kernel's or the CPU
    /// buffer's) and are filtered again at the current threshold; `lookups`
    /// is the keys of lookups the shard served meanwhile, sampled or not;
    /// `threshold`, when the shard lowered its own filter to keep its
    /// buffer from overflowing, that filter (this one follows it down).
    pub fn observe_samples(&mut self, samples: &Samples, lookups: u64, threshold: Option<u64>) {
        if let Some(t) = threshold {
            self.lower_threshold(t);
        }
        self.accesses += lookups;
        // The estimator's memory is cold by the next drain (the table's
        // traffic came between), and a sampled key costs a map probe, its
        // entry and its neighbours in seven lists: misses, one after the
        // other. So the entries are found first, all probes in one loop
        // (independent, overlapping), each entry's line fetched as found;
        // then, while one key is applied, the neighbours of a key a few
        // places on are fetched.
        let mut todo = std::mem::take(&mut self.todo);
        todo.clear();
        for (&k, &t) in samples.keys.iter().zip(&samples.tags) {
            let h = sample_hash(k, self.cfg.seed);
            if h < self.threshold {
                self.map.prefetch(k);
                todo.push(Todo { key: k, h, e: NIL, t });
            }
        }
        for j in 0..todo.len() {
            if let Some(n) = todo.get(j + 8) {
                self.map.prefetch(n.key);
            }
            let e = self.map.get(todo[j].key).unwrap_or(NIL);
            if e != NIL {
                crate::cpu::prefetch::prefetch(&self.entries[e as usize]);
            }
            todo[j].e = e;
        }
        let untracked = self.untracked;
        for j in 0..todo.len() {
            if let Some(n) = todo.get(j + AHEAD) {
                self.prefetch_links(n.e);
            }
            let d = todo[j];
            if d.h >= self.threshold {
                // The threshold fell since the key was filtered.
                continue;
            }
            // A key tracked or dropped meanwhile is found again.
            let e = if d.e == NIL || self.untracked != untracked { None } else { Some(d.e) };
            self.sample(d.key, d.h, d.t, e);
        }
        self.todo = todo;
    }

    /// Starts fetching the lines of `e`'s neighbours in every list it is in.
    #[inline]
    fn prefetch_links(&self, e: u32) {
        let Some(ent) = self.entries.get(e as usize) else { return };
        let mut m = ent.member;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            for n in [ent.prev[i], ent.next[i]] {
                if let Some(x) = self.entries.get(n as usize) {
                    crate::cpu::prefetch::prefetch(x);
                }
            }
        }
    }

    /// Counts sampled keys a shard lost to a full buffer, and the lookups
    /// left out of the curve with them (both shown with the curve).
    pub fn add_dropped(&mut self, dropped: u64, lookups: u64) {
        self.dropped += dropped;
        self.dropped_lookups += lookups;
    }

    /// One sampled key with its tag; `e`, its entry if known.
    fn sample(&mut self, key: u64, h: u64, t: u8, e: Option<u32>) {
        let kind = Kind::of(t);
        if self.last_tag != Some(kind::batch_of(t)) {
            self.last_tag = Some(kind::batch_of(t));
            if kind.is_lookup() {
                // A new lookup batch: the last one's keys the client did
                // not write meanwhile were not written at all.
                self.settle();
            }
        }
        let e = match e.or_else(|| self.map.get(key)) {
            Some(e) => e,
            None => match self.track(key, h) {
                Some(e) => e,
                None => return,
            },
        };
        match kind {
            Kind::Lookup | Kind::FindOrInsert => {
                let w = 1.0 / self.rate();
                self.sampled_accesses += 1;
                self.weight += w;
                let ent = &mut self.entries[e as usize];
                let member = ent.member;
                for (i, h) in self.hits.iter_mut().enumerate() {
                    if member >> i & 1 == 1 {
                        *h += w;
                    }
                }
                if kind == Kind::FindOrInsert {
                    self.touch_all(e, true);
                    return;
                }
                if ent.pending.is_none() {
                    // A key repeated in one batch finds the table as the
                    // first lookup did: the answer to both is one write.
                    ent.pending = Some(member);
                    ent.pending_real = match kind::outcome(t) {
                        None => 0,
                        Some(hit) => 1 + hit as u8,
                    };
                    ent.pending_pos = self.pending.len() as u32;
                    self.pending.push(e);
                }
                if self.cfg.reads_refresh {
                    // The find itself refreshed the hit. Without this, a
                    // client that inserts only its misses left hot keys
                    // to age out of every simulated cache while the table
                    // kept them: its 1x outcome disagreed with the table's,
                    // the misses the client never wrote (table hits) taught
                    // the estimator that misses are not inserted, and the
                    // curve fell to a few percent beside a measured 50-80 %.
                    self.touch_all(e, false);
                }
            }
            Kind::Write | Kind::Update => {
                let insert = kind == Kind::Write;
                let ent = &self.entries[e as usize];
                let pos = ent.pending.is_some().then_some(ent.pending_pos);
                if let Some(pos) = pos {
                    // Clients write back in the order they looked up: the
                    // lookups before this one still unanswered get no write.
                    self.settle_until(pos as usize);
                    self.answered = self.answered.max(pos as usize + 1);
                }
                match self.entries[e as usize].pending.take() {
                    Some(was) => self.answer(e, was, true, insert),
                    // A write no lookup asked for: the key is placed (or
                    // refreshed) at every size.
                    None => self.touch_all(e, insert),
                }
            }
        }
    }

    /// A lookup of entry `e` (in the caches `was` then) answered by a
    /// write (`wrote`; `insert`: one that may place an absent key) or by
    /// none. What the client did at the table's own size is learnt; at
    /// another size, where the lookup's outcome may differ, the client is
    /// taken to do what it does for that outcome (a client that writes
    /// back every key, one that inserts its misses, one that only reads).
    /// The table's own outcome is the one its sampler tagged the lookup
    /// with, else the simulated cache of its size's: a table whose policy
    /// keeps other keys than LRU (lfu, adaptive, custom) hits keys that
    /// cache misses, and a client's silence after such a hit read as "it
    /// does not insert its misses" had the curve fall to 0.4 % beside a
    /// measured 77 % (an lfu table, find then insert of the misses).
    fn answer(&mut self, e: u32, was: u8, wrote: bool, insert: bool) {
        const ALL: u8 = (1 << N) - 1;
        let hit_one = match self.entries[e as usize].pending_real {
            0 => was >> ONE & 1 == 1,
            r => r == 2,
        };
        let learnt = if wrote { 1.0 } else { 0.0 };
        if hit_one {
            self.refresh += (learnt - self.refresh) * LEARN;
        } else {
            self.fill += (learnt - self.fill) * LEARN;
        }
        // The caches where the lookup's outcome was the table's: the client
        // did what it did; elsewhere what it does for that outcome.
        let same = if hit_one { was } else { !was & ALL };
        let mut touch = if wrote { same } else { 0 };
        if self.refresh > 0.5 {
            touch |= was & !same;
        }
        if self.fill > 0.5 {
            touch |= !was & ALL & !same;
        }
        if !insert {
            touch &= self.entries[e as usize].member;
        }
        while touch != 0 {
            let i = touch.trailing_zeros() as usize;
            touch &= touch - 1;
            self.touch(i, e);
        }
    }

    /// Answers every lookup of the last batch still waiting: with no write.
    fn settle(&mut self) {
        self.settle_until(self.pending.len());
        self.pending.clear();
        self.answered = 0;
    }

    /// Answers this batch's lookups from the first unanswered one to
    /// `end` (exclusive) that are still waiting: with no write.
    fn settle_until(&mut self, end: usize) {
        for j in self.answered..end {
            // An entry freed and reused meanwhile has another place, or none.
            let e = self.pending[j];
            let ent = &mut self.entries[e as usize];
            if ent.pending_pos as usize != j {
                continue;
            }
            if let Some(was) = ent.pending.take() {
                self.answer(e, was, false, true);
            }
        }
        self.answered = self.answered.max(end);
    }

    /// Starts tracking `key` (hash `h`): None when it left at once (its
    /// hash was the largest and the budget was full).
    fn track(&mut self, key: u64, h: u64) -> Option<u32> {
        let ent = Entry { prev: [NIL; N], next: [NIL; N], pending_pos: 0, member: 0, pending: None, pending_real: 0 };
        let e = match self.free.pop() {
            Some(e) => {
                self.entries[e as usize] = ent;
                e
            }
            None => {
                self.entries.push(ent);
                (self.entries.len() - 1) as u32
            }
        };
        self.map.insert(key, e);
        self.by_hash.push((h, key));
        if self.map.len() > self.cfg.max_keys {
            // The largest hash leaves; the threshold drops to it so that key
            // (and every larger one) is no longer sampled.
            let (top, _) = *self.by_hash.peek().expect("a tracked key");
            self.lower_threshold(top);
        }
        self.map.get(key)
    }

    /// Lowers the threshold to `t` (if below the current one): tracked
    /// keys whose hash is at or above it leave, and the caches shrink.
    fn lower_threshold(&mut self, t: u64) {
        if t >= self.threshold {
            return;
        }
        self.threshold = t;
        while let Some(&(h, k)) = self.by_hash.peek() {
            if h < t {
                break;
            }
            self.by_hash.pop();
            self.untrack(k);
        }
        self.size_lists();
    }

    fn untrack(&mut self, key: u64) {
        let Some(e) = self.map.remove(key) else { return };
        self.untracked += 1;
        for i in 0..N {
            if self.entries[e as usize].member >> i & 1 == 1 {
                self.unlink(i, e);
            }
        }
        self.entries[e as usize].pending = None;
        self.free.push(e);
    }

    /// Each cache holds its factor of the capacity, scaled by the rate.
    fn size_lists(&mut self) {
        let scaled = self.capacity as f64 * self.rate();
        for (i, f) in FACTORS.iter().enumerate() {
            self.lists[i].cap = (scaled * f).round() as usize;
            self.shrink(i);
        }
    }

    fn shrink(&mut self, i: usize) {
        while self.lists[i].len > self.lists[i].cap {
            let t = self.lists[i].tail;
            self.unlink(i, t);
        }
    }

    fn unlink(&mut self, i: usize, e: u32) {
        let (p, n) = {
            let ent = &mut self.entries[e as usize];
            ent.member &= !(1 << i);
            (std::mem::replace(&mut ent.prev[i], NIL), std::mem::replace(&mut ent.next[i], NIL))
        };
        match p {
            NIL => self.lists[i].head = n,
            p => self.entries[p as usize].next[i] = n,
        }
        match n {
            NIL => self.lists[i].tail = p,
            n => self.entries[n as usize].prev[i] = p,
        }
        self.lists[i].len -= 1;
    }

    /// Makes `e` the most recent of cache `i` (inserting it, evicting the
    /// least recent past the cache's size).
    fn touch(&mut self, i: usize, e: u32) {
        if self.entries[e as usize].member >> i & 1 == 1 {
            if self.lists[i].head == e {
                return;
            }
            self.unlink(i, e);
        }
        if self.lists[i].cap == 0 {
            return;
        }
        let head = self.lists[i].head;
        {
            let ent = &mut self.entries[e as usize];
            ent.member |= 1 << i;
            ent.prev[i] = NIL;
            ent.next[i] = head;
        }
        match head {
            NIL => self.lists[i].tail = e,
            h => self.entries[h as usize].prev[i] = e,
        }
        self.lists[i].head = e;
        self.lists[i].len += 1;
        self.shrink(i);
    }

    /// [`touch`](Mrc::touch) in every cache (`insert`), or in those that hold the key.
    fn touch_all(&mut self, e: u32, insert: bool) {
        for i in 0..N {
            if insert || self.entries[e as usize].member >> i & 1 == 1 {
                self.touch(i, e);
            }
        }
    }

    /// The estimated hit rate at factor `FACTORS[i]` (0 before any lookup).
    fn point(&self, i: usize) -> f64 {
        if self.accesses == 0 {
            return 0.0;
        }
        // SHARDS_adj: the weight the sample is missing (or has too much of)
        // belongs to hot keys, which hit at every size.
        let hits = self.hits[i] + self.accesses as f64 - self.weight;
        (hits / self.accesses as f64).clamp(0.0, 1.0)
    }

    /// The curve at [`FACTORS`] of the capacity.
    pub fn curve(&self) -> Curve {
        let points = FACTORS
            .iter()
            .enumerate()
            .map(|(i, &factor)| MrcPoint {
                factor,
                capacity: (self.capacity as f64 * factor).round() as u64,
                hit_rate: self.point(i),
            })
            .collect();
        Curve {
            points,
            accesses: self.accesses,
            sampled_accesses: self.sampled_accesses,
            tracked_keys: self.map.len() as u64,
            rate: self.rate(),
            dropped: self.dropped,
            dropped_lookups: self.dropped_lookups,
        }
    }

    /// Forgets everything observed; the rate starts again at the initial one.
    pub fn reset(&mut self) {
        *self = Mrc::new(self.cfg, self.capacity);
    }
}
