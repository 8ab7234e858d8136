//! The Adaptive policy's side state (issue 36): a count-min frequency
//! sketch of the table, and the table's window share, chosen between
//! batches by miniature simulations (`minisim`).
//!
//! Each bucket is a small window-TinyLFU cache with a segmented main tier.
//! An entry's score is bit 63 set for the main tier ([`ADAPTIVE_MAIN`]),
//! bit 62 for its protected part ([`ADAPTIVE_PROTECTED`]), the clock (ns)
//! of its last write or hit shifted past 4 bits, and in those 4 bits the
//! find hits it had while resident ([`ADAPTIVE_HITS`], saturating at 15);
//! newcomers enter the window (both tier bits clear, no hits). A refresh
//! (a find hit when reads refresh, or a write of a present key) of a main
//! entry protects it; a window entry stays in the window. `win`
//! being the window's share of a bucket's 128 slots (the same for every
//! bucket during a batch), a newcomer to a bucket makes room this way:
//! - the window over its share: its oldest entries move to the main tier
//!   (unprotected, "probation") until it is not (the share shrank);
//! - a bucket with a free slot: while the window holds `win` entries or
//!   more, its oldest moves to the main tier (so that a bucket reaches its
//!   first eviction already split); the newcomer takes the free slot;
//! - a full bucket: first, while more than 80 % of the main tier is
//!   protected, the oldest protected entry loses its protection (keeping
//!   its stamp: SLRU's demotion to probation). Then, the window at its
//!   share, its oldest entry (the candidate) is compared with the main
//!   tier's lowest score (the victim: the oldest unprotected entry, or the
//!   oldest protected one when none is unprotected) by their estimates
//!   (the sketch's count plus the hits in the score, at most 15); the
//!   candidate moves to the main tier (unprotected) and the victim is
//!   evicted only if the candidate was counted at least 2 more times
//!   ([`ADMIT_MARGIN`]), else the candidate is evicted (TinyLFU's rule,
//!   which keeps a scan from flushing the main tier, with a margin that
//!   keeps the retained part of a scan or loop from churning). The window
//!   under its share: the victim is evicted.
//!
//! The window share is one for the whole table, chosen between batches by
//! six miniature W-TinyLFU caches (`minisim`) fed a hash-sampled part of
//! the table's accesses: the keys of a refreshing find's hits and the keys
//! an insert-like batch writes with policy scores, the same keys the sketch
//! counts, in batch order, after the batch. The next batch's share is the
//! window of the miniature with the most recent hits
//! (`shard/BENCHMARKS.md`, "Adaptive policy": per-bucket ghosts moved it
//! too slowly for drifting traces). The miniatures live on the host, one
//! [`Window`] per table for either backend; the CUDA kernels take the share
//! as a launch argument.
//!
//! The sketch: 64-bit words of 16 4-bit counters saturating at 15, a word
//! per key, its counter of each row one of the 4 nibbles of the word's
//! quarter for that row (one word touched per access, so that one
//! compare-and-swap counts it; Caffeine's blocked sketch keeps a key in one
//! 64-byte line instead), 32 bytes (64 counters) per slot of the table's
//! largest size. Once the accesses counted reach
//! 10 × the table's slots all counters halve (TinyLFU's reset), at the end
//! of the batch that crossed the mark, and so do the hits in every entry's
//! score, so that a frequency is an estimate of the recent past only.
//! Counted, as plain increments (their order does not change the result):
//! every key an insert-like batch writes, before the batch places any, and,
//! after a writer batch, the hits of each entry it evicted (so a key that
//! comes back is as frequent as its past says). A `find` hit counts in its
//! entry's score only: a refreshing find touches nothing but the entries it
//! hits (on the H200 a hit's count in the sketch, one more random word read
//! and swapped, halved the find's throughput), and each hit still counts
//! towards the halving period.
//!
//! Determinism: within a batch the sketch only grows by order-free
//! increments and is read only while no increments run (inserts after
//! their batch's counts and before its folds; finds do not read it); an
//! entry's hits change only by finds (compare-and-swap increments, which
//! compose) and halvings, outside writer batches; the window share is fixed
//! for the batch; a bucket's scores are read and written only with the
//! bucket locked, by keys that reach it in index order (small batches on
//! either backend). So the CUDA backend (`kernels/table.cuh`, "adaptive
//! policy") makes the same choices as this one, key for key. The
//! miniatures are fed after each batch in index order; read batches that
//! run at the same time feed them in the order they finish.
//!
//! What a checkpoint or export keeps: the entries' scores, tier bits and
//! hits included, so a restored table has its window, probation and
//! protected entries where they were, and their own hits. Not kept: the
//! sketch (the counts of writes and of evicted entries start at 0)
//! and the miniatures (the share starts again at 85 %, then follows the
//! restored table's accesses).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use rayon::prelude::*;

