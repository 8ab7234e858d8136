//! The Adaptive policy's window chooser (issue 36): six miniature,
//! fully associative W-TinyLFU caches fed a hash-sampled part of the
//! table's accesses, with windows of 1, 5, 20, 50, 85 and 100 % of their
//! capacity; the table's window share is the window of the one with the
//! most (decayed) hits. It runs on the host, between batches, for both
//! backends, so both get the same share for every batch.
//!
//! Sampling (SHARDS-style, so that a miniature of `slots / R` entries
//! fed one key in R behaves as the full-size cache): `R = max(1,
//! floor(slots / 2048))`; a key is sampled when `(fmix64(k ^ 0x5bd1e995) >>
//! 20) % R == 0`. Each miniature is a window LRU plus a segmented LRU main
//! (probation, protected ≤ 80 % of the main), TinyLFU admission from the
//! window's oldest into a full main against the main's oldest (probation
//! first): admitted only if more frequent by more than [`ADMIT_MARGIN`],
//! as in the table's buckets. Frequencies are exact
//! (a map, capped at 15), halved every 2 × capacity sampled accesses;
//! hits halved every 0.9 capacity, so the choice follows the recent past.
//! The share moves to another miniature's window only when that one is
//! strictly ahead (ties: the smaller window); it starts at 85 % (the
//! largest window below 100 %).
//!
//! This file has no dependencies beyond `std`: `shard/bench/adapt_model.rs`
//! includes it (`#[path]`), so the model and the policy run the same code.

use std::collections::HashMap;

use crate::hash::fmix64;

/// The miniatures' windows, in percent of their capacity. The 85 % one:
/// a scan or a recency phase that the table serves with a window this
/// large keeps a main tier of 15 % (its most frequent keys) where the
/// 100 % window (LRU) would flush it; `mixture` at 50 % (whose last phase
/// returns to the first phase's keys) went from 0.13 / 0.25 pp below the
/// bar to 1.02 / 1.05 above on trace seeds 36 / 37 (the model, with the
/// start below; hkv-sim: from 1.13 / 1.25 pp below the best reference to
/// 0.02 / 0.05 above it); the largest cost elsewhere in the model:
/// loop-mix at 50 %, 0.52 / 0.29 pp of margin (still 0.13 / 0.34 above).
pub const WINDOWS_PERCENT: [u64; 6] = [1, 5, 20, 50, 85, 100];
/// Before any miniature is ahead of another (the cache holds the whole
/// working set, all miniatures hit alike), the share stays where it
/// starts: the largest window below 100 %, so that a table that later
/// needs a large window has kept a main tier of its frequent keys (from
/// 1 %, the main tier filled with each phase's keys and a later growth of
/// the window flushed the older ones).
fn start(windows: &[u64]) -> usize {
    windows.iter().rposition(|&w| w < 100).unwrap_or(0)
}
/// Slots of the table per tracked slot of a miniature, at least.
pub const SAMPLED_SLOTS: u64 = 2048;
/// Frequency cap (as the sketch's counters).
const FREQ_MAX: u8 = 15;
/// Sampled accesses between frequency halvings, per miniature slot: the
/// miniatures' sketches forget fast, so that their admission follows a
/// drift as soon as the table's own does. Measured with hkv-sim over the
/// 36 non-IID points of two trace seeds (points within 1 pp of the best
/// reference, with the hit period below): every 10 slots 30 / 30, every 2
/// slots (the model's sweep: 1 to 20) 35 / 34 (`shard/BENCHMARKS.md`,
/// "The miniatures' periods").
const FREQ_PERIOD: u64 = 2;
/// Sampled accesses between hit-count halvings, in percent of a
/// miniature's capacity: a choice follows about the last cache's worth of
/// accesses. Measured with hkv-sim over the 36 non-IID points of two trace
/// seeds (36 / 37; points within 1 pp of the best reference, sum of the
/// shortfalls): every 4 capacities 30 / 30, −3.91 / −4.66; every capacity
/// 31 / 30, −1.69 / −2.11; every ½ capacity 28 / 30, −1.27 / −1.51 (the
/// model: ¼ capacity worse again, scan and loop traces flip windows).
/// With the frequency period of 2, every 0.9 capacity (the model: 0.5 to
/// 1.25 tried; 0.75 to 1 alike).
const HIT_PERIOD_PERCENT: u64 = 90;
/// Admission margin, the buckets' too (`adapt::ADMIT_MARGIN`): a window's
/// oldest joins a full main tier only if counted at least 2 more times
/// than the main tier's oldest. With TinyLFU's margin 0, a scan key
/// (counted just now) beat the retained scan key about to be read again
/// (counted a cycle ago) and the retained part of a scan churned:
/// `scan-hot` at 25 / 50 % lost 1.1 / 3.1 pp to the bar, loop-mix at 10 %
/// 0.9 (`shard/BENCHMARKS.md`, "Adaptive policy", second design).
pub const ADMIT_MARGIN: u8 = 1;

