//! The Adaptive policy's side state (issue 36): a count-min frequency
//! sketch of the table, and per bucket a ghost array of recently evicted
//! keys and the window's share.
//!
//! Each bucket is a small window-TinyLFU cache. An entry's score is the
//! clock (ns) with bit 63 set for the main tier ([`ADAPTIVE_MAIN`]);
//! newcomers enter the window (bit clear). A full bucket makes room for a
//! newcomer this way, `win` being the bucket's window share of its 128
//! slots:
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
//! The share adapts per bucket as ARC's target does, from ghosts: every
//! eviction leaves one (a 16-bit fingerprint, the tier, and the tier's
//! eviction count then) in one of the bucket's 128 ghost slots; a newcomer
//! that finds its ghost in a candidate bucket was evicted too early: from
//! the window, that bucket's window grows; from the main tier, it shrinks,
//! each step weighted by how much rarer that tier's evictions are (ARC's
//! |B2|/|B1|). A ghost counts only if a share the bucket can reach would
//! have kept the key: evicted from the window fewer window evictions ago
//! than the main tier's slots (from the main tier: than the window's), so
//! that a loop or scan longer than the bucket, which no share serves,
//! moves nothing (shard/BENCHMARKS.md, "Adaptive policy").
//!
//! The sketch: 64-byte lines of 8-bit counters saturating at 15, a line
//! per key, one counter of each row in its own 16-byte quarter of it (one
//! cache line per key touched, as Caffeine's blocked sketch), 32 counters
//! per slot of the table's largest size. Once the accesses counted reach
//! 10 × the table's slots all counters halve (TinyLFU's reset), at the end
//! of the batch that crossed the mark, so that a frequency is an estimate
//! of the recent past only. Counted, as plain increments (their order does
//! not change the result): every key an insert-like batch writes, before
//! the batch places any, and each key a `find` hits when reads refresh.
//!
//! Ghosts and shares are kept for the table's largest bucket count and stay
//! where they are when the table grows: a bucket keeps its number's share,
//! and a ghost whose key moved to another bucket is not found again.
//!
//! Determinism: within a batch the sketch only grows by order-free
//! increments and is read only while no increments run (inserts after
//! their batch's counts; finds do not read it); a bucket's ghosts and
//! share are read and written only with the bucket locked, by keys that
//! reach it in index order (small batches on either backend). So the CUDA
//! backend (`kernels/table.cuh`, "adaptive policy") makes the same choices
//! as this one, key for key.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};

use crate::score::ADAPTIVE_MAIN;
use crate::BUCKET_SLOTS;

/// Sketch rows (counters per key).
pub(crate) const ROWS: usize = 4;
const COUNTER_MAX: u8 = 15;
/// Sketch bytes (counters) per slot of the table's largest size.
pub(crate) const SKETCH_BYTES_PER_SLOT: u64 = 32;
/// Counted accesses between halvings, per slot.
pub(crate) const PERIOD_PER_SLOT: u64 = 10;
/// A bucket's window share before its first ghost hit (slots).
pub(crate) const INITIAL_WINDOW: u64 = 1;
/// Slots a ghost hit moves the share (times ARC's ratio).
pub(crate) const STEP: u64 = 1;

const S: u64 = BUCKET_SLOTS as u64;

/// A 64-bit mix (murmur3's finaliser) of `x`.
#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The sketch counters of `key` (one per row) in a sketch of `lines`
/// 64-byte lines (a power of two).
#[inline]
pub(crate) fn sketch_indices(key: u64, lines: u64) -> [usize; ROWS] {
    let h = mix(key ^ 0x9e37_79b9_7f4a_7c15);
    let line = ((h >> 16) & (lines - 1)) as usize * 64;
    std::array::from_fn(|r| line + r * 16 + ((h >> (4 * r)) & 15) as usize)
}

/// A key's ghost: its slot among a bucket's 128, and its fingerprint (16
/// bits, never 0).
#[inline]
pub(crate) fn ghost_of(key: u64) -> (usize, u32) {
    let h = mix(key ^ 0x0123_4567);
    ((h % S) as usize, ((h >> 48) as u32) | 1)
}

/// A ghost's tier bit (set: evicted from the window); the low 15 bits
/// hold the tier's eviction count at its eviction.
const GHOST_WINDOW: u32 = 1 << 15;
const STAMP: u32 = GHOST_WINDOW - 1;

/// A bucket's state word: the window share (bits 0-7, 0 ..= 128 slots),
/// evictions from the window and the main tier since they were last
/// halved (bits 8-15, 16-23: ARC's ghost list sizes), and each tier's
/// eviction count, wrapping (bits 32-47, 48-63: the ghosts' stamps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Meta(pub u64);

impl Meta {
    pub(crate) const INITIAL: Meta = Meta(INITIAL_WINDOW);