use super::minisim::{sample_rate, sampled, Chooser};
use crate::hash::fmix64;
use crate::score::{ADAPTIVE_HITS, ADAPTIVE_MAIN, ADAPTIVE_PROTECTED};
use crate::BUCKET_SLOTS;

/// Sketch rows (counters per key).
pub(crate) const ROWS: usize = 4;
const COUNTER_MAX: u8 = 15;
/// Sketch bytes (two 4-bit counters each) per slot of the table's largest size.
pub(crate) const SKETCH_BYTES_PER_SLOT: u64 = 32;
/// Counted accesses between halvings, per slot.
pub(crate) const PERIOD_PER_SLOT: u64 = 10;
/// The most of a bucket's main tier that is protected, in tenths.
pub(crate) const PROTECTED_TENTHS: u32 = 8;
/// How much more frequent than the victim a window candidate must be to
/// join a full main tier (0: TinyLFU's "more frequent"); the miniatures
/// use the same (`minisim::ADMIT_MARGIN`).
pub(crate) const ADMIT_MARGIN: u8 = super::minisim::ADMIT_MARGIN;

/// The sketch word of `key` in a sketch of `lines` 64-byte lines (a power
/// of two; 8 words of 16 4-bit counters each) and the bit shift of its
/// counter of each row in it: one of the 4 nibbles of the word's quarter
/// for that row, so that one compare-and-swap counts an access.
#[inline]
pub(crate) fn sketch_slot(key: u64, lines: u64) -> (usize, [u32; ROWS]) {
    let h = fmix64(key ^ 0x9e37_79b9_7f4a_7c15);
    let word = ((h >> 16) & (lines * 8 - 1)) as usize;
    (word, std::array::from_fn(|r| (r as u32 * 4 + ((h >> (2 * r)) & 3) as u32) * 4))
}

/// The sketch's 64-byte lines for a table of at most `max_slots` slots.
pub(crate) fn sketch_lines(max_slots: u64) -> u64 {
    (max_slots.max(1) * SKETCH_BYTES_PER_SLOT / 64).next_power_of_two()
}

/// Batches from this many keys filter their sampled keys on the rayon
/// pool (one mix per key: about 2 ns, so 2 ms for 1 Mi keys on one core).
const PARALLEL_FILTER: usize = 1 << 16;

/// The table's window share and the miniatures that choose it; on the
/// host for both backends.
#[derive(Debug)]
pub(crate) struct Window {
    chooser: Mutex<Chooser>,
    /// The share of every bucket's window for the next batch (slots).
    slots: AtomicU32,
}

impl Window {
    /// The chooser of a table of `slots` slots, at its first choice.
    pub(crate) fn new(slots: u64) -> Window {
        let c = Chooser::new(slots);
        Window { slots: AtomicU32::new(c.bucket_window()), chooser: Mutex::new(c) }
    }

    /// A bucket's window share for the batch about to run (1 ..= 127 slots).
    #[inline]
    pub(crate) fn bucket_slots(&self) -> u32 {
        self.slots.load(Relaxed)
    }

