//! The lookup pipeline (module docs of [`super`]): overlapped digest,
//! key and value-row fetches for find and contains, and the writers'
//! prefetch of their next buckets.

use super::batch::Rows;
use super::prefetch::{prefetch, prefetch_row};
use super::storage::Storage;
use super::{CpuTable, PIPE, S};

impl CpuTable {
    /// Looks up `keys` with the pipeline described in the module docs and
    /// calls `f(j, Some((bucket, slot)))` or `f(j, None)` for each, in order;
    /// `rows`: also fetch the value rows of the keys found (for `f` to read).
    #[inline]
    pub(super) fn lookup_pipelined(
        &self,
        st: &Storage,
        keys: &[u64],
        rows: bool,
        mut f: impl FnMut(usize, Option<(usize, usize)>),
    ) {
        let p = Pipe { st, keys, dual: self.dual(), rows };
        let ngroups = keys.len().div_ceil(PIPE);
        // Per group in flight (three at a time, by group index mod 3): each
        // key's buckets and digest, and its first digest match.
        let mut loc = [[(0usize, 0usize, 0u8); PIPE]; 3];
        let mut cand = [[usize::MAX; PIPE]; 3];
        // Group g's lookups run while group g + 1's rows and group g + 2's
        // digest lines are on their way.
        for g in 0..ngroups.min(2) {
            p.stage1(g, &mut loc[g % 3]);
        }
        if ngroups > 0 {
            p.stage2(0, &loc[0], &mut cand[0]);
        }
        for g in 0..ngroups {
            if g + 2 < ngroups {
                p.stage1(g + 2, &mut loc[(g + 2) % 3]);
            }
            if g + 1 < ngroups {
                let (l, c) = (&loc[(g + 1) % 3], &mut cand[(g + 1) % 3]);
                p.stage2(g + 1, l, c);
            }
            p.stage3(g, &loc[g % 3], &cand[g % 3], &mut f);
        }
    }

    /// [`Shard::find_at`](crate::Shard::find_at) into `rows`: batches of up to `grain` keys on
    /// this thread, larger ones halved on the rayon pool (as `at`
    /// increases, the two halves write disjoint row ranges).
    pub(super) fn find_rows(&self, st: &Storage, keys: &[u64], at: &[u32], rows: Rows<'_>, grain: usize) -> u64 {
        if keys.len() > grain {
            let mid = keys.len() / 2;
            let (lo, hi) = rows.split(at[mid] as usize, st.dim);
            let (a, b) = rayon::join(
                || self.find_rows(st, &keys[..mid], &at[..mid], lo, grain),
                || self.find_rows(st, &keys[mid..], &at[mid..], hi, grain),
            );
            return a + b;
        }
        let (dim, Rows { base, values, found }) = (st.dim, rows);
        let refresh = self.config.refreshes_reads().then(|| self.scorer());
        let mut hits = 0;
        self.lookup_pipelined(st, keys, true, |j, hit| {
            // The answer row a group ahead: its lines arrive before they
            // are written, instead of each store waiting for its line.
            if let Some(&r) = at.get(j + PIPE) {
                let r = r as usize - base;
                prefetch_row(&values[r * dim..(r + 1) * dim]);
            }
            let r = at[j] as usize - base;
            let row = &mut values[r * dim..(r + 1) * dim];
            if let Some((b, s)) = hit {
                st.read_row(b, s, row);
                found[r] = 1;
                hits += 1;
                if let Some(sc) = &refresh {
                    self.refresh_read(st, b, s, sc);
                }
            } else {
                row.fill(0.0);
                found[r] = 0;
            }
        });
        hits
    }

    /// Prefetches what a writer reads first in the buckets of its next keys
    /// (both halves of the digest line, and the line of the occupancy bits
    /// and mutex), so that their misses overlap.
    #[inline]
    pub(super) fn touch(&self, st: &Storage, keys: &[u64]) {
        for &k in keys {
            let (b1, _) = st.div.locate(k);
            let bk = &st.buckets[b1 as usize];
            prefetch(&bk.digests[0]);
            prefetch(&bk.digests[S / 16]);
            prefetch(&bk.occupied[0]);
        }
    }

