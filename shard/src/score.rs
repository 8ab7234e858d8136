//! Score rules of each policy (the reference library's ScoreFunctors).
//!
//! | policy | on insert | on write to an existing key | admission of a newcomer |
//! |---|---|---|---|
//! | Lru | now (ns) | now | always (the clock only grows) |
//! | Lfu (ties: lru) | freq << 40 \| stamp, freq = increment (default 1) | freq = old freq + increment, saturating at 2^24 − 1; stamp = now | always |
//! | Lfu (ties: lowest-slot) | increment (default 1) | old + increment, saturating | always |
//! | EpochLru | epoch << 32 \| (now >> 20) as u32 | same | score >= bucket minimum |
//! | EpochLfu | epoch << 32 \| increment as u32 | epoch << 32 \| sat32(low + increment) | score >= bucket minimum |
//! | Custom | caller's score | caller's score | score >= bucket minimum |
//! | Adaptive | now (ns), window tier | window: now; main tier: now, protected (bit 62) | always into the window; the window's oldest entry is admitted to the main tier by the frequency sketch (`cpu::adapt`) |
//!
//! Update-only operations (`assign`, `assign_scores`) without scores keep the
//! stored score for Lfu, EpochLfu and Custom, and refresh it for Lru and EpochLru.
//!
//! Lfu with [`LfuTies::Lru`] (the default) packs two numbers in a score:
//! the frequency in the high 24 bits and a stamp, the batch's clock in ~ms
//! (ns >> 20, 40 bits), in the low 40. Every policy evicts the minimum
//! score, so the least frequent entry goes and, among equal frequencies, the
//! least recently written one (issue 27: with plain frequencies a full
//! bucket's lowest slot took every newcomer). [`lfu_frequency`] and
//! [`lfu_stamp`] take a packed score apart. EpochLfu has no bits to spare
//! (epoch 32, frequency 32) and keeps the lowest-slot rule.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// How scores are computed. Larger score = more valuable; eviction removes the
/// minimum and admission refuses a newcomer whose score is below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ScorePolicy {
    /// Score = a monotonic clock in ns, set on insert and on every write.
    #[default]
    Lru,
    /// Score = accumulated caller increments (default increment 1); how
    /// equal frequencies are told apart is the `lfu_ties` of [`TableConfig`].
    Lfu,
    /// Score = caller epoch in the high 32 bits, clock in ~ms (ns >> 20) in the low 32.
    EpochLru,
    /// Score = caller epoch in the high 32 bits, saturating frequency in the low 32.
    EpochLfu,
    /// Score = the caller's value, verbatim.
    Custom,
    /// A window-TinyLFU inside each bucket with an adaptive window (issue
    /// 36): score = tier bits (63: main, 62: protected; both clear:
    /// window) over the clock in ns. Newcomers enter the window; when a
    /// full bucket's window is at its share, its oldest entry must beat the
    /// oldest unprotected main entry in a count-min frequency sketch (by 2
    /// counts) to move to the main part, else it goes. The window share is
    /// one for the table, chosen between batches by miniature simulations
    /// of sampled accesses. See `cpu::adapt`; the CUDA backend follows the
    /// same rules.
    Adaptive,
}

impl ScorePolicy {
    /// Every policy, in a fixed order (tests, CLIs).
    pub const ALL: [ScorePolicy; 6] = [
        ScorePolicy::Lru,
        ScorePolicy::Lfu,
        ScorePolicy::EpochLru,
        ScorePolicy::EpochLfu,
        ScorePolicy::Custom,
        ScorePolicy::Adaptive,
    ];

    /// Whether callers may pass scores to insert-like operations.
    pub fn takes_scores(self) -> bool {
        !matches!(self, ScorePolicy::Lru | ScorePolicy::EpochLru | ScorePolicy::Adaptive)
    }

    /// Whether `find` hits refresh scores when the table does not say
    /// (`TableConfig::reads_refresh`): only for Adaptive, so that the
    /// paper's policies keep HKV's semantics (a find touches no score).
    pub fn reads_refresh_default(self) -> bool {
        self == ScorePolicy::Adaptive
    }

    /// The name used in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ScorePolicy::Lru => "lru",
            ScorePolicy::Lfu => "lfu",
            ScorePolicy::EpochLru => "epoch-lru",
            ScorePolicy::EpochLfu => "epoch-lfu",
            ScorePolicy::Custom => "custom",
            ScorePolicy::Adaptive => "adaptive",
        }
    }
}