    /// After a batch of `n` keys of a table now of `slots` slots: feeds
    /// the batch's accesses (`key(i)`: key `i`, if it counts) to the
    /// miniatures, the sampled ones in index order, and sets the next
    /// batch's share. The sampling filter runs on the rayon pool for large
    /// batches (the order kept); the miniatures, on this thread under the
    /// mutex. A table that grew since gets miniatures of its size, starting
    /// at the current choice.
    pub(crate) fn observe(&self, slots: u64, n: usize, key: impl Fn(usize) -> Option<u64> + Sync) {
        let rate = sample_rate(slots);
        let pick = |i: usize| key(i).filter(|&k| sampled(k, rate));
        let keys: Vec<u64> = if n >= PARALLEL_FILTER {
            (0..n).into_par_iter().filter_map(pick).collect()
        } else {
            (0..n).filter_map(pick).collect()
        };
        self.observe_sampled(slots, keys);
    }

    /// [`Window::observe`] of a batch whose accesses were sampled already
    /// (`keys`: those `minisim::sampled` at the divisor of `slots`, in
    /// index order; the CUDA backend samples on the device).
    pub(crate) fn observe_sampled(&self, slots: u64, keys: Vec<u64>) {
        let mut c = self.chooser.lock();
        if c.slots() != slots {
            *c = c.resized(slots);
        }
        c.batch_sampled(keys);
        self.slots.store(c.bucket_window(), Relaxed);
    }

    /// The chosen window, in percent of a miniature's capacity.
    #[cfg(test)]
    pub(crate) fn percent(&self) -> u64 {
        self.chooser.lock().window_percent()
    }
}

/// The Adaptive policy's state of one table.
#[derive(Debug)]
pub(crate) struct Adapt {
    /// 16 4-bit counters a word ([`sketch_slot`]).
    sketch: Vec<AtomicU64>,
    lines: u64,
    counted: AtomicU64,
    /// The keys a writer batch evicted with find hits counted in their
    /// scores, and those hits: added to the sketch after the batch.
    folds: Mutex<Vec<(u64, u8)>>,
    /// The window share.
    pub(crate) window: Window,
}

/// Index of the lowest score among `e`'s entries that `pick` accepts
/// (lowest slot on ties: `e` is in slot order).
#[inline]
fn oldest(e: &[(usize, u64)], pick: impl Fn(u64) -> bool) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &(_, sc)) in e.iter().enumerate() {
        if pick(sc) && best.is_none_or(|b| sc < e[b].1) {
            best = Some(i);
        }
    }
    best
}

fn is_window(sc: u64) -> bool {
    sc & ADAPTIVE_MAIN == 0
}

/// The window rule (module docs) for a newcomer to a bucket whose occupied
/// slots and scores are `e` (slot order; used as scratch), window share
/// `win`; `full`: no free slot; `freq(slot)` the sketch's frequency of a
/// slot's key. `mark(slot, score)` gets the new score of each entry that
/// stays but changes (tier moves, demotions), at most one per slot, in the
/// order made; returns, for a full bucket, the slot to empty and its tier
/// (`true`: window).
pub(crate) fn plan(
    e: &mut [(usize, u64)],
    win: u32,
    full: bool,
    freq: impl Fn(usize) -> u8,
    mut mark: impl FnMut(usize, u64),
) -> Option<(usize, bool)> {
    let mut window = e.iter().filter(|x| is_window(x.1)).count() as u32;
    // A free slot: the window keeps under its share for the newcomer; a
    // full bucket: the window at most at its share.
    let bound = if full { win } else { win - 1 };
    while window > bound {
        let i = oldest(e, is_window).expect("window entries");
        e[i].1 |= ADAPTIVE_MAIN;
        mark(e[i].0, e[i].1);
        window -= 1;
    }
    if !full {
        return None;
    }
    let main = e.len() as u32 - window;
    let mut protected = e.iter().filter(|x| x.1 & ADAPTIVE_PROTECTED != 0).count() as u32;
    while protected * 10 > PROTECTED_TENTHS * main {
        let i = oldest(e, |sc| sc & ADAPTIVE_PROTECTED != 0).expect("protected entries");
        e[i].1 &= !ADAPTIVE_PROTECTED;
        mark(e[i].0, e[i].1);
        protected -= 1;
    }
    let (c, v) = (oldest(e, is_window), oldest(e, |sc| !is_window(sc)));
    Some(match (c, v) {
        (Some(c), Some(v)) if window >= win => {
            if freq(e[c].0) > freq(e[v].0).saturating_add(ADMIT_MARGIN) {
                e[c].1 |= ADAPTIVE_MAIN;
                mark(e[c].0, e[c].1);
                (e[v].0, false)
            } else {
                (e[c].0, true)
            }
        }
        (_, Some(v)) => (e[v].0, false),
        (Some(c), None) => (e[c].0, true),
        (None, None) => unreachable!("a full bucket has entries"),
    })
}