    /// Prefetches, for each of an inserter's next `keys` whose buckets
    /// [`CpuTable::touch`] fetched a group earlier, the slot a new key
    /// would take (the bucket's first free one, single-bucket mode): its
    /// value row and its key and score lines. Without it, each insert
    /// into memory not in cache stores its row under the bucket's mutex
    /// and the unlock waits for those lines, one key after another (about
    /// half of an insert's time in a cold fill through hkvd,
    /// `backing/BENCHMARKS.md`). A guess: a key already present, a full
    /// bucket or a slot taken meanwhile costs a few useless prefetches.
    #[inline]
    pub(super) fn touch_rows(&self, st: &Storage, keys: &[u64]) {
        if self.dual() {
            // The target is the less loaded of two buckets, and the second
            // one's lines were not fetched: no cheap guess.
            return;
        }
        for &k in keys {
            let (b, _) = st.div.locate(k);
            let (b, bk) = (b as usize, &st.buckets[b as usize]);
            if let Some(s) = bk.free_slot() {
                prefetch_row(st.row(b, s));
                prefetch(&bk.keys[s]);
                prefetch(&bk.scores[s]);
            }
        }
    }
}

/// Where a key may sit: first bucket, second bucket (the first in single
/// mode) and digest.
type Loc = (usize, usize, u8);

/// One call of the lookup pipeline: the keys, split in groups of [`PIPE`].
struct Pipe<'a> {
    st: &'a Storage,
    keys: &'a [u64],
    dual: bool,
    /// Also fetch the value rows of candidate slots.
    rows: bool,
}

impl Pipe<'_> {
    #[inline(always)]
    fn group(&self, g: usize) -> &[u64] {
        &self.keys[g * PIPE..((g + 1) * PIPE).min(self.keys.len())]
    }

    /// Stage 1 of group g: every key's buckets, then every digest line
    /// (both 64-byte halves) prefetched, back to back.
    #[inline(always)]
    fn stage1(&self, g: usize, loc: &mut [Loc; PIPE]) {
        let st = self.st;
        for (i, &k) in self.group(g).iter().enumerate() {
            let (b1, d) = st.div.locate(k);
            let b2 = if self.dual { st.div.bucket2(k, b1) as usize } else { b1 as usize };
            loc[i] = (b1 as usize, b2, d);
        }
        for &(b1, b2, _) in &loc[..self.group(g).len()] {
            let bk = &st.buckets[b1];
            prefetch(&bk.digests[0]);
            prefetch(&bk.digests[S / 16]);
            if self.dual {
                let bk = &st.buckets[b2];
                prefetch(&bk.digests[0]);
                prefetch(&bk.digests[S / 16]);
            }
        }
    }

    /// Stage 2 of group g: each key's first digest match (its digest lines
    /// were prefetched a group earlier), then the candidates' keys and value
    /// rows (every 64-byte line) prefetched, back to back.
    #[inline(always)]
    fn stage2(&self, g: usize, loc: &[Loc; PIPE], cand: &mut [usize; PIPE]) {
        let (st, n) = (self.st, self.group(g).len());
        for (i, &(b1, _, d)) in loc[..n].iter().enumerate() {
            cand[i] = st.buckets[b1].scan(d, Some).unwrap_or(usize::MAX);
        }
        for (i, &(b1, _, _)) in loc[..n].iter().enumerate() {
            let s = cand[i];
            if s != usize::MAX {
                prefetch(&st.buckets[b1].keys[s]);
                if self.rows {
                    prefetch_row(st.row(b1, s));
                }
            }
        }
    }

    /// Stage 3 of group g: the lookups proper, on lines already fetched;
    /// the candidate is checked first (a hit needs no second scan).
    #[inline(always)]
    fn stage3(
        &self,
        g: usize,
        loc: &[Loc; PIPE],
        cand: &[usize; PIPE],
        f: &mut impl FnMut(usize, Option<(usize, usize)>),
    ) {
        let st = self.st;
        for (i, &k) in self.group(g).iter().enumerate() {
            let (b1, b2, d) = loc[i];
            let c = cand[i];
            let hit = if c != usize::MAX && st.buckets[b1].key(c) == k {
                Some((b1, c))
            } else {
                match st.buckets[b1].find(k, d) {
                    Some(s) => Some((b1, s)),
                    None if b2 != b1 => st.buckets[b2].find(k, d).map(|s| (b2, s)),
                    None => None,
                }
            };
            f(g * PIPE + i, hit);
        }
    }
}