/// Which of several Lfu entries of equal frequency a full bucket evicts.
///
/// The reference library scores an Lfu entry with its frequency alone and
/// evicts the lowest slot among equal minimum scores, so in a full bucket of
/// frequency-1 entries every newcomer takes the same slot and is evicted by
/// the next one before it can be counted twice (hkv-sim at 1 Mi slots,
/// dual mode: 1.06 pp below the ideal Lfu at Zipf α 0.5, top-N retention
/// 0.77 at α 0.99; issue 27). [`LfuTies::Lru`] evicts the least recently
/// written of them instead, as the ideal Lfu does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LfuTies {
    /// The least recently written entry goes. The score carries the
    /// frequency in its high 24 bits (saturating at 2^24 − 1) and the batch's
    /// clock in ~ms (ns >> 20, 40 bits: 36 years) in its low 40, so the one
    /// minimum-score rule of every policy picks the least frequent entry and,
    /// among equals, the oldest; in dual mode the candidate bucket holding
    /// the older one is chosen. Exported and found scores are these packed
    /// values: [`crate::score::lfu_frequency`] recovers the frequency.
    #[default]
    Lru,
    /// The reference library's rule: score = frequency (saturating at
    /// u64::MAX), lowest slot among equal scores. Exported scores are plain
    /// frequencies, as a reference table's.
    LowestSlot,
}

impl LfuTies {
    /// Every rule, in a fixed order (tests, CLIs).
    pub const ALL: [LfuTies; 2] = [LfuTies::Lru, LfuTies::LowestSlot];

    /// The name used in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            LfuTies::Lru => "lru",
            LfuTies::LowestSlot => "lowest-slot",
        }
    }
}

/// Lfu with [`LfuTies::Lru`]: bits of the stamp (low) in a packed score.
pub const LFU_STAMP_BITS: u32 = 40;
/// Lfu with [`LfuTies::Lru`]: the largest frequency a packed score holds;
/// higher counts saturate there (and such entries then rank by recency).
pub const LFU_MAX_FREQUENCY: u64 = (1 << (64 - LFU_STAMP_BITS)) - 1;
const STAMP_MASK: u64 = (1 << LFU_STAMP_BITS) - 1;

/// The frequency of an Lfu score under the given tie rule.
pub fn lfu_frequency(score: u64, ties: LfuTies) -> u64 {
    match ties {
        LfuTies::Lru => score >> LFU_STAMP_BITS,
        LfuTies::LowestSlot => score,
    }
}

/// The stamp (clock ns >> 20 of the last write) of an Lfu score packed
/// under [`LfuTies::Lru`].
pub fn lfu_stamp(score: u64) -> u64 {
    score & STAMP_MASK
}

/// Adaptive: the bit that marks an entry of the main tier (clear: window).
pub const ADAPTIVE_MAIN: u64 = 1 << 63;

/// Adaptive: the bit that marks a main-tier entry as protected (a hit
/// since it entered the main tier; clear: probation, evicted first).
pub const ADAPTIVE_PROTECTED: u64 = 1 << 62;

/// Adaptive: the tier bits of a score.
pub const ADAPTIVE_TIERS: u64 = ADAPTIVE_MAIN | ADAPTIVE_PROTECTED;

/// Adaptive: the bits of a score that count the entry's find hits (bits
/// 0-3, saturating at 15; halved with the frequency sketch). Between them
/// and the tier bits, the clock (ns) of its last write or hit.
pub const ADAPTIVE_HITS: u64 = 15;

/// Adaptive: how far the clock is shifted in a score (past the hits).
pub const ADAPTIVE_STAMP_SHIFT: u32 = 4;

/// Adaptive: the largest clock reading a score holds (later ones count as it: 9 years).
pub const ADAPTIVE_STAMP_MAX: u64 = (1 << (62 - ADAPTIVE_STAMP_SHIFT)) - 1;

/// Adaptive: the clock reading (ns) of a score, without tiers and hits.
pub fn adaptive_stamp(score: u64) -> u64 {
    (score & !ADAPTIVE_TIERS) >> ADAPTIVE_STAMP_SHIFT
}

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

