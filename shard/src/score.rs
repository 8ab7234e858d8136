//! Score rules of each policy (the reference library's ScoreFunctors).
//!
//! | policy | on insert | on write to an existing key | admission of a newcomer |
//! |---|---|---|---|
//! | Lru | now (ns) | now | always (the clock only grows) |
//! | Lfu | increment (default 1) | old + increment, saturating | always |
//! | EpochLru | epoch << 32 \| (now >> 20) as u32 | same | score >= bucket minimum |
//! | EpochLfu | epoch << 32 \| increment as u32 | epoch << 32 \| sat32(low + increment) | score >= bucket minimum |
//! | Custom | caller's score | caller's score | score >= bucket minimum |
//!
//! Update-only operations (`assign`, `assign_scores`) without scores keep the
//! stored score for Lfu, EpochLfu and Custom, and refresh it for Lru and EpochLru.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::config::ScorePolicy;

/// A source of nanoseconds for Lru and EpochLru scores.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Nanoseconds on a clock that never goes back.
    fn now_ns(&self) -> u64;
    /// Moves the clock forward to at least `ns` (never back): after a
    /// restore, so that new writes score above the restored entries.
    fn advance_to(&self, ns: u64);
}

/// The process's monotonic clock, counted from first use (plus one, so a
/// fresh entry never scores 0), plus an offset that only grows: a restore
/// moves it past the restored scores, so time continues from them instead of
/// restarting with the process.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
    offset: AtomicU64,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock { start: Instant::now(), offset: AtomicU64::new(0) }
    }
}

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        (self.start.elapsed().as_nanos() as u64 + 1).saturating_add(self.offset.load(Ordering::Relaxed))
    }
    fn advance_to(&self, ns: u64) {
        let elapsed = self.start.elapsed().as_nanos() as u64 + 1;
        self.offset.fetch_max(ns.saturating_sub(elapsed), Ordering::Relaxed);
    }
}

/// A clock the caller moves: deterministic Lru scores for tests and simulators.
#[derive(Debug, Default)]
pub struct ManualClock(pub AtomicU64);

impl ManualClock {
    /// A manual clock at `ns`.
    pub fn new(ns: u64) -> Arc<Self> {
        Arc::new(ManualClock(AtomicU64::new(ns)))
    }
    /// Sets the time.
    pub fn set(&self, ns: u64) {
        self.0.store(ns, Ordering::Relaxed);
    }
    /// Moves the time forward.
    pub fn advance(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    fn advance_to(&self, ns: u64) {
        self.0.fetch_max(ns, Ordering::Relaxed);
    }
}

/// After restoring entries whose highest score is `max_score`: moves the
/// epoch (EpochLru, EpochLfu: to the restored epoch, if higher) and the
/// clock (Lru: past the score; EpochLru: past its ~ms part) so that every
/// later write ranks above the restored entries, as it did before the
/// restart. Lfu and Custom scores do not follow time: nothing moves.
pub fn resume_after(policy: ScorePolicy, max_score: u64, clock: &dyn Clock, epoch: &AtomicU32) {
    match policy {
        ScorePolicy::Lru => clock.advance_to(max_score.saturating_add(1)),
        ScorePolicy::EpochLru => {
            epoch.fetch_max((max_score >> 32) as u32, Ordering::Relaxed);
            clock.advance_to(((max_score & 0xffff_ffff) + 1) << 20);
        }
        ScorePolicy::EpochLfu => {
            epoch.fetch_max((max_score >> 32) as u32, Ordering::Relaxed);
        }
        ScorePolicy::Lfu | ScorePolicy::Custom => {}
    }
}

/// The score context of one batch: policy, clock reading and epoch. A batch
/// reads the clock once, so all its keys share one timestamp.
#[derive(Debug, Clone, Copy)]
pub struct Scorer {
    /// The table's policy.
    pub policy: ScorePolicy,
    /// Clock reading for this batch.
    pub now_ns: u64,
    /// The table's global epoch.
    pub epoch: u32,
}

impl Scorer {
    fn epoch_hi(&self) -> u64 {
        (self.epoch as u64) << 32
    }

    /// Score of a key inserted with caller input `input`.
    #[inline]
    pub fn on_insert(&self, input: Option<u64>) -> u64 {
        match self.policy {
            ScorePolicy::Lru => self.now_ns,
            ScorePolicy::Lfu => input.unwrap_or(1),
            ScorePolicy::EpochLru => self.epoch_hi() | ((self.now_ns >> 20) & 0xffff_ffff),
            ScorePolicy::EpochLfu => self.epoch_hi() | (input.unwrap_or(1) & 0xffff_ffff),
            // Validated before: Custom always has input on insert paths.
            ScorePolicy::Custom => input.unwrap_or(0),
        }
    }