impl Adapt {
    /// State for a table of at most `max_buckets` buckets, now of `slots`
    /// slots.
    pub(crate) fn new(max_buckets: u64, slots: u64) -> Adapt {
        let lines = sketch_lines(max_buckets * BUCKET_SLOTS as u64);
        Adapt {
            sketch: (0..lines * 8).map(|_| AtomicU64::new(0)).collect(),
            lines,
            counted: AtomicU64::new(0),
            folds: Mutex::new(Vec::new()),
            window: Window::new(slots),
        }
    }

    /// The sketch's estimate of `key`'s recent accesses (0 ..= 15).
    #[inline]
    pub(crate) fn frequency(&self, key: u64) -> u8 {
        let (w, sh) = sketch_slot(key, self.lines);
        let w = self.sketch[w].load(Relaxed);
        sh.iter().map(|&s| ((w >> s) & 15) as u8).min().unwrap_or(0)
    }

    /// The estimate the window rule compares for a resident `key` of
    /// score `score`: the sketch's count plus the find hits its score
    /// counted (at most 15).
    #[inline]
    pub(crate) fn estimate(&self, key: u64, score: u64) -> u8 {
        (self.frequency(key) + (score & ADAPTIVE_HITS) as u8).min(COUNTER_MAX)
    }

    /// A find hit counted in its entry's score (towards the halving period).
    #[inline]
    pub(crate) fn counted_hit(&self) {
        self.counted.fetch_add(1, Relaxed);
    }

    /// An entry of score `score` evicted by a writer batch: the find hits
    /// its score counted go to the sketch after the batch ([`Adapt::fold`]),
    /// so that a key that comes back is as frequent as its past says.
    #[inline]
    pub(crate) fn evicted(&self, key: u64, score: u64) {
        let hits = (score & ADAPTIVE_HITS) as u8;
        if hits > 0 {
            self.folds.lock().push((key, hits));
        }
    }

    /// After a writer batch (its group still held, before [`Adapt::age`]):
    /// the hits of the entries it evicted, into their keys' counters
    /// (saturating at 15; order-free, as the counts of the batch).
    pub(crate) fn fold(&self) {
        for (key, hits) in std::mem::take(&mut *self.folds.lock()) {
            let (w, sh) = sketch_slot(key, self.lines);
            let _ = self.sketch[w].fetch_update(Relaxed, Relaxed, |w| {
                Some(sh.iter().fold(w, |w, &s| {
                    let c = (w >> s) & 15;
                    (w & !(15 << s)) | (c + u64::from(hits)).min(u64::from(COUNTER_MAX)) << s
                }))
            });
        }
    }

    /// Counts one access of `key`: each of its counters one more,
    /// saturating at 15 (one compare-and-swap of its word; a counter at
    /// 15 is never added to, so nothing carries into its neighbour).
    #[inline]
    pub(crate) fn count(&self, key: u64) {
        let (w, sh) = sketch_slot(key, self.lines);
        let _ = self.sketch[w].fetch_update(Relaxed, Relaxed, |w| {
            let inc = sh.iter().filter(|&&s| (w >> s) & 15 < u64::from(COUNTER_MAX)).fold(0, |a, &s| a | 1 << s);
            (inc != 0).then_some(w + inc)
        });
        self.counted.fetch_add(1, Relaxed);
    }

