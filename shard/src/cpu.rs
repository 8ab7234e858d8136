//! The CPU backend: the table in host memory, batches spread over all cores.
//!
//! Each bucket sits behind its own `RwLock`, so the keys of one batch can be
//! processed in parallel; the table-wide [`GroupLock`] on top gives the
//! reader / updater / inserter semantics between batches. The bucket array
//! itself sits behind one more `RwLock` that only growth takes for writing
//! (under the inserter group, so no batch is running then).

use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::{BucketMode, ScorePolicy, TableConfig};
use crate::error::{Error, Result};
use crate::hash::{bucket1, bucket2, digest};
use crate::lock::{Group, GroupLock};
use crate::score::{Clock, Scorer, SystemClock};
use crate::{
    is_reserved, Evictions, Export, Filter, Lost, Op, Outcome, Shard, ShardStats, Summary, BUCKET_SLOTS, EMPTY_KEY,
    SEQUENTIAL_BATCH,
};

const S: usize = BUCKET_SLOTS;
/// Keys per parallel task once a batch is split.
const GRAIN: usize = 2048;

/// The 128 digests of a bucket: one 128-byte line.
#[repr(C, align(128))]
struct Digests([u8; S]);

/// One bucket: the paper's layout (digest line, keys, scores) plus the
/// bucket's values and an occupancy bitmap (the CPU's way to find a free
/// slot without scanning keys).
struct Bucket {
    digests: Digests,
    keys: [u64; S],
    scores: [u64; S],
    occupied: u128,
    /// `S * dim` floats; slot `s` owns `values[s * dim..(s + 1) * dim]`.
    values: Box<[f32]>,
}

const LO7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const ONES: u64 = 0x0101_0101_0101_0101;

impl Bucket {
    fn new(dim: usize) -> Bucket {
        Bucket {
            digests: Digests([digest(EMPTY_KEY); S]),
            keys: [EMPTY_KEY; S],
            scores: [0; S],
            occupied: 0,
            values: vec![0.0; S * dim].into_boxed_slice(),
        }
    }

    #[inline]
    fn len(&self) -> u32 {
        self.occupied.count_ones()
    }

    /// The slot holding `key`: compares 8 digests per step (SWAR) and reads a
    /// key only where its digest matches. Free slots hold `EMPTY_KEY`, which
    /// no input key equals, so they never match.
    #[inline]
    fn find(&self, key: u64, d: u8) -> Option<usize> {
        let pattern = ONES.wrapping_mul(d as u64);
        for (w, chunk) in self.digests.0.chunks_exact(8).enumerate() {
            let x = u64::from_le_bytes(chunk.try_into().expect("chunks of 8")) ^ pattern;
            // Exact zero-byte mask: bit 7 of each byte that is zero in x.
            let mut m = !(((x & LO7).wrapping_add(LO7)) | x | LO7);
            while m != 0 {
                let slot = w * 8 + (m.trailing_zeros() / 8) as usize;
                if self.keys[slot] == key {
                    return Some(slot);
                }
                m &= m - 1;
            }
        }
        None
    }

    #[inline]
    fn free_slot(&self) -> Option<usize> {
        let free = !self.occupied;
        (free != 0).then(|| free.trailing_zeros() as usize)
    }

    /// The minimum-score slot of a full bucket (lowest slot on ties).
    #[inline]
    fn min_slot(&self) -> (usize, u64) {
        let mut best = (0, self.scores[0]);
        for (s, &sc) in self.scores.iter().enumerate().skip(1) {
            if sc < best.1 {
                best = (s, sc);
            }
        }
        best
    }

    #[inline]
    fn value(&self, slot: usize, dim: usize) -> &[f32] {
        &self.values[slot * dim..(slot + 1) * dim]
    }

    #[inline]
    fn value_mut(&mut self, slot: usize, dim: usize) -> &mut [f32] {
        &mut self.values[slot * dim..(slot + 1) * dim]
    }

    #[inline]
    fn put(&mut self, slot: usize, key: u64, d: u8, score: u64, value: &[f32]) {
        self.keys[slot] = key;
        self.digests.0[slot] = d;
        self.scores[slot] = score;
        self.occupied |= 1u128 << slot;
        let dim = value.len();
        self.value_mut(slot, dim).copy_from_slice(value);
    }