    fn share(self) -> u64 {
        self.0 & 0xff
    }
    fn tally(self, window: bool) -> u64 {
        (self.0 >> if window { 8 } else { 16 }) & 0xff
    }
    fn count(self, window: bool) -> u32 {
        ((self.0 >> if window { 32 } else { 48 }) & 0xffff) as u32
    }

    /// The window's share of the bucket's slots (1 ..= 127).
    pub(crate) fn window_slots(self) -> u32 {
        self.share().clamp(1, S - 1) as u32
    }

    /// A ghost hit (ghost value `g`): the new state, or `None` when no
    /// reachable share would have kept the key.
    pub(crate) fn on_ghost(self, g: u32) -> Option<Meta> {
        let window = g & GHOST_WINDOW != 0;
        let age = self.count(window).wrapping_sub(g & STAMP) & STAMP;
        let ws = self.window_slots();
        if age >= if window { S as u32 - ws } else { ws } {
            return None;
        }
        let (mine, other) = (self.tally(window).max(1), self.tally(!window).max(1));
        let step = STEP * (other / mine).max(1);
        let share = if window { (self.share() + step).min(S) } else { self.share().saturating_sub(step) };
        Some(Meta(self.0 & !0xff | share))
    }

    /// An eviction from the window (or the main tier): the ghost it
    /// leaves (without fingerprint) and the new state.
    pub(crate) fn on_evict(self, window: bool) -> (u32, Meta) {
        let c = self.count(window);
        let ghost = (c & STAMP) | if window { GHOST_WINDOW } else { 0 };
        let (mut w, mut m) = (self.tally(true), self.tally(false));
        if window {
            w += 1;
        } else {
            m += 1;
        }
        if w + m > S {
            (w, m) = (w / 2, m / 2);
        }
        let shift = if window { 32 } else { 48 };
        let counts = (self.0 & !(0xffff << shift)) | (u64::from(c.wrapping_add(1) & 0xffff) << shift);
        (ghost, Meta(counts & !0xff_ff00 | w << 8 | m << 16))
    }
}

/// The Adaptive policy's state of one table.
#[derive(Debug)]
pub(crate) struct Adapt {
    sketch: Vec<AtomicU8>,
    lines: u64,
    counted: AtomicU64,
    /// 128 per bucket of the table's largest size.
    ghosts: Vec<AtomicU32>,
    /// A [`Meta`] per bucket of the table's largest size.
    meta: Vec<AtomicU64>,
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

/// The sketch's 64-byte lines for a table of at most `max_slots` slots.
pub(crate) fn sketch_lines(max_slots: u64) -> u64 {
    (max_slots.max(1) * SKETCH_BYTES_PER_SLOT / 64).next_power_of_two()
}

impl Adapt {
    /// State for a table of at most `max_buckets` buckets.
    pub(crate) fn new(max_buckets: u64) -> Adapt {
        let lines = sketch_lines(max_buckets * S);
        Adapt {
            sketch: (0..lines * 64).map(|_| AtomicU8::new(0)).collect(),
            lines,
            counted: AtomicU64::new(0),
            ghosts: (0..max_buckets * S).map(|_| AtomicU32::new(0)).collect(),
            meta: (0..max_buckets).map(|_| AtomicU64::new(Meta::INITIAL.0)).collect(),
        }
    }

    /// The sketch's estimate of `key`'s recent accesses (0 ..= 15).
    #[inline]
    pub(crate) fn frequency(&self, key: u64) -> u8 {
        sketch_indices(key, self.lines).iter().map(|&i| self.sketch[i].load(Relaxed)).min().unwrap_or(0)
    }

    /// Counts one access of `key`: each of its counters one more,
    /// saturating.
    #[inline]
    pub(crate) fn count(&self, key: u64) {
        for i in sketch_indices(key, self.lines) {
            let _ = self.sketch[i].fetch_update(Relaxed, Relaxed, |c| (c < COUNTER_MAX).then_some(c + 1));
        }
        self.counted.fetch_add(1, Relaxed);
    }

    /// At a batch's end (its group still held): halves every counter once
    /// the accesses counted since the last halving reach the period of a
    /// table of `slots` slots.
    pub(crate) fn age(&self, slots: u64) {
        if self.counted.load(Relaxed) < slots * PERIOD_PER_SLOT {
            return;
        }
        self.counted.store(0, Relaxed);
        for c in &self.sketch {
            c.store(c.load(Relaxed) >> 1, Relaxed);
        }
    }

    /// Bucket `b`'s state (its lock held).
    #[inline]
    pub(crate) fn meta(&self, b: usize) -> Meta {
        Meta(self.meta[b].load(Relaxed))
    }