/// The chooser's constants, as a value so that the model
/// (`shard/bench/adapt_model.rs`) can try others; the policy uses
/// [`Params::default`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// The miniatures' windows, percent of their capacity, ascending.
    pub windows: Vec<u64>,
    /// Table slots per miniature slot (the sampling divisor's unit).
    pub sampled_slots: u64,
    /// Sampled accesses between frequency halvings, per miniature slot.
    pub freq_period: u64,
    /// Sampled accesses between hit-count halvings, percent of a
    /// miniature's capacity.
    pub hit_period_percent: u64,
    /// How far (in 1/1000 of the current one's hits) another miniature
    /// must be ahead to take over; 0: strictly ahead.
    pub margin: u64,
    /// A window's oldest joins a full main tier only if its frequency is
    /// more than this much above the main tier's oldest's (0: TinyLFU).
    pub admit_margin: u8,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            windows: WINDOWS_PERCENT.to_vec(),
            sampled_slots: SAMPLED_SLOTS,
            freq_period: FREQ_PERIOD,
            hit_period_percent: HIT_PERIOD_PERCENT,
            margin: 0,
            admit_margin: ADMIT_MARGIN,
        }
    }
}
/// Slots of a bucket.
const BUCKET: u64 = 128;

const NIL: u32 = u32::MAX;

/// The sampling divisor of a table of `slots` slots.
pub fn sample_rate(slots: u64) -> u64 {
    (slots / SAMPLED_SLOTS).max(1)
}

/// Whether `key` is sampled at divisor `rate`.
#[inline]
pub fn sampled(key: u64, rate: u64) -> bool {
    rate <= 1 || (fmix64(key ^ 0x5bd1_e995) >> 20).is_multiple_of(rate)
}

/// A bucket's window share (slots, 1 ..= 127) for a share in percent.
pub fn bucket_window(percent: u64) -> u32 {
    (percent * BUCKET / 100).clamp(1, BUCKET - 1) as u32
}

#[derive(Clone, Copy, Debug)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
    list: u8,
}

const WINDOW: u8 = 0;
const PROBATION: u8 = 1;
const PROTECTED: u8 = 2;

/// One miniature W-TinyLFU cache (intrusive LRU lists in a slab; head =
/// most recent).
#[derive(Debug, Clone)]
struct Mini {
    window_cap: u64,
    main_cap: u64,
    protected_cap: u64,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: [u32; 3],
    tail: [u32; 3],
    len: [u64; 3],
    at: HashMap<u64, u32>,
    hits: u64,
}

impl Mini {
    fn new(cap: u64, percent: u64) -> Mini {
        let window_cap = (cap * percent / 100).clamp(1, cap);
        let main_cap = cap - window_cap;
        Mini {
            window_cap,
            main_cap,
            protected_cap: main_cap * 8 / 10,
            nodes: Vec::with_capacity(cap as usize + 1),
            free: Vec::new(),
            head: [NIL; 3],
            tail: [NIL; 3],
            len: [0; 3],
            at: HashMap::new(),
            hits: 0,
        }
    }

    fn unlink(&mut self, i: u32) {
        let n = self.nodes[i as usize];
        let l = n.list as usize;
        if n.prev == NIL {
            self.head[l] = n.next
        } else {
            self.nodes[n.prev as usize].next = n.next
        }
        if n.next == NIL {
            self.tail[l] = n.prev
        } else {
            self.nodes[n.next as usize].prev = n.prev
        }
        self.len[l] -= 1;
    }

    fn push_front(&mut self, i: u32, list: u8) {
        let l = list as usize;
        let h = self.head[l];
        self.nodes[i as usize] = Node { key: self.nodes[i as usize].key, prev: NIL, next: h, list };
        if h == NIL {
            self.tail[l] = i
        } else {
            self.nodes[h as usize].prev = i
        }
        self.head[l] = i;
        self.len[l] += 1;
    }