    #[inline]
    fn remove(&mut self, slot: usize) {
        self.keys[slot] = EMPTY_KEY;
        self.digests.0[slot] = digest(EMPTY_KEY);
        self.scores[slot] = 0;
        self.occupied &= !(1u128 << slot);
    }

    fn clear(&mut self) {
        let mut occ = self.occupied;
        while occ != 0 {
            let s = occ.trailing_zeros() as usize;
            self.remove(s);
            occ &= occ - 1;
        }
    }
}

struct Storage {
    buckets: Vec<RwLock<Bucket>>,
    nbuckets: u64,
}

impl Storage {
    fn new(nbuckets: u64, dim: usize) -> Storage {
        Storage { buckets: (0..nbuckets).map(|_| RwLock::new(Bucket::new(dim))).collect(), nbuckets }
    }
}

/// Everything a parallel batch accumulates.
#[derive(Default)]
struct Acc {
    summary: Summary,
    hits: u64,
    lost: Evictions,
    /// Indices of keys absent in accum_or_assign's first phase.
    absent: Vec<usize>,
    /// (index, outcome) of keys placed in accum_or_assign's second phase.
    placed: Vec<(usize, Outcome)>,
}

impl Acc {
    fn merge(mut self, o: Acc) -> Acc {
        self.summary = self.summary.merge(o.summary);
        self.hits += o.hits;
        self.lost.append(o.lost);
        let (mut absent, mut placed) = (o.absent, o.placed);
        self.absent.append(&mut absent);
        self.placed.append(&mut placed);
        self
    }
}

/// The caller's output arrays for one batch, split along with the keys.
#[derive(Default)]
struct Outs<'a> {
    values: Option<&'a mut [f32]>,
    found: Option<&'a mut [bool]>,
    scores: Option<&'a mut [u64]>,
    outcomes: Option<&'a mut [Outcome]>,
}

#[allow(clippy::type_complexity)]
fn split_opt<T>(x: Option<&mut [T]>, at: usize) -> (Option<&mut [T]>, Option<&mut [T]>) {
    match x {
        Some(s) => {
            let (a, b) = s.split_at_mut(at);
            (Some(a), Some(b))
        }
        None => (None, None),
    }
}

impl<'a> Outs<'a> {
    fn split(self, mid: usize, dim: usize) -> (Outs<'a>, Outs<'a>) {
        let (v0, v1) = split_opt(self.values, mid * dim);
        let (f0, f1) = split_opt(self.found, mid);
        let (s0, s1) = split_opt(self.scores, mid);
        let (o0, o1) = split_opt(self.outcomes, mid);
        (
            Outs { values: v0, found: f0, scores: s0, outcomes: o0 },
            Outs { values: v1, found: f1, scores: s1, outcomes: o1 },
        )
    }

    #[inline]
    fn outcome(&mut self, j: usize, o: Outcome) {
        if let Some(out) = self.outcomes.as_deref_mut() {
            out[j] = o;
        }
    }

    #[inline]
    fn found(&mut self, j: usize, f: bool) {
        if let Some(out) = self.found.as_deref_mut() {
            out[j] = f;
        }
    }
}

