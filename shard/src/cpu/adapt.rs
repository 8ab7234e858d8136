//! The Adaptive policy's side state (issue 36): a count-min frequency
//! sketch, a ghost array of recently evicted keys and the window's share.
//!
//! Each bucket is a small window-TinyLFU cache. An entry's score is the
//! clock (ns) with bit 63 set for the main tier ([`ADAPTIVE_MAIN`]);
//! newcomers enter the window (bit clear). A full bucket makes room for a
//! newcomer this way, `win` being the window's share of its 128 slots:
//! - window at or over its share: its oldest entry (the candidate) is
//!   compared with the oldest main entry (the victim) in the sketch; the
//!   more frequent one stays (the candidate moving to the main tier), the
//!   other is evicted; ties evict the candidate (TinyLFU's rule, which
//!   keeps a scan from flushing the main tier);
//! - window under its share: the oldest main entry is evicted.
//!
//! While a bucket fills, each newcomer that finds the window at its share
//! moves the window's oldest entry to the main tier, so that a bucket
//! reaches its first eviction already split.
//!
//! The share adapts as ARC's target does: every eviction leaves a ghost
//! (a 32-bit fingerprint tagged window/main) in a direct-mapped array of
//! one ghost per slot; a newcomer that finds its ghost was evicted too
//! early: from the window, the window grows; from the main tier, it
//! shrinks, each step weighted by how much rarer that tier's evictions are
//! (ARC's |B2|/|B1|). Measured with the prototype behind shard/bench
//! (shard/BENCHMARKS.md, "Adaptive policy"): a fixed 1 % window loses
//! 15 pp to LRU on bursty traffic, a fixed large one 20 pp to TinyLFU on
//! scans; hill climbing on the hit rate and set dueling between leader
//! buckets were both noisier than the ghosts.
//!
//! The sketch: 4 rows of 8-bit counters saturating at 15, each row 8 × the
//! table's largest slot count rounded to a power of two (a narrower sketch
//! counted noise as frequency on the scan trace: 5 pp lost at 10 %); every
//! 10 × slots counted accesses all counters halve (TinyLFU's reset), at
//! the end of the batch that crossed the mark, so that a frequency is an
//! estimate of the recent past only. Counted: every key an insert-like
//! operation writes, and each key a `find` hits when reads refresh.
//!
//! Concurrency: all fields are relaxed atomics. Inserts run in the
//! inserter group with the key's buckets locked; parallel tasks of one
//! batch race on the sketch, ghosts and share only as approximate
//! counters do (a lost increment, a ghost overwritten), never on a
//! bucket's entries.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};

use crate::score::ADAPTIVE_MAIN;
use crate::BUCKET_SLOTS;

const ROWS: usize = 4;
const COUNTER_MAX: u8 = 15;
/// Sketch counters per row, per slot of the table's largest size.
const WIDTH_PER_SLOT: u64 = 8;
/// Counted accesses between halvings, per slot.
const PERIOD_PER_SLOT: u64 = 10;

/// A 64-bit mix (murmur3's finaliser) of `x`.
#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Row `i`'s counter index of `key`.
#[inline]
pub(crate) fn sketch_index(key: u64, row: usize, mask: u64) -> usize {
    let h = mix(key ^ 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(row as u64 + 1));
    row * (mask as usize + 1) + (h & mask) as usize
}

/// The ghost hash of a key: slot = `h % ghosts`, fingerprint = the high
/// 32 bits with bit 0 replaced by the tier tag and bit 1 set (so that a
/// ghost is never 0, the empty value).
#[inline]
pub(crate) fn ghost_hash(key: u64) -> u64 {
    mix(key ^ 0x0123_4567)
}

/// The tag of a ghost: evicted from the window.
const GHOST_WINDOW: u32 = 1;

/// The Adaptive policy's state of one table.
#[derive(Debug)]
pub(crate) struct Adapt {
    sketch: Vec<AtomicU8>,
    mask: u64,
    counted: AtomicU64,
    period: AtomicU64,
    ghosts: Vec<AtomicU32>,
    /// The window's share of the table, in slots (0 ..= slots).
    target: AtomicI64,
    /// Evictions from the window and from the main tier, halved together
    /// when their sum passes the slot count (ARC's ghost list sizes).
    from_window: AtomicU64,
    from_main: AtomicU64,
    slots: AtomicU64,
}