    fn alloc(&mut self, key: u64) -> u32 {
        let n = Node { key, prev: NIL, next: NIL, list: WINDOW };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = n;
                i
            }
            None => {
                self.nodes.push(n);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn drop_node(&mut self, i: u32) {
        self.unlink(i);
        self.at.remove(&self.nodes[i as usize].key);
        self.free.push(i);
    }

    /// One access of `key` (its frequency already counted in `freq`).
    fn access(&mut self, key: u64, freq: &HashMap<u64, u8>, admit_margin: u8) {
        if let Some(&i) = self.at.get(&key) {
            self.hits += 1;
            let list = self.nodes[i as usize].list;
            self.unlink(i);
            if list == WINDOW {
                self.push_front(i, WINDOW);
            } else {
                self.push_front(i, PROTECTED);
                while self.len[PROTECTED as usize] > self.protected_cap {
                    let t = self.tail[PROTECTED as usize];
                    self.unlink(t);
                    self.push_front(t, PROBATION);
                }
            }
            return;
        }
        let i = self.alloc(key);
        self.at.insert(key, i);
        self.push_front(i, WINDOW);
        if self.len[WINDOW as usize] <= self.window_cap {
            return;
        }
        // The window's oldest leaves it: into the main tier if it has room
        // or beats the main tier's oldest, else out.
        let c = self.tail[WINDOW as usize];
        if self.len[PROBATION as usize] + self.len[PROTECTED as usize] < self.main_cap {
            self.unlink(c);
            self.push_front(c, PROBATION);
            return;
        }
        let v = if self.tail[PROBATION as usize] != NIL {
            self.tail[PROBATION as usize]
        } else {
            self.tail[PROTECTED as usize]
        };
        let f = |i: u32| freq.get(&self.nodes[i as usize].key).copied().unwrap_or(0);
        if v != NIL && f(c) > f(v).saturating_add(admit_margin) {
            self.drop_node(v);
            self.unlink(c);
            self.push_front(c, PROBATION);
        } else {
            self.drop_node(c);
        }
    }
}

/// The miniatures of one table, their shared frequency counts, and
/// the chosen window.
#[derive(Debug, Clone)]
pub struct Chooser {
    params: Params,
    slots: u64,
    rate: u64,
    cap: u64,
    minis: Vec<Mini>,
    freq: HashMap<u64, u8>,
    accesses: u64,
    since_freq: u64,
    since_hits: u64,
    chosen: usize,
}

impl Chooser {
    /// The chooser of a table of `slots` slots.
    pub fn new(slots: u64) -> Chooser {
        Chooser::with(slots, Params::default())
    }

    /// The chooser of a table of `slots` slots with constants `params`.
    pub fn with(slots: u64, params: Params) -> Chooser {
        let rate = (slots / params.sampled_slots).max(1);
        let cap = (slots / rate).max(1);
        let chosen = start(&params.windows);
        Chooser {
            slots,
            rate,
            cap,
            minis: params.windows.iter().map(|&p| Mini::new(cap, p)).collect(),
            params,
            freq: HashMap::new(),
            accesses: 0,
            since_freq: 0,
            since_hits: 0,
            chosen,
        }
    }

    /// The table size this chooser was made for.
    pub fn slots(&self) -> u64 {
        self.slots
    }

    /// A fresh chooser for a table of `slots` slots that starts at this
    /// one's choice (after the table grew: the sampling divisor and the
    /// miniatures' capacity follow the size).
    pub fn resized(&self, slots: u64) -> Chooser {
        Chooser { chosen: self.chosen, ..Chooser::with(slots, self.params.clone()) }
    }

    /// The index of the chosen window among the windows.
    pub fn chosen(&self) -> usize {
        self.chosen
    }

    /// The sampling divisor.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The chosen window, in percent of the capacity.
    pub fn window_percent(&self) -> u64 {
        self.params.windows[self.chosen]
    }

    /// The chosen window share of a bucket (slots, 1 ..= 127).
    pub fn bucket_window(&self) -> u32 {
        bucket_window(self.window_percent())
    }

    /// Sampled accesses fed so far.
    pub fn accesses(&self) -> u64 {
        self.accesses
    }

    /// One access of a sampled key.
    fn access(&mut self, key: u64) {
        let f = self.freq.entry(key).or_insert(0);
        *f = (*f + 1).min(FREQ_MAX);
        for m in &mut self.minis {
            m.access(key, &self.freq, self.params.admit_margin);
        }
        self.accesses += 1;
        self.since_freq += 1;
        self.since_hits += 1;
        if self.since_freq >= self.params.freq_period * self.cap {
            self.since_freq = 0;
            self.freq.retain(|_, f| {
                *f >>= 1;
                *f > 0
            });
        }
        if self.since_hits >= (self.params.hit_period_percent * self.cap / 100).max(1) {
            self.since_hits = 0;
            for m in &mut self.minis {
                m.hits /= 2;
            }
        }
    }

    /// Feeds a batch's accesses in order (only the sampled keys count),
    /// then moves the choice to the miniature with the most hits if it
    /// is strictly ahead of the current one (ties: the smaller window).
    pub fn batch(&mut self, keys: impl IntoIterator<Item = u64>) {
        for k in keys {
            if sampled(k, self.rate) {
                self.access(k);
            }
        }
        self.choose();
    }

    /// Feeds already sampled keys (the caller filtered them with
    /// [`sampled`] at [`Chooser::rate`]), then chooses as [`Chooser::batch`].
    pub fn batch_sampled(&mut self, keys: impl IntoIterator<Item = u64>) {
        for k in keys {
            self.access(k);
        }
        self.choose();
    }

    fn choose(&mut self) {
        let mut best = 0;
        for (i, m) in self.minis.iter().enumerate() {
            if m.hits > self.minis[best].hits {
                best = i;
            }
        }
        let now = self.minis[self.chosen].hits;
        if self.minis[best].hits > now + now * self.params.margin / 1000 {
            self.chosen = best;
        }
    }
}