/// Runs `f` over `0..n`: in index order for small batches, else split in
/// halves down to [`GRAIN`] keys and run on the rayon pool.
fn run_batch<F>(n: usize, outs: Outs<'_>, dim: usize, f: &F) -> Acc
where
    F: Fn(Range<usize>, Outs<'_>) -> Acc + Sync,
{
    fn split<F>(r: Range<usize>, outs: Outs<'_>, dim: usize, f: &F) -> Acc
    where
        F: Fn(Range<usize>, Outs<'_>) -> Acc + Sync,
    {
        if r.len() <= GRAIN {
            return f(r, outs);
        }
        let mid = r.len() / 2;
        let (lo, hi) = outs.split(mid, dim);
        let (a, b) =
            rayon::join(|| split(r.start..r.start + mid, lo, dim, f), || split(r.start + mid..r.end, hi, dim, f));
        a.merge(b)
    }
    if n <= SEQUENTIAL_BATCH {
        f(0..n, outs)
    } else {
        split(0..n, outs, dim, f)
    }
}

/// How the score of a written key is decided.
#[derive(Clone, Copy)]
enum Scoring {
    /// The policy's insert-like rules.
    Policy,
    /// Scores verbatim (load / restore).
    Verbatim,
}

#[derive(Default)]
struct Counters {
    ops: [AtomicU64; Op::ALL.len()],
    keys: [AtomicU64; Op::ALL.len()],
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    evictions: AtomicU64,
    rejections: AtomicU64,
}

impl Counters {
    fn op(&self, op: Op, n: usize) {
        let i = Op::ALL.iter().position(|&o| o == op).expect("op listed");
        self.ops[i].fetch_add(1, Ordering::Relaxed);
        self.keys[i].fetch_add(n as u64, Ordering::Relaxed);
    }

    fn summary(&self, s: &Summary) {
        self.inserts.fetch_add(s.inserted, Ordering::Relaxed);
        self.evictions.fetch_add(s.evicted, Ordering::Relaxed);
        self.rejections.fetch_add(s.rejected, Ordering::Relaxed);
    }

    fn lookups(&self, hits: u64, n: usize) {
        self.hits.fetch_add(hits, Ordering::Relaxed);
        self.misses.fetch_add(n as u64 - hits, Ordering::Relaxed);
    }
}

/// The table in host memory. See the crate docs for the semantics.
pub struct CpuTable {
    config: TableConfig,
    storage: RwLock<Storage>,
    lock: GroupLock,
    size: AtomicU64,
    epoch: AtomicU32,
    clock: Arc<dyn Clock>,
    counters: Counters,
}

impl std::fmt::Debug for CpuTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTable")
            .field("config", &self.config)
            .field("capacity", &self.capacity())
            .field("size", &self.size())
            .finish()
    }
}

fn check_len(what: &'static str, got: usize, expected: usize, detail: impl FnOnce() -> String) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Length { what, expected, got, detail: detail() })
    }
}

fn check_keys(keys: &[u64]) -> Result<()> {
    match keys.iter().position(|&k| is_reserved(k)) {
        Some(index) => Err(Error::ReservedKey { key: keys[index], index }),
        None => Ok(()),
    }
}

impl CpuTable {
    /// A table on the system clock.
    pub fn new(config: TableConfig) -> Result<CpuTable> {
        Self::with_clock(config, Arc::new(SystemClock::default()))
    }

    /// A table reading Lru / EpochLru time from `clock`.
    pub fn with_clock(config: TableConfig, clock: Arc<dyn Clock>) -> Result<CpuTable> {
        config.validate()?;
        let storage = Storage::new(config.buckets(), config.dim);
        Ok(CpuTable {
            config,
            storage: RwLock::new(storage),
            lock: GroupLock::new(),
            size: AtomicU64::new(0),
            epoch: AtomicU32::new(0),
            clock,
            counters: Counters::default(),
        })
    }

    /// The current lock-group state.
    pub fn lock_state(&self) -> crate::LockState {
        self.lock.state()
    }

    fn dual(&self) -> bool {
        self.config.mode == BucketMode::Dual
    }

    fn scorer(&self) -> Scorer {
        Scorer { policy: self.config.policy, now_ns: self.clock.now_ns(), epoch: self.epoch.load(Ordering::Relaxed) }
    }

    fn check_values(&self, what: &'static str, n: usize, got: usize) -> Result<()> {
        let dim = self.config.dim;
        check_len(what, got, n * dim, || format!("{n} keys x dim {dim}"))
    }

    /// Scores must fit the batch and the policy. `needed`: the op inserts, so
    /// Custom needs them.
    fn check_scores(&self, scores: Option<&[u64]>, n: usize, needed: bool) -> Result<()> {
        let policy = self.config.policy;
        match scores {
            Some(s) => {
                check_len("scores", s.len(), n, || format!("{n} keys"))?;
                if !policy.takes_scores() {
                    return Err(Error::ScoresNotAccepted { policy });
                }
            }
            None if needed && policy == ScorePolicy::Custom => return Err(Error::ScoresRequired { policy }),
            None => {}
        }
        Ok(())
    }

    fn check_outcomes(outcomes: &Option<&mut [Outcome]>, n: usize) -> Result<()> {
        match outcomes {
            Some(o) => check_len("outcomes", o.len(), n, || format!("{n} keys")),
            None => Ok(()),
        }
    }

    /// Reads the slot of a present key under read locks.
    #[inline]
    fn with_entry<R>(&self, st: &Storage, key: u64, f: impl FnOnce(&Bucket, usize) -> R) -> Option<R> {
        let d = digest(key);
        let b1 = bucket1(key, st.nbuckets) as usize;
        {
            let g = st.buckets[b1].read();
            if let Some(s) = g.find(key, d) {
                return Some(f(&g, s));
            }
        }
        if self.dual() {
            let b2 = bucket2(key, st.nbuckets) as usize;
            let g = st.buckets[b2].read();
            if let Some(s) = g.find(key, d) {
                return Some(f(&g, s));
            }
        }
        None
    }

    /// Writes the slot of a present key under write locks.
    #[inline]
    fn with_entry_mut<R>(&self, st: &Storage, key: u64, f: impl FnOnce(&mut Bucket, usize) -> R) -> Option<R> {
        let d = digest(key);
        let b1 = bucket1(key, st.nbuckets) as usize;
        {
            let mut g = st.buckets[b1].write();
            if let Some(s) = g.find(key, d) {
                return Some(f(&mut g, s));
            }
        }
        if self.dual() {
            let b2 = bucket2(key, st.nbuckets) as usize;
            let mut g = st.buckets[b2].write();
            if let Some(s) = g.find(key, d) {
                return Some(f(&mut g, s));
            }
        }
        None
    }

    /// The write path of one key (Algorithms 2 and 3) with its candidate
    /// buckets write-locked (lower index first, so parallel tasks never
    /// deadlock). `on_present` handles a present key; otherwise `value` is
    /// inserted with a score from `input`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn upsert(
        &self,
        st: &Storage,
        key: u64,
        value: &[f32],
        input: Option<u64>,
        scoring: Scoring,
        scorer: &Scorer,
        lost: Option<&mut Evictions>,
        on_present: impl FnOnce(&mut Bucket, usize),
    ) -> Outcome {
        let b1 = bucket1(key, st.nbuckets) as usize;
        if !self.dual() || st.nbuckets == 1 {
            let mut g = st.buckets[b1].write();
            return self.upsert_in(&mut [&mut g], key, value, input, scoring, scorer, lost, on_present);
        }
        let b2 = bucket2(key, st.nbuckets) as usize;
        let (mut g1, mut g2) = if b1 < b2 {
            let g1 = st.buckets[b1].write();
            (g1, st.buckets[b2].write())
        } else {
            let g2 = st.buckets[b2].write();
            (st.buckets[b1].write(), g2)
        };
        self.upsert_in(&mut [&mut g1, &mut g2], key, value, input, scoring, scorer, lost, on_present)
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn upsert_in(
        &self,
        bks: &mut [&mut Bucket],
        key: u64,
        value: &[f32],
        input: Option<u64>,
        scoring: Scoring,
        scorer: &Scorer,
        lost: Option<&mut Evictions>,
        on_present: impl FnOnce(&mut Bucket, usize),
    ) -> Outcome {
        let d = digest(key);
        for bk in bks.iter_mut() {
            if let Some(s) = bk.find(key, d) {
                on_present(bk, s);
                return Outcome::Updated;
            }
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
        let target = if bks.len() == 1 {
            0
        } else if bks[1].len() < bks[0].len() {
            1
        } else {
            0
        };
        if let Some(slot) = bks[target].free_slot() {
            bks[target].put(slot, key, d, score, value);
            return Outcome::Inserted;
        }
        // Phase D2 / Algorithm 2 line 13: the lower minimum of the candidates.
        let (mut w, (mut slot, mut min)) = (0, bks[0].min_slot());
        if bks.len() == 2 {
            let (s2, m2) = bks[1].min_slot();
            if m2 < min {
                (w, slot, min) = (1, s2, m2);
            }
        }
        let dim = value.len();
        if admission < min {
            if let Some(lost) = lost {
                lost.keys.push(key);
                lost.values.extend_from_slice(value);
                lost.scores.push(score);
                lost.kinds.push(Lost::Rejected);
            }
            return Outcome::Rejected;
        }
        let bk = &mut bks[w];
        if let Some(lost) = lost {
            lost.keys.push(bk.keys[slot]);
            lost.values.extend_from_slice(bk.value(slot, dim));
            lost.scores.push(bk.scores[slot]);
            lost.kinds.push(Lost::Evicted);
        }
        bk.put(slot, key, d, score, value);
        Outcome::Evicted
    }

    /// Doubles the buckets while `incoming` more keys would pass the max load
    /// factor and the max capacity allows. Caller holds the inserter group.
    fn grow_for(&self, incoming: usize) {
        let max_buckets = self.config.max_buckets();
        loop {
            let nb = self.storage.read().nbuckets;
            let cap = (nb * S as u64) as f64;
            let want = (self.size.load(Ordering::Relaxed) + incoming as u64) as f64;
            if want <= self.config.max_load_factor * cap || nb * 2 > max_buckets {
                return;
            }
            self.rehash(nb * 2);
        }
    }

    /// Rebuilds the table with `nbuckets` buckets: entries are re-inserted in
    /// descending score order (key order on ties), so that if two-choice
    /// placement ever overflows, the lowest scores are the ones that go. In
    /// single mode doubling never overflows: bucket b's entries move to b or
    /// b + old_buckets only.
    fn rehash(&self, nbuckets: u64) {
        let mut st = self.storage.write();
        let dim = self.config.dim;
        let mut entries: Vec<(u64, u64, usize, usize)> = Vec::with_capacity(self.size.load(Ordering::Relaxed) as usize);
        for (b, lock) in st.buckets.iter_mut().enumerate() {
            let bk = lock.get_mut();
            let mut occ = bk.occupied;
            while occ != 0 {
                let s = occ.trailing_zeros() as usize;
                entries.push((bk.scores[s], bk.keys[s], b, s));
                occ &= occ - 1;
            }
        }
        entries.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let new = Storage::new(nbuckets, dim);
        let scorer = self.scorer();
        let mut summary = Summary::default();
        for &(score, key, b, s) in &entries {
            let old = st.buckets[b].get_mut();
            let o = self.upsert(&new, key, old.value(s, dim), Some(score), Scoring::Verbatim, &scorer, None, |_, _| {});
            summary.add(o);
        }
        // A two-choice overflow loses entries (an eviction swaps one for
        // another, a rejection drops the newcomer): size is what was placed.
        self.size.store(summary.inserted, Ordering::Relaxed);
        self.counters.evictions.fetch_add(summary.evicted + summary.rejected, Ordering::Relaxed);
        *st = new;
    }

    fn finish_insert(&self, acc: &Acc) {
        self.size.fetch_add(acc.summary.inserted, Ordering::Relaxed);
        self.counters.summary(&acc.summary);
    }

    /// The shared body of insert_or_assign, insert_and_evict and load.
    #[allow(clippy::too_many_arguments)]
    fn upsert_batch(
        &self,
        op: Op,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        scoring: Scoring,
        outcomes: Option<&mut [Outcome]>,
        keep_lost: bool,
    ) -> Result<Acc> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_values("values", n, values.len())?;
        Self::check_outcomes(&outcomes, n)?;
        if let Scoring::Policy = scoring {
            self.check_scores(scores, n, true)?;
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(op, n);
        self.grow_for(n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let dim = self.config.dim;
        let acc = run_batch(n, Outs { outcomes, ..Outs::default() }, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let mut lost = keep_lost.then(Evictions::default);
            for (j, i) in r.clone().enumerate() {
                let input = scores.map(|s| s[i]);
                let v = &values[i * dim..(i + 1) * dim];
                let o = self.upsert(&st, keys[i], v, input, scoring, &scorer, lost.as_mut(), |bk, s| {
                    bk.value_mut(s, dim).copy_from_slice(v);
                    bk.scores[s] = match scoring {
                        Scoring::Verbatim => input.unwrap_or(0),
                        Scoring::Policy => scorer.on_upsert(bk.scores[s], input),
                    };
                });
                acc.summary.add(o);
                outs.outcome(j, o);
            }
            acc.lost = lost.unwrap_or_default();
            acc
        });
        self.finish_insert(&acc);
        Ok(acc)
    }
}

impl Shard for CpuTable {
    fn config(&self) -> &TableConfig {
        &self.config
    }

    fn capacity(&self) -> u64 {
        self.storage.read().nbuckets * S as u64
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    fn set_global_epoch(&self, epoch: u32) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    fn find(&self, keys: &[u64], values: &mut [f32], found: &mut [bool], scores: Option<&mut [u64]>) -> Result<usize> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_values("values", n, values.len())?;
        check_len("found", found.len(), n, || format!("{n} keys"))?;
        if let Some(s) = &scores {
            check_len("scores", s.len(), n, || format!("{n} keys"))?;
        }
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Find, n);
        let st = self.storage.read();
        let dim = self.config.dim;
        let outs = Outs { values: Some(values), found: Some(found), scores, outcomes: None };
        let acc = run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.enumerate() {
                let hit = self.with_entry(&st, keys[i], |bk, s| {
                    if let Some(v) = outs.values.as_deref_mut() {
                        v[j * dim..(j + 1) * dim].copy_from_slice(bk.value(s, dim));
                    }
                    if let Some(sc) = outs.scores.as_deref_mut() {
                        sc[j] = bk.scores[s];
                    }
                });
                outs.found(j, hit.is_some());
                acc.hits += hit.is_some() as u64;
            }
            acc
        });
        self.counters.lookups(acc.hits, n);
        Ok(acc.hits as usize)
    }

    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize> {
        let n = keys.len();
        check_keys(keys)?;
        check_len("found", found.len(), n, || format!("{n} keys"))?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Contains, n);
        let st = self.storage.read();
        let outs = Outs { found: Some(found), ..Outs::default() };
        let acc = run_batch(n, outs, self.config.dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.enumerate() {
                let hit = self.with_entry(&st, keys[i], |_, _| ()).is_some();
                outs.found(j, hit);
                acc.hits += hit as u64;
            }
            acc
        });
        self.counters.lookups(acc.hits, n);
        Ok(acc.hits as usize)
    }

    fn insert_or_assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let acc = self.upsert_batch(Op::InsertOrAssign, keys, values, scores, Scoring::Policy, outcomes, false)?;
        Ok(acc.summary)
    }

    fn insert_and_evict(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Evictions> {
        let acc = self.upsert_batch(Op::InsertAndEvict, keys, values, scores, Scoring::Policy, outcomes, true)?;
        Ok(acc.lost)
    }

    fn load(&self, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary> {
        let n = keys.len();
        check_len("scores", scores.len(), n, || format!("{n} keys"))?;
        let acc = self.upsert_batch(Op::Load, keys, values, Some(scores), Scoring::Verbatim, None, false)?;
        Ok(acc.summary)
    }

    fn find_or_insert(
        &self,
        keys: &[u64],
        values: &mut [f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_values("values", n, values.len())?;
        self.check_scores(scores, n, true)?;
        Self::check_outcomes(&outcomes, n)?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::FindOrInsert, n);
        self.grow_for(n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let dim = self.config.dim;
        let outs = Outs { values: Some(values), outcomes, ..Outs::default() };
        let acc = run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            let mut input_row = vec![0.0f32; dim];
            for (j, i) in r.enumerate() {
                let input = scores.map(|s| s[i]);
                let row = &mut outs.values.as_deref_mut().expect("values given")[j * dim..(j + 1) * dim];
                input_row.copy_from_slice(row);
                let o = self.upsert(&st, keys[i], &input_row, input, Scoring::Policy, &scorer, None, |bk, s| {
                    row.copy_from_slice(bk.value(s, dim));
                    bk.scores[s] = scorer.on_upsert(bk.scores[s], input);
                });
                acc.hits += (o == Outcome::Updated) as u64;
                acc.summary.add(o);
                outs.outcome(j, o);
            }
            acc
        });
        self.finish_insert(&acc);
        self.counters.lookups(acc.hits, n);
        Ok(acc.summary)
    }

    fn assign(
        &self,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
        outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_values("values", n, values.len())?;
        self.check_scores(scores, n, false)?;
        Self::check_outcomes(&outcomes, n)?;
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(Op::Assign, n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let dim = self.config.dim;
        let acc = run_batch(n, Outs { outcomes, ..Outs::default() }, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.enumerate() {
                let input = scores.map(|s| s[i]);
                let hit = self.with_entry_mut(&st, keys[i], |bk, s| {
                    bk.value_mut(s, dim).copy_from_slice(&values[i * dim..(i + 1) * dim]);
                    bk.scores[s] = scorer.on_update(bk.scores[s], input);
                });
                let o = if hit.is_some() { Outcome::Updated } else { Outcome::Absent };
                acc.summary.add(o);
                outs.outcome(j, o);
            }
            acc
        });
        Ok(acc.summary)
    }

    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_scores(scores, n, false)?;
        Self::check_outcomes(&outcomes, n)?;
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(Op::AssignScores, n);
        let st = self.storage.read();
        let scorer = self.scorer();
        let acc = run_batch(
            n,
            Outs { outcomes, ..Outs::default() },
            self.config.dim,
            &|r: Range<usize>, mut outs: Outs<'_>| {
                let mut acc = Acc::default();
                for (j, i) in r.enumerate() {
                    let input = scores.map(|s| s[i]);
                    let hit = self.with_entry_mut(&st, keys[i], |bk, s| {
                        bk.scores[s] = scorer.on_update(bk.scores[s], input);
                    });
                    let o = if hit.is_some() { Outcome::Updated } else { Outcome::Absent };
                    acc.summary.add(o);
                    outs.outcome(j, o);
                }
                acc
            },
        );
        Ok(acc.summary)
    }

    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        mut outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check_keys(keys)?;
        self.check_values("deltas", n, deltas.len())?;
        self.check_scores(scores, n, true)?;
        Self::check_outcomes(&outcomes, n)?;
        let dim = self.config.dim;
        let add = |row: &mut [f32], i: usize| {
            for (v, d) in row.iter_mut().zip(&deltas[i * dim..(i + 1) * dim]) {
                *v += d;
            }
        };
        // Phase 1, updater group: accumulate into present keys.
        let mut first =
            {
                let _g = self.lock.acquire(Group::Updater);
                self.counters.op(Op::AccumOrAssign, n);
                let st = self.storage.read();
                let scorer = self.scorer();
                run_batch(n, Outs { outcomes: outcomes.as_deref_mut(), ..Outs::default() }, dim, &|r: Range<usize>,
                                                                                                   mut outs: Outs<
                    '_,
                >| {
                    let mut acc = Acc::default();
                    for (j, i) in r.enumerate() {
                        let input = scores.map(|s| s[i]);
                        let hit = self.with_entry_mut(&st, keys[i], |bk, s| {
                            add(bk.value_mut(s, dim), i);
                            bk.scores[s] = scorer.on_upsert(bk.scores[s], input);
                        });
                        if hit.is_some() {
                            acc.summary.add(Outcome::Updated);
                            outs.outcome(j, Outcome::Updated);
                        } else {
                            acc.absent.push(i);
                        }
                    }
                    acc
                })
            };
        if first.absent.is_empty() {
            return Ok(first.summary);
        }
        // Phase 2, inserter group: insert the absent keys, in index order
        // (another batch may have inserted some meanwhile: accumulate those).
        first.absent.sort_unstable();
        let _g = self.lock.acquire(Group::Inserter);
        self.grow_for(first.absent.len());
        let st = self.storage.read();
        let scorer = self.scorer();
        let idx = &first.absent;
        let acc = run_batch(idx.len(), Outs::default(), dim, &|r: Range<usize>, _outs: Outs<'_>| {
            let mut acc = Acc::default();
            for &i in &idx[r] {
                let input = scores.map(|s| s[i]);
                let o = self.upsert(
                    &st,
                    keys[i],
                    &deltas[i * dim..(i + 1) * dim],
                    input,
                    Scoring::Policy,
                    &scorer,
                    None,
                    |bk, s| {
                        add(bk.value_mut(s, dim), i);
                        bk.scores[s] = scorer.on_upsert(bk.scores[s], input);
                    },
                );
                acc.summary.add(o);
                acc.placed.push((i, o));
            }
            acc
        });
        if let Some(out) = outcomes {
            for &(i, o) in &acc.placed {
                out[i] = o;
            }
        }
        self.finish_insert(&acc);
        Ok(first.summary.merge(acc.summary))
    }

    fn erase(&self, keys: &[u64], erased: Option<&mut [bool]>) -> Result<usize> {
        let n = keys.len();
        check_keys(keys)?;
        if let Some(e) = &erased {
            check_len("erased", e.len(), n, || format!("{n} keys"))?;
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Erase, n);
        let st = self.storage.read();
        let acc = run_batch(
            n,
            Outs { found: erased, ..Outs::default() },
            self.config.dim,
            &|r: Range<usize>, mut outs: Outs<'_>| {
                let mut acc = Acc::default();
                for (j, i) in r.enumerate() {
                    let hit = self.with_entry_mut(&st, keys[i], |bk, s| bk.remove(s)).is_some();
                    outs.found(j, hit);
                    acc.hits += hit as u64;
                }
                acc
            },
        );
        self.size.fetch_sub(acc.hits, Ordering::Relaxed);
        Ok(acc.hits as usize)
    }

    fn erase_if(&self, filter: &Filter) -> Result<u64> {
        let _g = self.lock.acquire(Group::Inserter);
        let st = self.storage.read();
        self.counters.op(Op::EraseIf, 0);
        use rayon::prelude::*;
        let removed: u64 = st
            .buckets
            .par_iter()
            .map(|lock| {
                let mut bk = lock.write();
                let mut occ = bk.occupied;
                let mut removed = 0;
                while occ != 0 {
                    let s = occ.trailing_zeros() as usize;
                    if filter.matches(bk.keys[s], bk.scores[s]) {
                        bk.remove(s);
                        removed += 1;
                    }
                    occ &= occ - 1;
                }
                removed
            })
            .sum();
        self.size.fetch_sub(removed, Ordering::Relaxed);
        Ok(removed)
    }

    fn clear(&self) -> Result<()> {
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Clear, 0);
        let st = self.storage.read();
        use rayon::prelude::*;
        st.buckets.par_iter().for_each(|lock| lock.write().clear());
        self.size.store(0, Ordering::Relaxed);
        Ok(())
    }

    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export> {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let cap = st.nbuckets * S as u64;
        let end = offset.saturating_add(n).min(cap);
        let mut out = Export::default();
        if offset >= end {
            self.counters.op(Op::Export, 0);
            return Ok(out);
        }
        let dim = self.config.dim;
        let (first, last) = (offset / S as u64, (end - 1) / S as u64);
        for b in first..=last {
            let bk = st.buckets[b as usize].read();
            let lo = if b == first { (offset % S as u64) as usize } else { 0 };
            let hi = if b == last { ((end - 1) % S as u64) as usize + 1 } else { S };
            let range_mask = if hi - lo == S { u128::MAX } else { ((1u128 << (hi - lo)) - 1) << lo };
            let mut occ = bk.occupied & range_mask;
            while occ != 0 {
                let s = occ.trailing_zeros() as usize;
                if filter.matches(bk.keys[s], bk.scores[s]) {
                    out.keys.push(bk.keys[s]);
                    out.scores.push(bk.scores[s]);
                    out.values.extend_from_slice(bk.value(s, dim));
                }
                occ &= occ - 1;
            }
        }
        self.counters.op(Op::Export, out.keys.len());
        Ok(out)
    }

    fn reserve(&self, capacity: u64) -> Result<()> {
        let max = self.config.max_buckets() * S as u64;
        if capacity > max {
            return Err(Error::Capacity { requested: capacity, max });
        }
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Reserve, 0);
        loop {
            let nb = self.storage.read().nbuckets;
            if nb * S as u64 >= capacity || nb * 2 > self.config.max_buckets() {
                return Ok(());
            }
            self.rehash(nb * 2);
        }
    }

    fn stats(&self) -> ShardStats {
        let c = &self.counters;
        let capacity = self.capacity();
        let size = self.size();
        let value_bytes = capacity * self.config.dim as u64 * 4;
        ShardStats {
            size,
            capacity,
            load_factor: size as f64 / capacity as f64,
            ops: c.ops.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
            keys: c.keys.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            inserts: c.inserts.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            rejections: c.rejections.load(Ordering::Relaxed),
            fast_tier_bytes: 0,
            host_tier_bytes: value_bytes,
            lock: self.lock.state(),
        }
    }
}

/// One occupied slot: `(bucket, slot, key, digest, score)`.
pub type RawSlot = (u64, usize, u64, u8, u64);

/// Test support: the raw bucket contents, for invariant checks.
impl CpuTable {
    /// Every occupied slot as `(bucket, slot, key, digest, score)`, and the
    /// bucket count. Takes the reader group.
    pub fn dump_slots(&self) -> (u64, Vec<RawSlot>) {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let mut out = Vec::new();
        for (b, lock) in st.buckets.iter().enumerate() {
            let bk = lock.read();
            let mut occ = bk.occupied;
            while occ != 0 {
                let s = occ.trailing_zeros() as usize;
                out.push((b as u64, s, bk.keys[s], bk.digests.0[s], bk.scores[s]));
                occ &= occ - 1;
            }
        }
        (st.nbuckets, out)
    }
}