/// One full bucket's tiers: count of window entries and the oldest entry
/// of each tier (slot, score), `None` when the tier is empty.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tiers {
    pub window: u32,
    pub oldest_window: Option<(usize, u64)>,
    pub oldest_main: Option<(usize, u64)>,
}

impl Tiers {
    /// The tiers of a bucket's scores (`score(s)` for every occupied `s`).
    #[inline]
    pub(crate) fn of(slots: impl Iterator<Item = (usize, u64)>) -> Tiers {
        let mut t = Tiers::default();
        for (s, sc) in slots {
            let oldest = if sc & ADAPTIVE_MAIN == 0 {
                t.window += 1;
                &mut t.oldest_window
            } else {
                &mut t.oldest_main
            };
            if oldest.is_none_or(|(_, o)| sc < o) {
                *oldest = Some((s, sc));
            }
        }
        t
    }
}

/// What a full bucket does for a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// Evict the entry of this slot (its tier: `true` = window).
    Evict { slot: usize, window: bool },
    /// Move the window entry of `promote` to the main tier and evict the
    /// main entry of `slot`.
    Promote { promote: usize, slot: usize },
}

impl Adapt {
    /// State for a table of at most `max_slots` slots, starting at `slots`.
    pub(crate) fn new(slots: u64, max_slots: u64) -> Adapt {
        let width = (max_slots.max(1) * WIDTH_PER_SLOT).next_power_of_two();
        Adapt {
            sketch: (0..width as usize * ROWS).map(|_| AtomicU8::new(0)).collect(),
            mask: width - 1,
            counted: AtomicU64::new(0),
            period: AtomicU64::new(slots.max(1) * PERIOD_PER_SLOT),
            ghosts: (0..max_slots.max(1)).map(|_| AtomicU32::new(0)).collect(),
            target: AtomicI64::new(slots as i64 / 2),
            from_window: AtomicU64::new(1),
            from_main: AtomicU64::new(1),
            slots: AtomicU64::new(slots.max(1)),
        }
    }

    /// The sketch's estimate of `key`'s recent accesses (0 ..= 15).
    #[inline]
    pub(crate) fn frequency(&self, key: u64) -> u8 {
        (0..ROWS).map(|r| self.sketch[sketch_index(key, r, self.mask)].load(Relaxed)).min().unwrap_or(0)
    }

    /// Counts one access of `key` (conservative update: only the rows at
    /// the minimum grow).
    #[inline]
    pub(crate) fn count(&self, key: u64) {
        let f = self.frequency(key);
        if f < COUNTER_MAX {
            for r in 0..ROWS {
                let c = &self.sketch[sketch_index(key, r, self.mask)];
                let _ = c.compare_exchange(f, f + 1, Relaxed, Relaxed);
            }
        }
        self.counted.fetch_add(1, Relaxed);
    }

    /// At a batch's end (its group still held): halves every counter once
    /// the accesses counted since the last halving reach the period.
    pub(crate) fn age(&self) {
        if self.counted.load(Relaxed) < self.period.load(Relaxed) {
            return;
        }
        self.counted.store(0, Relaxed);
        for c in &self.sketch {
            c.store(c.load(Relaxed) >> 1, Relaxed);
        }
    }

    /// After growth to `slots`: the period and the share scale with it.
    pub(crate) fn resize(&self, slots: u64) {
        let old = self.slots.swap(slots.max(1), Relaxed) as i64;
        let t = self.target.load(Relaxed);
        self.target.store(t * slots as i64 / old.max(1), Relaxed);
        self.period.store(slots.max(1) * PERIOD_PER_SLOT, Relaxed);
    }

    /// The window's share of one bucket's slots (1 ..= 127).
    #[inline]
    pub(crate) fn window_slots(&self) -> u32 {
        let slots = self.slots.load(Relaxed) as i64;
        let t = self.target.load(Relaxed).clamp(0, slots);
        ((t * BUCKET_SLOTS as i64 / slots) as u32).clamp(1, BUCKET_SLOTS as u32 - 1)
    }

    /// A newcomer: if its ghost is there, moves the window's share (ARC's
    /// adaptation) and forgets the ghost.
    #[inline]
    pub(crate) fn on_miss(&self, key: u64) {
        let h = ghost_hash(key);
        let g = &self.ghosts[(h % self.ghosts.len() as u64) as usize];
        let v = g.load(Relaxed);
        if v == 0 || v >> 2 != (h >> 34) as u32 {
            return;
        }
        g.store(0, Relaxed);
        let (w, m) = (self.from_window.load(Relaxed).max(1), self.from_main.load(Relaxed).max(1));
        let slots = self.slots.load(Relaxed) as i64;
        if v & GHOST_WINDOW != 0 {
            let step = (m / w).max(1) as i64;
            let _ = self.target.fetch_update(Relaxed, Relaxed, |t| Some((t + step).min(slots)));
        } else {
            let step = (w / m).max(1) as i64;
            let _ = self.target.fetch_update(Relaxed, Relaxed, |t| Some((t - step).max(0)));
        }
    }