    /// A newcomer to candidate buckets `b1`, `b2` (locked): if its ghost is
    /// in one of them (b1 first), that bucket's share moves and the ghost
    /// is forgotten.
    #[inline]
    pub(crate) fn on_miss(&self, b1: usize, b2: usize, key: u64) {
        let (slot, fp) = ghost_of(key);
        for b in [b1, b2].into_iter().take(if b1 == b2 { 1 } else { 2 }) {
            let g = &self.ghosts[b * BUCKET_SLOTS + slot];
            let v = g.load(Relaxed);
            if v >> 16 == fp {
                g.store(0, Relaxed);
                if let Some(m) = self.meta(b).on_ghost(v) {
                    self.meta[b].store(m.0, Relaxed);
                }
                return;
            }
        }
    }

    /// Records the eviction of `key` from bucket `b`'s window or main tier.
    #[inline]
    pub(crate) fn on_evict(&self, b: usize, key: u64, window: bool) {
        let (slot, fp) = ghost_of(key);
        let (ghost, m) = self.meta(b).on_evict(window);
        self.ghosts[b * BUCKET_SLOTS + slot].store(fp << 16 | ghost, Relaxed);
        self.meta[b].store(m.0, Relaxed);
    }

    /// How full bucket `b` with tiers `t` makes room for a newcomer;
    /// `key_of` reads a slot's key.
    #[inline]
    pub(crate) fn room(&self, b: usize, t: &Tiers, key_of: impl Fn(usize) -> u64) -> Room {
        let win = self.meta(b).window_slots();
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
        let a = Adapt::new(1);
        for _ in 0..20 {
            a.count(7);
        }
        assert_eq!(a.frequency(7), COUNTER_MAX);
        assert_eq!(a.frequency(8), 0);
        for k in 0..(10 * 128) {
            a.count(1_000_000 + k);
        }
        a.age(128);
        assert_eq!(a.frequency(7), COUNTER_MAX / 2);
    }

    /// A key's counters lie in one 64-byte line, one in each quarter.
    #[test]
    fn a_key_touches_one_line() {
        for k in 0..1000u64 {
            let ix = sketch_indices(k, 1 << 10);
            assert!(ix.iter().all(|&i| i / 64 == ix[0] / 64 && i < 64 << 10));
            assert!(ix.iter().enumerate().all(|(r, &i)| (i % 64) / 16 == r));
        }
    }

    /// Ghost hits move the window's share: a window ghost grows it, a main
    /// ghost shrinks it; a ghost counts once; a key without a ghost moves
    /// nothing; a ghost older than any share could serve moves nothing.
    #[test]
    fn ghosts_move_the_window_share() {
        let a = Adapt::new(2);
        let w0 = a.meta(1).window_slots();
        a.on_miss(1, 1, 5);
        assert_eq!(a.meta(1).window_slots(), w0);
        a.on_evict(1, 5, true);
        a.on_miss(1, 1, 5);
        assert!(a.meta(1).window_slots() > w0);
        let w1 = a.meta(1).window_slots();
        a.on_miss(1, 1, 5);
        assert_eq!(a.meta(1).window_slots(), w1, "a ghost counts once");
        a.on_evict(1, 6, false);
        a.on_miss(0, 1, 6);
        assert!(a.meta(1).window_slots() < w1, "found in the second candidate");
        assert_eq!(a.meta(0), Meta::INITIAL);
        let w2 = a.meta(1).window_slots();
        a.on_evict(1, 9, true);
        for k in 1000..1000 + 128 {
            a.on_evict(1, k, true);
        }
        let (slot, fp) = ghost_of(9);
        a.ghosts[128 + slot].store(fp << 16 | GHOST_WINDOW, Relaxed);
        a.on_miss(1, 1, 9);
        assert_eq!(a.meta(1).window_slots(), w2, "older than the main tier's slots");
    }

    /// A full bucket's choice: the window candidate must beat the oldest
    /// main entry; under its share the window grows at main's cost.
    #[test]
    fn room_follows_the_window_rule() {
        let a = Adapt::new(1);
        let scores: Vec<(usize, u64)> =
            (0..128).map(|s| (s, if s < 64 { 100 + s as u64 } else { ADAPTIVE_MAIN | s as u64 })).collect();
        let t = Tiers::of(scores.iter().copied());
        assert_eq!((t.window, t.oldest_window, t.oldest_main), (64, Some((0, 100)), Some((64, ADAPTIVE_MAIN | 64))));
        let key = |s: usize| s as u64 + 1;
        assert_eq!(a.room(0, &t, key), Room::Evict { slot: 0, window: true }, "ties keep the main entry");
        a.count(1);
        assert_eq!(a.room(0, &t, key), Room::Promote { promote: 0, slot: 64 });
        a.meta[0].store(Meta(64).0, Relaxed);
        let small = Tiers { window: 3, ..t };
        assert_eq!(a.room(0, &small, key), Room::Evict { slot: 64, window: false });
    }
}