    /// The value compared with the bucket minimum for admission: Lfu admits
    /// every newcomer (the reference compares against u64::MAX).
    #[inline]
    pub fn admission(&self, insert_score: u64) -> u64 {
        match self.policy {
            ScorePolicy::Lfu | ScorePolicy::Lru => u64::MAX,
            _ => insert_score,
        }
    }

    /// Score of an existing key written by an insert-like operation
    /// (insert_or_assign, find_or_insert hit, accum_or_assign).
    #[inline]
    pub fn on_upsert(&self, old: u64, input: Option<u64>) -> u64 {
        match self.policy {
            ScorePolicy::Lru | ScorePolicy::EpochLru | ScorePolicy::Custom => self.on_insert(input),
            ScorePolicy::Lfu => old.saturating_add(input.unwrap_or(1)),
            ScorePolicy::EpochLfu => self.epoch_lfu_add(old, input.unwrap_or(1)),
        }
    }

    /// Score of an existing key written by an update-only operation (assign,
    /// assign_scores): without input, counting policies keep the old score.
    #[inline]
    pub fn on_update(&self, old: u64, input: Option<u64>) -> u64 {
        match (self.policy, input) {
            (ScorePolicy::Lfu | ScorePolicy::EpochLfu | ScorePolicy::Custom, None) => old,
            _ => self.on_upsert(old, input),
        }
    }

    /// The lowest score a write made from now on can get, for policies whose
    /// scores grow with time; 0 for Lfu and Custom (see `Shard::clock_score`).
    pub fn clock_floor(&self) -> u64 {
        match self.policy {
            ScorePolicy::Lru | ScorePolicy::EpochLru => self.on_insert(None),
            ScorePolicy::EpochLfu => self.epoch_hi(),
            ScorePolicy::Lfu | ScorePolicy::Custom => 0,
        }
    }

    fn epoch_lfu_add(&self, old: u64, inc: u64) -> u64 {
        let low = (old & 0xffff_ffff).saturating_add(inc & 0xffff_ffff).min(0xffff_ffff);
        self.epoch_hi() | low
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(policy: ScorePolicy) -> Scorer {
        Scorer { policy, now_ns: 5 << 20, epoch: 3 }
    }

    #[test]
    fn rules_per_policy() {
        assert_eq!(s(ScorePolicy::Lru).on_insert(None), 5 << 20);
        assert_eq!(s(ScorePolicy::Lfu).on_upsert(7, Some(2)), 9);
        assert_eq!(s(ScorePolicy::Lfu).on_upsert(u64::MAX - 1, Some(5)), u64::MAX);
        assert_eq!(s(ScorePolicy::EpochLru).on_insert(None), (3 << 32) | 5);
        assert_eq!(s(ScorePolicy::EpochLfu).on_insert(Some(4)), (3 << 32) | 4);
        assert_eq!(s(ScorePolicy::EpochLfu).on_upsert((1 << 32) | 0xffff_fffe, Some(9)), (3 << 32) | 0xffff_ffff);
        assert_eq!(s(ScorePolicy::Custom).on_upsert(100, Some(4)), 4);
        assert_eq!(s(ScorePolicy::Custom).on_update(100, None), 100);
        assert_eq!(s(ScorePolicy::Lfu).on_update(100, None), 100);
        assert_eq!(s(ScorePolicy::Lru).on_update(100, None), 5 << 20);
        assert_eq!(s(ScorePolicy::Lfu).admission(1), u64::MAX);
        assert_eq!(s(ScorePolicy::Custom).admission(1), 1);
    }

    #[test]
    fn a_restore_moves_clock_and_epoch_past_the_restored_scores() {
        let (c, e) = (SystemClock::default(), AtomicU32::new(0));
        resume_after(ScorePolicy::Lru, 1 << 50, &c, &e);
        assert!(c.now_ns() > 1 << 50);
        let (c, e) = (SystemClock::default(), AtomicU32::new(2));
        resume_after(ScorePolicy::EpochLru, (5 << 32) | 1000, &c, &e);
        let sc = Scorer { policy: ScorePolicy::EpochLru, now_ns: c.now_ns(), epoch: e.load(Ordering::Relaxed) };
        assert!(sc.on_insert(None) > (5 << 32) | 1000);
        let (c, e) = (ManualClock::default(), AtomicU32::new(9));
        resume_after(ScorePolicy::EpochLfu, 5 << 32, &c, &e);
        assert_eq!(e.load(Ordering::Relaxed), 9, "the epoch never goes back");
    }
}