/// The process's one [`SystemClock`], which every table a backend creates
/// without a clock of its own shares: scores of tables of one process are
/// on one time line, so that entries exported from one table and loaded
/// into another rank below later writes to it (with a clock per table, a
/// table created later started again at 1, and the entries of an older
/// table's export outranked every write to it until its clock caught up).
/// A restore moves it past the restored clock (`resume_after`), which only
/// ever moves it forward, for every table alike.
pub fn process_clock() -> Arc<SystemClock> {
    static CLOCK: std::sync::OnceLock<Arc<SystemClock>> = std::sync::OnceLock::new();
    CLOCK.get_or_init(|| Arc::new(SystemClock::default())).clone()
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
/// restart. Lfu with [`LfuTies::Lru`]: the clock past the stamp of the
/// highest score, a lower bound of the newest restored stamp (the most
/// frequent entry is not always the latest written), so that at least the
/// entries written after that one lose ties to new writes. Lfu with the
/// lowest-slot rule and Custom scores do not follow time: nothing moves.
pub fn resume_after(policy: ScorePolicy, ties: LfuTies, max_score: u64, clock: &dyn Clock, epoch: &AtomicU32) {
    match policy {
        ScorePolicy::Lfu if ties == LfuTies::Lru => clock.advance_to((lfu_stamp(max_score) + 1) << 20),
        ScorePolicy::Lru => clock.advance_to(max_score.saturating_add(1)),
        ScorePolicy::Adaptive => clock.advance_to(adaptive_stamp(max_score).saturating_add(1)),
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
    /// The table's Lfu tie rule.
    pub lfu_ties: LfuTies,
}

impl Scorer {
    fn epoch_hi(&self) -> u64 {
        (self.epoch as u64) << 32
    }

    /// An Lfu score of frequency `freq` written now, under the table's tie rule.
    #[inline]
    fn lfu(&self, freq: u64) -> u64 {
        match self.lfu_ties {
            LfuTies::Lru => freq.min(LFU_MAX_FREQUENCY) << LFU_STAMP_BITS | (self.now_ns >> 20).min(STAMP_MASK),
            LfuTies::LowestSlot => freq,
        }
    }

    /// Score of a key inserted with caller input `input`.
    #[inline]
    pub fn on_insert(&self, input: Option<u64>) -> u64 {
        match self.policy {
            ScorePolicy::Lru => self.now_ns,
            ScorePolicy::Adaptive => self.now_ns.min(ADAPTIVE_STAMP_MAX) << ADAPTIVE_STAMP_SHIFT,
            ScorePolicy::Lfu => self.lfu(input.unwrap_or(1)),
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
            ScorePolicy::Lfu | ScorePolicy::Lru | ScorePolicy::Adaptive => u64::MAX,
            _ => insert_score,
        }
    }

    /// Score of an existing key written by an insert-like operation
    /// (insert_or_assign, find_or_insert hit, accum_or_assign).
    #[inline]
    pub fn on_upsert(&self, old: u64, input: Option<u64>) -> u64 {
        match self.policy {
            ScorePolicy::Lru | ScorePolicy::EpochLru | ScorePolicy::Custom => self.on_insert(input),
            // A main-tier entry written or read again is protected (SLRU);
            // its find hits stay counted (writes count in the sketch).
            ScorePolicy::Adaptive => self.adaptive_refresh(old, 0),
            ScorePolicy::Lfu => self.lfu(lfu_frequency(old, self.lfu_ties).saturating_add(input.unwrap_or(1))),
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

    /// Score of an entry a `find` hit in a table whose reads refresh
    /// (`TableConfig::refreshes_reads`): what a write without input would
    /// give it (the clock; one more access for the counting policies);
    /// Custom scores belong to the caller and stay.
    #[inline]
    pub fn on_read(&self, old: u64) -> u64 {
        match self.policy {
            ScorePolicy::Custom => old,
            ScorePolicy::Adaptive => self.adaptive_refresh(old, 1),
            _ => self.on_upsert(old, None),
        }
    }

    /// The score a refreshing find reports for a hit whose score became
    /// `now`: Adaptive leaves out the hit count (bits 0-3), whose value at
    /// a given key of a batch that holds the key more than once depends on
    /// the order its hits ran in.
    #[inline]
    pub fn read_answer(&self, now: u64) -> u64 {
        match self.policy {
            ScorePolicy::Adaptive => now & !ADAPTIVE_HITS,
            _ => now,
        }
    }

    /// Adaptive: `old` refreshed (the clock now; a main-tier entry
    /// protected) with `hits` more find hits counted in it (saturating).
    #[inline]
    fn adaptive_refresh(&self, old: u64, hits: u64) -> u64 {
        let tiers = if old & ADAPTIVE_MAIN != 0 { ADAPTIVE_TIERS } else { 0 };
        tiers | self.on_insert(None) | ((old & ADAPTIVE_HITS) + hits).min(ADAPTIVE_HITS)
    }

    /// The lowest score a write made from now on can get, for policies whose
    /// scores grow with time; 0 for Lfu and Custom (see `Shard::clock_score`).
    pub fn clock_floor(&self) -> u64 {
        match self.policy {
            ScorePolicy::Lru | ScorePolicy::EpochLru | ScorePolicy::Adaptive => self.on_insert(None),
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
        Scorer { policy, now_ns: 5 << 20, epoch: 3, lfu_ties: LfuTies::LowestSlot }
    }

    fn lfu(now_ns: u64) -> Scorer {
        Scorer { policy: ScorePolicy::Lfu, now_ns, epoch: 0, lfu_ties: LfuTies::Lru }
    }

    /// Lfu with LRU ties: frequency high, stamp low; a later write of the
    /// same frequency scores higher, a higher frequency always does.
    #[test]
    fn lfu_scores_pack_frequency_and_stamp() {
        let a = lfu(5 << 20).on_insert(None);
        assert_eq!((lfu_frequency(a, LfuTies::Lru), lfu_stamp(a)), (1, 5));
        let b = lfu(9 << 20).on_insert(None);
        assert!(b > a, "same frequency, written later");
        let c = lfu(6 << 20).on_upsert(a, Some(2));
        assert_eq!((lfu_frequency(c, LfuTies::Lru), lfu_stamp(c)), (3, 6));
        assert!(lfu(0).on_insert(Some(2)) > lfu(u64::MAX).on_insert(None), "frequency first");
        let top = lfu(7 << 20).on_upsert(c, Some(u64::MAX));
        assert_eq!((lfu_frequency(top, LfuTies::Lru), lfu_stamp(top)), (LFU_MAX_FREQUENCY, 7));
        assert_eq!(lfu_stamp(lfu(u64::MAX).on_insert(None)), STAMP_MASK, "the stamp saturates");
        assert_eq!(lfu(8 << 20).on_update(c, None), c, "update-only ops without scores keep it");
        assert_eq!(lfu(8 << 20).admission(1), u64::MAX);
        assert_eq!(lfu(8 << 20).clock_floor(), 0);
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
        resume_after(ScorePolicy::Lru, LfuTies::Lru, 1 << 50, &c, &e);
        assert!(c.now_ns() > 1 << 50);
        let (c, e) = (SystemClock::default(), AtomicU32::new(2));
        resume_after(ScorePolicy::EpochLru, LfuTies::Lru, (5 << 32) | 1000, &c, &e);
        let sc = Scorer {
            policy: ScorePolicy::EpochLru,
            now_ns: c.now_ns(),
            epoch: e.load(Ordering::Relaxed),
            lfu_ties: LfuTies::Lru,
        };
        assert!(sc.on_insert(None) > (5 << 32) | 1000);
        let (c, e) = (ManualClock::default(), AtomicU32::new(9));
        resume_after(ScorePolicy::EpochLfu, LfuTies::Lru, 5 << 32, &c, &e);
        assert_eq!(e.load(Ordering::Relaxed), 9, "the epoch never goes back");
        let (c, e) = (ManualClock::default(), AtomicU32::new(0));
        resume_after(ScorePolicy::Lfu, LfuTies::Lru, lfu(40 << 20).on_insert(Some(3)), &c, &e);
        assert!(lfu(c.now_ns()).on_insert(Some(3)) > lfu(40 << 20).on_insert(Some(3)));
        let (c, e) = (ManualClock::default(), AtomicU32::new(0));
        resume_after(ScorePolicy::Lfu, LfuTies::LowestSlot, 1 << 50, &c, &e);
        assert_eq!(c.now_ns(), 0, "plain frequencies do not follow time");
    }
}