    /// Records the eviction of `key` from the window or the main tier.
    #[inline]
    pub(crate) fn on_evict(&self, key: u64, window: bool) {
        let h = ghost_hash(key);
        let tag = if window { GHOST_WINDOW } else { 0 };
        self.ghosts[(h % self.ghosts.len() as u64) as usize].store(((h >> 34) as u32) << 2 | 2 | tag, Relaxed);
        let (mine, other) =
            if window { (&self.from_window, &self.from_main) } else { (&self.from_main, &self.from_window) };
        let n = mine.fetch_add(1, Relaxed) + 1;
        if n + other.load(Relaxed) > self.slots.load(Relaxed) {
            mine.store(n / 2, Relaxed);
            other.store(other.load(Relaxed) / 2, Relaxed);
        }
    }

    /// How a full bucket with tiers `t` makes room for a newcomer; `key_of`
    /// reads a slot's key.
    #[inline]
    pub(crate) fn room(&self, t: &Tiers, key_of: impl Fn(usize) -> u64) -> Room {
        let win = self.window_slots();
        match (t.oldest_window, t.oldest_main) {
            (Some((c, _)), Some((v, _))) if t.window >= win => {
                if self.frequency(key_of(c)) > self.frequency(key_of(v)) {
                    Room::Promote { promote: c, slot: v }
                } else {
                    Room::Evict { slot: c, window: true }
                }
            }
            (_, Some((v, _))) => Room::Evict { slot: v, window: false },
            (Some((c, _)), None) => Room::Evict { slot: c, window: true },
            (None, None) => unreachable!("a full bucket has entries"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sketch counts, saturates at 15 and halves at the period's end.
    #[test]
    fn sketch_counts_saturates_and_ages() {
        let a = Adapt::new(128, 128);
        for _ in 0..20 {
            a.count(7);
        }
        assert_eq!(a.frequency(7), COUNTER_MAX);
        assert_eq!(a.frequency(8), 0);
        for k in 0..(10 * 128) {
            a.count(1_000_000 + k);
        }
        a.age();
        assert_eq!(a.frequency(7), COUNTER_MAX / 2);
    }

    /// Ghost hits move the window's share: a window ghost grows it, a main
    /// ghost shrinks it; a key without a ghost moves nothing.
    #[test]
    fn ghosts_move_the_window_share() {
        let a = Adapt::new(128 * 64, 128 * 64);
        let w0 = a.target.load(Relaxed);
        a.on_miss(5);
        assert_eq!(a.target.load(Relaxed), w0);
        a.on_evict(5, true);
        a.on_miss(5);
        assert!(a.target.load(Relaxed) > w0);
        let w1 = a.target.load(Relaxed);
        a.on_miss(5);
        assert_eq!(a.target.load(Relaxed), w1, "a ghost counts once");
        a.on_evict(6, false);
        a.on_miss(6);
        assert!(a.target.load(Relaxed) < w1);
        assert_eq!(a.window_slots(), 64);
    }

    /// A full bucket's choice: the window candidate must beat the oldest
    /// main entry; under its share the window grows at main's cost.
    #[test]
    fn room_follows_the_window_rule() {
        let a = Adapt::new(128, 128);
        let scores: Vec<(usize, u64)> =
            (0..128).map(|s| (s, if s < 64 { 100 + s as u64 } else { ADAPTIVE_MAIN | s as u64 })).collect();
        let t = Tiers::of(scores.iter().copied());
        assert_eq!((t.window, t.oldest_window, t.oldest_main), (64, Some((0, 100)), Some((64, ADAPTIVE_MAIN | 64))));
        let key = |s: usize| s as u64 + 1;
        assert_eq!(a.room(&t, key), Room::Evict { slot: 0, window: true }, "ties keep the main entry");
        a.count(1);
        assert_eq!(a.room(&t, key), Room::Promote { promote: 0, slot: 64 });
        let small = Tiers { window: 3, ..t };
        assert_eq!(a.room(&small, key), Room::Evict { slot: 64, window: false });
    }
}