    /// At a batch's end (its group still held): halves every counter once
    /// the accesses counted since the last halving reach the period of a
    /// table of `slots` slots; returns whether it did (the caller then
    /// halves the hits of every entry's score, [`halve_hits`]).
    #[must_use]
    pub(crate) fn age(&self, slots: u64) -> bool {
        if self.counted.load(Relaxed) < slots * PERIOD_PER_SLOT {
            return false;
        }
        self.counted.store(0, Relaxed);
        for c in &self.sketch {
            c.store((c.load(Relaxed) >> 1) & 0x7777_7777_7777_7777, Relaxed);
        }
        true
    }
}

/// An entry's score with its find hits halved (with the sketch, `Adapt::age`).
#[inline]
pub(crate) fn halve_hits(score: u64) -> u64 {
    (score & !ADAPTIVE_HITS) | ((score & ADAPTIVE_HITS) >> 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sketch counts, saturates at 15 and halves at the period's end.
    #[test]
    fn sketch_counts_saturates_and_ages() {
        let a = Adapt::new(1, 128);
        for _ in 0..20 {
            a.count(7);
        }
        assert_eq!(a.frequency(7), COUNTER_MAX);
        assert_eq!(a.frequency(8), 0);
        for k in 0..(10 * 128) {
            a.count(1_000_000 + k);
        }
        assert!(a.age(128));
        assert_eq!(a.frequency(7), COUNTER_MAX / 2);
    }

    /// A key's counters lie in one word of the sketch, one nibble in each
    /// quarter of it; counting one key leaves its word's other counters.
    #[test]
    fn a_key_counts_in_one_word() {
        for k in 0..1000u64 {
            let (w, sh) = sketch_slot(k, 1 << 10);
            assert!(w < 8 << 10);
            assert!(sh.iter().enumerate().all(|(r, &s)| s % 4 == 0 && s / 16 == r as u32));
        }
        let a = Adapt::new(1, 128);
        let (w, sh) = sketch_slot(7, a.lines);
        for _ in 0..40 {
            a.count(7);
        }
        let word = a.sketch[w].load(Relaxed);
        let mine: u64 = sh.iter().map(|&s| 15 << s).sum();
        assert_eq!(word, mine, "{word:#x}: 15 in the key's four counters, 0 elsewhere");
        assert!(a.age(0));
        assert_eq!(a.sketch[w].load(Relaxed), sh.iter().map(|&s| 7 << s).sum::<u64>());
    }

    /// An evicted entry's find hits go to its key's counters at the batch's
    /// end (saturating at 15); the estimate adds a resident's own hits.
    #[test]
    fn evicted_hits_fold_into_the_sketch() {
        let a = Adapt::new(1, 128);
        a.count(7);
        assert_eq!(a.estimate(7, 3), 4, "sketch 1 + hits 3");
        assert_eq!(a.estimate(7, 15), COUNTER_MAX, "at most 15");
        a.evicted(7, 9);
        a.evicted(8, 0);
        assert_eq!(a.frequency(7), 1, "folded only after the batch");
        a.fold();
        assert_eq!((a.frequency(7), a.frequency(8)), (10, 0));
        a.evicted(7, 12);
        a.fold();
        assert_eq!(a.frequency(7), COUNTER_MAX);
        assert_eq!(halve_hits(M | 0x70 | 15), M | 0x70 | 7);
    }

    const M: u64 = ADAPTIVE_MAIN;
    const P: u64 = ADAPTIVE_PROTECTED;

    /// `plan`'s answer: the slot to empty and its tier.
    type Evict = Option<(usize, bool)>;

    /// `plan`'s score changes and eviction.
    fn run(mut e: Vec<(usize, u64)>, win: u32, full: bool, freq: impl Fn(usize) -> u8) -> (Vec<(usize, u64)>, Evict) {
        let mut marks = Vec::new();
        let evict = plan(&mut e, win, full, freq, |s, sc| marks.push((s, sc)));
        (marks, evict)
    }

    /// Filling: the window keeps under its share for the newcomer, its
    /// oldest entries (lowest slot on ties) moving to the main tier.
    #[test]
    fn filling_keeps_the_window_under_its_share() {
        let e = vec![(0, 5), (1, 3), (2, M | 1), (3, 3)];
        assert_eq!(run(e.clone(), 3, false, |_| 0), (vec![(1, M | 3)], None));
        assert_eq!(run(e.clone(), 4, false, |_| 0), (vec![], None));
        assert_eq!(run(e, 1, false, |_| 0).0, vec![(1, M | 3), (3, M | 3), (0, M | 5)]);
    }

    /// A full bucket: the window shrinks to its share, more than 80 % of
    /// the main tier protected loses its oldest protection, and the
    /// victim is the oldest unprotected main entry.
    #[test]
    fn full_bucket_shrinks_demotes_and_evicts_probation_first() {
        // Window 0, 1 (share 1); main: 2-7 protected (stamps 1-6).
        let e: Vec<(usize, u64)> =
            [(0, 20), (1, 21)].into_iter().chain((2..8).map(|s| (s, M | P | (s as u64 - 1)))).collect();
        let (marks, evict) = run(e.clone(), 1, true, |_| 0);
        // 0 to the main tier (unprotected); main 7, protected 6 > 5.6: the
        // oldest protected (slot 2) is demoted; 5 ≤ 5.6 stops.
        assert_eq!(marks, vec![(0, M | 20), (2, M | 1)]);
        // Window 1 at its share; candidate 1 (frequency 0) against the
        // victim, slot 2 (the oldest unprotected): ties evict the candidate;
        // it must be more than ADMIT_MARGIN more frequent to stay.
        assert_eq!(evict, Some((1, true)));
        let (marks, evict) = run(e.clone(), 1, true, |s| if s == 1 { ADMIT_MARGIN } else { 0 });
        assert_eq!((marks.len(), evict), (2, Some((1, true))), "within the margin: the candidate goes");
        let (marks, evict) = run(e, 1, true, |s| if s == 1 { 1 + ADMIT_MARGIN } else { 0 });
        assert_eq!(marks, vec![(0, M | 20), (2, M | 1), (1, M | 21)], "the candidate wins, unprotected");
        assert_eq!(evict, Some((2, false)));
    }

    /// Under its share the window grows at the main tier's cost; with no
    /// main entries the window's oldest goes.
    #[test]
    fn under_its_share_the_main_tier_pays() {
        let e = vec![(0, 20), (1, M | P | 30), (2, M | 40)];
        assert_eq!(run(e, 2, true, |_| 9).1, Some((2, false)));
        let e = vec![(0, 20), (1, 10)];
        assert_eq!(run(e, 5, true, |_| 0).1, Some((1, true)));
    }

    /// A table's share starts at the largest window below 100 % (85 %);
    /// the miniatures narrow it to 1 % for a frequency-served stream (a hot
    /// set of 3000 keys, each back about 6000 accesses later, under a
    /// scan: a main tier keeps it, a window of 85 % does not), then widen
    /// it again for a stream that only recency serves (each key read twice,
    /// half a capacity apart, never again).
    #[test]
    fn the_share_follows_the_stream() {
        let w = Window::new(4096);
        assert_eq!((w.percent(), w.bucket_slots()), (85, 108));
        let feed = |keys: &[u64]| keys.chunks(64).for_each(|b| w.observe(4096, b.len(), |i| Some(b[i])));
        let hot: Vec<u64> = (0..400_000u64).map(|i| if i % 2 == 0 { (i / 2) % 3000 } else { 1_000_000 + i }).collect();
        feed(&hot);
        assert_eq!(w.percent(), 1, "frequency");
        let recency: Vec<u64> =
            (0..200_000u64).map(|i| if i % 2 == 0 { i / 2 } else { (i / 2).wrapping_sub(1000) } + (1 << 40)).collect();
        feed(&recency);
        assert!(w.percent() > 1, "recency: {} %", w.percent());
    }
}
