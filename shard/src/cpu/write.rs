//! The write path of one key: bucket locks, placement, eviction and
//! admission (paper Algorithms 2 and 3), and the relocation of a restore.

use super::adapt::plan;
use super::batch::Scoring;
use super::storage::Storage;
use super::{CpuTable, S};
use crate::score::Scorer;
use crate::{Evictions, Lost, Outcome};

impl CpuTable {
    /// Runs `f` on a present key's slot with its candidate buckets locked.
    #[inline]
    pub(super) fn with_entry_mut<R>(&self, st: &Storage, key: u64, f: impl FnOnce(usize, usize) -> R) -> Option<R> {
        let (b1, b2, _) = self.buckets_of(st, key);
        let _w = Self::lock_pair(st, b1, b2);
        self.locate_entry(st, key).map(|(b, s)| f(b, s))
    }

    /// Locks one or two buckets, lower index first so that parallel tasks
    /// never deadlock.
    #[inline]
    pub(super) fn lock_pair(
        st: &Storage,
        b1: usize,
        b2: usize,
    ) -> (parking_lot::MutexGuard<'_, ()>, Option<parking_lot::MutexGuard<'_, ()>>) {
        if b1 == b2 {
            (st.buckets[b1].writer.lock(), None)
        } else {
            let (lo, hi) = (b1.min(b2), b1.max(b2));
            let g = st.buckets[lo].writer.lock();
            (g, Some(st.buckets[hi].writer.lock()))
        }
    }

    /// The write path of one key (paper Algorithms 2 and 3) with its
    /// candidate buckets locked. `on_present(bucket, slot)` handles a present
    /// key; otherwise `value` is inserted with a score from `input`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn upsert(
        &self,
        st: &Storage,
        key: u64,
        value: &[f32],
        input: Option<u64>,
        scoring: Scoring,
        scorer: &Scorer,
        lost: Option<&mut Evictions>,
        on_present: impl FnOnce(usize, usize),
    ) -> Outcome {
        let (b1, b2, d) = self.buckets_of(st, key);
        // Adaptive, policy scores (the batch counted its keys in the sketch).
        let adapt = self.adapt.as_ref().filter(|_| matches!(scoring, Scoring::Policy));
        let _w = Self::lock_pair(st, b1, b2);
        if let Some((b, s)) = self.locate_entry(st, key) {
            on_present(b, s);
            return Outcome::Updated;
        }
        let (score, admission) = match scoring {
            Scoring::Verbatim => {
                let s = input.unwrap_or(0);
                (s, s)
            }
            Scoring::Policy => {
                let s = scorer.on_insert(input);
                (s, scorer.admission(s))
            }
        };
        // Phase D1 / Algorithm 2 line 8: a free slot in the less loaded bucket.
        let target = if b2 != b1 && st.buckets[b2].len() < st.buckets[b1].len() { b2 } else { b1 };
        if let Some(s) = st.buckets[target].free_slot() {
            if let Some(a) = adapt {
                // Filling: keep the window under its share (see `adapt`).
                let bk = &st.buckets[target];
                let mut e = [(0, 0); S];
                let mut n = 0;
                for s in bk.slots() {
                    e[n] = (s, bk.score(s));
                    n += 1;
                }
                plan(&mut e[..n], a.window.bucket_slots(), false, |_| 0, |s, sc| bk.set_score(s, sc));
            }
            st.buckets[target].put_meta(s, key, d, score);
            st.write_row(target, s, value);
            return Outcome::Inserted;
        }
        // A restore (verbatim scores) in dual mode first makes room by moving
        // one resident of a full candidate to its other bucket, so that a
        // table restored onto its own capacity is not cut by the order in
        // which entries arrive (issue 24: 0.25 % lost at 95 % load).
        if matches!(scoring, Scoring::Verbatim) && b2 != b1 {
            if let Some((b, s)) = self.relocate_one(st, b1, b2) {
                st.buckets[b].put_meta(s, key, d, score);
                st.write_row(b, s, value);
                return Outcome::Inserted;
            }
        }
        // Phase D2 / Algorithm 2 line 13: the lower minimum of the candidates.
        let (mut b, (mut s, mut min)) = (b1, st.buckets[b1].min_slot());
        if b2 != b1 {
            let (s2, m2) = st.buckets[b2].min_slot();
            if m2 < min {
                (b, s, min) = (b2, s2, m2);
            }
        }
        if let Some(a) = adapt {
            // The bucket with the older minimum, then its window rule.
            let bk = &st.buckets[b];
            let mut e: [(usize, u64); S] = std::array::from_fn(|s| (s, bk.score(s)));
            let win = a.window.bucket_slots();
            let evict = plan(&mut e, win, true, |s| a.estimate(bk.key(s), bk.score(s)), |s, sc| bk.set_score(s, sc));
            (s, _) = evict.expect("a full bucket evicts");
            min = 0;
        }
        if admission < min {
            if let Some(lost) = lost {
                lost.keys.push(key);
                lost.values.extend_from_slice(value);
                lost.scores.push(score);
                lost.kinds.push(Lost::Rejected);
            }
            return Outcome::Rejected;
        }
        let bk = &st.buckets[b];
        if let Some(lost) = lost {
            lost.keys.push(bk.key(s));
            st.push_row(b, s, &mut lost.values);
            lost.scores.push(bk.score(s));
            lost.kinds.push(Lost::Evicted);
        }
        if let Some(a) = adapt {
            a.evicted(bk.key(s), bk.score(s));
        }
        bk.put_meta(s, key, d, score);
        st.write_row(b, s, value);
        Outcome::Evicted
    }

    /// Dual mode, both candidates `b1`, `b2` full (and locked): frees a slot
    /// in one of them (b1 first) by moving a resident to its other bucket,
    /// or a resident of that bucket on to its own other bucket (two steps
    /// at most); returns the slot freed.
    pub(super) fn relocate_one(&self, st: &Storage, b1: usize, b2: usize) -> Option<(usize, usize)> {
        [b1, b2].into_iter().find_map(|b| self.make_room(st, b, 2, &mut vec![b1, b2]).map(|s| (b, s)))
    }

    /// Frees a slot of the full, locked bucket `b`: the first resident
    /// (lowest slot first) whose other bucket has room, else (with `depth`
    /// left) for which that bucket can make room the same way. Buckets in
    /// `path` are not used. Other buckets are only try-locked, so two
    /// writers never wait on each other.
    pub(super) fn make_room(&self, st: &Storage, b: usize, depth: u32, path: &mut Vec<usize>) -> Option<usize> {
        let bk = &st.buckets[b];
        for pass in 0..depth {
            let mut occ = bk.occupied();
            while occ != 0 {
                let s = occ.trailing_zeros() as usize;
                occ &= occ - 1;
                let k = bk.key(s);
                let (c1, c2, dk) = self.buckets_of(st, k);
                let alt = if c1 == b { c2 } else { c1 };
                if path.contains(&alt) {
                    continue;
                }
                let Some(_g) = st.buckets[alt].writer.try_lock() else { continue };
                let free = if pass == 0 {
                    st.buckets[alt].free_slot()
                } else {
                    path.push(alt);
                    let t = self.make_room(st, alt, 1, path);
                    path.pop();
                    t
                };
                if let Some(t) = free {
                    let mut row = vec![0.0; self.config.dim];
                    st.read_row(b, s, &mut row);
                    st.buckets[alt].put_meta(t, k, dk, bk.score(s));
                    st.write_row(alt, t, &row);
                    bk.remove(s);
                    return Some(s);
                }
            }
        }
        None
    }
}
