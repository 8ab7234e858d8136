//! The CPU backend: the table in host memory, batches spread over all cores.
//!
//! Every field of a bucket is a relaxed atomic, so readers need no per-bucket
//! lock: the table-wide [`GroupLock`] already keeps writers out while they
//! run. Writers (updaters and inserters, whose batches are processed in
//! parallel) serialise per bucket on a small mutex. Values live in one array
//! addressed by position, `(bucket * 128 + slot) * dim`. The whole storage
//! sits behind an `RwLock` that only growth takes for writing (under the
//! inserter group, so no batch is running then).
//!
//! Lookups are software-pipelined in groups of 16 keys (`PIPE`): while the
//! lookups of group g run, the candidate keys and value rows of group g + 1
//! and the digest lines of group g + 2 are being fetched, with prefetch
//! instructions issued back to back, so that cache misses overlap instead of
//! queueing one behind the other. [`prefetch`] is this module's one `unsafe`
//! call, outside the CUDA modules where `unsafe` otherwise lives: plain
//! loads in its place (results fed to `black_box`) must complete before
//! they retire and so keep far fewer misses in flight; through hkvd on two
//! cores finds ran 25–60 % faster with the instruction (`daemon/BENCHMARKS.md`).
//! Bucket indices use a precomputed reciprocal ([`Buckets`]) instead of a
//! 64-bit division.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::check;
use crate::config::{BucketMode, TableConfig};
use crate::error::{Error, Result};
use crate::hash::{Buckets, EMPTY_DIGEST};
use crate::lock::{Group, GroupLock};
use crate::score::{Clock, Scorer, SystemClock};
use crate::{
    Evictions, Export, Filter, Lost, Op, Outcome, Shard, ShardStats, Summary, BUCKET_SLOTS, EMPTY_KEY, SEQUENTIAL_BATCH,
};

const S: usize = BUCKET_SLOTS;
/// f32 per 64-byte cache line.
const LINE_FLOATS: usize = 16;
/// Keys per parallel task once a batch is split.
const GRAIN: usize = 2048;
/// Keys whose memory accesses are overlapped by the lookup pipeline.
const PIPE: usize = 16;

const LO7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const ONES: u64 = 0x0101_0101_0101_0101;

/// One bucket in the paper's layout: the 128 digests first (the struct is
/// 128-byte aligned, so they are exactly one cache line), then keys and
/// scores, then what the CPU adds: an occupancy bitmap (a free slot without
/// scanning keys) and the writers' mutex.
#[repr(C, align(128))]
struct Bucket {
    /// Digest of slot `s` is byte `s % 8` (little-endian) of word `s / 8`.
    digests: [AtomicU64; S / 8],
    keys: [AtomicU64; S],
    scores: [AtomicU64; S],
    occupied: [AtomicU64; 2],
    writer: Mutex<()>,
}

impl Bucket {
    fn new() -> Bucket {
        let empty = ONES.wrapping_mul(EMPTY_DIGEST as u64);
        Bucket {
            digests: std::array::from_fn(|_| AtomicU64::new(empty)),
            keys: std::array::from_fn(|_| AtomicU64::new(EMPTY_KEY)),
            scores: std::array::from_fn(|_| AtomicU64::new(0)),
            occupied: [AtomicU64::new(0), AtomicU64::new(0)],
            writer: Mutex::new(()),
        }
    }

    #[inline]
    fn occupied(&self) -> u128 {
        self.occupied[0].load(Relaxed) as u128 | (self.occupied[1].load(Relaxed) as u128) << 64
    }

    #[inline]
    fn set_occupied(&self, bits: u128) {
        self.occupied[0].store(bits as u64, Relaxed);
        self.occupied[1].store((bits >> 64) as u64, Relaxed);
    }

    #[inline]
    fn len(&self) -> u32 {
        self.occupied().count_ones()
    }

    #[inline]
    fn key(&self, s: usize) -> u64 {
        self.keys[s].load(Relaxed)
    }

    #[inline]
    fn score(&self, s: usize) -> u64 {
        self.scores[s].load(Relaxed)
    }

    #[inline]
    fn set_score(&self, s: usize, score: u64) {
        self.scores[s].store(score, Relaxed);
    }

    #[inline]
    fn digest(&self, s: usize) -> u8 {
        (self.digests[s / 8].load(Relaxed) >> (8 * (s % 8))) as u8
    }

    /// Writers only (the bucket mutex held): no other thread writes the word.
    #[inline]
    fn set_digest(&self, s: usize, d: u8) {
        let w = &self.digests[s / 8];
        let sh = 8 * (s % 8);
        w.store((w.load(Relaxed) & !(0xff << sh)) | (d as u64) << sh, Relaxed);
    }

    /// Slots whose digest equals `d`, 8 at a time (SWAR): one bit per match,
    /// bit 7 of byte `i` of word `w` for slot `8w + i`, visited by `f` until it
    /// returns `Some`.
    #[inline]
    fn scan<R>(&self, d: u8, mut f: impl FnMut(usize) -> Option<R>) -> Option<R> {
        let pattern = ONES.wrapping_mul(d as u64);
        for (w, word) in self.digests.iter().enumerate() {
            let x = word.load(Relaxed) ^ pattern;
            // Exact zero-byte mask: bit 7 of each byte of x that is zero.
            let mut m = !(((x & LO7).wrapping_add(LO7)) | x | LO7);
            while m != 0 {
                if let Some(r) = f(w * 8 + (m.trailing_zeros() / 8) as usize) {
                    return Some(r);
                }
                m &= m - 1;
            }
        }
        None
    }

    /// The slot holding `key`: a key is read only where the digest matches.
    /// Free slots hold `EMPTY_KEY`, which no input key equals.
    #[inline]
    fn find(&self, key: u64, d: u8) -> Option<usize> {
        self.scan(d, |s| (self.key(s) == key).then_some(s))
    }

    #[inline]
    fn free_slot(&self) -> Option<usize> {
        let free = !self.occupied();
        (free != 0).then(|| free.trailing_zeros() as usize)
    }

    /// The minimum-score slot of a full bucket (lowest slot on ties).
    #[inline]
    fn min_slot(&self) -> (usize, u64) {
        let mut best = (0, self.score(0));
        for s in 1..S {
            let sc = self.score(s);
            if sc < best.1 {
                best = (s, sc);
            }
        }
        best
    }

    #[inline]
    fn put_meta(&self, s: usize, key: u64, d: u8, score: u64) {
        self.keys[s].store(key, Relaxed);
        self.set_digest(s, d);
        self.set_score(s, score);
        self.set_occupied(self.occupied() | 1u128 << s);
    }

    #[inline]
    fn remove(&self, s: usize) {
        self.keys[s].store(EMPTY_KEY, Relaxed);
        self.set_digest(s, EMPTY_DIGEST);
        self.set_score(s, 0);
        self.set_occupied(self.occupied() & !(1u128 << s));
    }

    /// Calls `f` for every occupied slot.
    #[inline]
    fn each(&self, mut f: impl FnMut(usize)) {
        let mut occ = self.occupied();
        while occ != 0 {
            f(occ.trailing_zeros() as usize);
            occ &= occ - 1;
        }
    }
}

struct Storage {
    buckets: Vec<Bucket>,
    /// `nbuckets * 128 * dim` floats (as bits), addressed by position,
    /// from element `skew` on.
    values: Vec<AtomicU32>,
    /// The first element of row 0, at a 64-byte boundary of `values`: a
    /// row of 16 or 32 floats then spans one or two cache lines, not two
    /// or three (large allocations start 16 bytes past a page boundary),
    /// and the lookup pipeline's touches reach every line of it.
    skew: usize,
    /// The bucket count with its reciprocal, for the bucket of a key.
    div: Buckets,
    dim: usize,
}

/// Bytes of one bucket in host memory (digests, keys, scores, bitmap, mutex).
pub const BUCKET_BYTES: u64 = std::mem::size_of::<Bucket>() as u64;

/// A vector of `n` elements made by `f`, or an error naming the bytes when
/// the allocation fails (the size may come from a client: never abort).
fn try_vec<T>(n: usize, what: &str, f: impl FnMut() -> T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::OutOfMemory(format!(
            "{what}: {} bytes could not be allocated",
            (n as u128) * std::mem::size_of::<T>() as u128
        ))
    })?;
    v.extend(std::iter::repeat_with(f).take(n));
    Ok(v)
}

impl Storage {
    fn new(nbuckets: u64, dim: usize) -> Result<Storage> {
        let too_big = || Error::Config(format!("{nbuckets} buckets of dim {dim} do not fit this host's address space"));
        let n = usize::try_from(nbuckets).map_err(|_| too_big())?;
        let floats = n.checked_mul(S * dim).and_then(|x| x.checked_add(LINE_FLOATS - 1)).ok_or_else(too_big)?;
        // Zeroed by the allocator (`calloc`: fresh pages from the kernel are
        // already zero, faulted in on first touch), not element by element:
        // filling a large table's values was about half the CPU of a restore.
        let values = <AtomicU32 as zerocopy::FromZeros>::new_vec_zeroed(floats).map_err(|_| {
            Error::OutOfMemory(format!(
                "table values: {} bytes could not be allocated",
                (floats as u128) * std::mem::size_of::<AtomicU32>() as u128
            ))
        })?;
        let skew = (values.as_ptr() as usize).wrapping_neg() % 64 / 4;
        let buckets = try_vec(n, "table buckets", Bucket::new)?;
        Ok(Storage { buckets, values, skew, div: Buckets::new(nbuckets), dim })
    }

    fn nbuckets(&self) -> u64 {
        self.div.count()
    }

    #[inline]
    fn row(&self, b: usize, s: usize) -> &[AtomicU32] {
        let o = self.skew + (b * S + s) * self.dim;
        &self.values[o..o + self.dim]
    }

    #[inline]
    fn read_row(&self, b: usize, s: usize, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.row(b, s)) {
            *o = f32::from_bits(v.load(Relaxed));
        }
    }

    #[inline]
    fn write_row(&self, b: usize, s: usize, src: &[f32]) {
        for (v, x) in self.row(b, s).iter().zip(src) {
            v.store(x.to_bits(), Relaxed);
        }
    }

    #[inline]
    fn add_row(&self, b: usize, s: usize, delta: &[f32]) {
        for (v, x) in self.row(b, s).iter().zip(delta) {
            v.store((f32::from_bits(v.load(Relaxed)) + x).to_bits(), Relaxed);
        }
    }

    fn push_row(&self, b: usize, s: usize, out: &mut Vec<f32>) {
        out.extend(self.row(b, s).iter().map(|v| f32::from_bits(v.load(Relaxed))));
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

/// Rows of a [`Shard::find_at`] answer from row `base` on: `dim` values
/// and one found byte each.
struct Rows<'a> {
    base: usize,
    values: &'a mut [f32],
    found: &'a mut [u8],
}

impl<'a> Rows<'a> {
    /// The rows before answer row `row` and those from it on.
    fn split(self, row: usize, dim: usize) -> (Rows<'a>, Rows<'a>) {
        let at = row - self.base;
        let (vl, vh) = self.values.split_at_mut(at * dim);
        let (fl, fh) = self.found.split_at_mut(at);
        (Rows { base: self.base, values: vl, found: fl }, Rows { base: row, values: vh, found: fh })
    }
}

/// The most keys a batch of `n` runs in one piece on the calling thread:
/// all of a small batch, else [`GRAIN`] (larger ones are halved on the
/// rayon pool).
fn grain(n: usize) -> usize {
    if n <= SEQUENTIAL_BATCH {
        n
    } else {
        GRAIN
    }
}

/// Runs `f` over `0..n`: in index order for small batches, else split in
/// halves down to [`grain`] keys and run on the rayon pool.
fn run_batch<F>(n: usize, outs: Outs<'_>, dim: usize, f: &F) -> Acc
where
    F: Fn(Range<usize>, Outs<'_>) -> Acc + Sync,
{
    fn split<F>(r: Range<usize>, outs: Outs<'_>, dim: usize, grain: usize, f: &F) -> Acc
    where
        F: Fn(Range<usize>, Outs<'_>) -> Acc + Sync,
    {
        if r.len() <= grain {
            return f(r, outs);
        }
        let mid = r.len() / 2;
        let (lo, hi) = outs.split(mid, dim);
        let (a, b) = rayon::join(
            || split(r.start..r.start + mid, lo, dim, grain, f),
            || split(r.start + mid..r.end, hi, dim, grain, f),
        );
        a.merge(b)
    }
    split(0..n, outs, dim, grain(n), f)
}

/// How the score of a written key is decided.
#[derive(Clone, Copy)]
enum Scoring {
    /// The policy's insert-like rules.
    Policy,
    /// Scores verbatim (load / restore).
    Verbatim,
}

/// Operation counters of a shard (shared by the backends).
#[derive(Default)]
pub(crate) struct Counters {
    ops: [AtomicU64; Op::ALL.len()],
    keys: [AtomicU64; Op::ALL.len()],
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    pub(crate) evictions: AtomicU64,
    rejections: AtomicU64,
}

impl Counters {
    pub(crate) fn op(&self, op: Op, n: usize) {
        let i = Op::ALL.iter().position(|&o| o == op).expect("op listed");
        self.ops[i].fetch_add(1, Relaxed);
        self.keys[i].fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn summary(&self, s: &Summary) {
        self.inserts.fetch_add(s.inserted, Relaxed);
        self.evictions.fetch_add(s.evicted, Relaxed);
        self.rejections.fetch_add(s.rejected, Relaxed);
    }

    /// The shard's statistics from these counters and the given state.
    pub(crate) fn stats(
        &self,
        size: u64,
        capacity: u64,
        fast_tier_bytes: u64,
        host_tier_bytes: u64,
        lock: crate::LockState,
    ) -> ShardStats {
        ShardStats {
            size,
            capacity,
            load_factor: size as f64 / capacity.max(1) as f64,
            ops: self.ops.iter().map(|a| a.load(Relaxed)).collect(),
            keys: self.keys.iter().map(|a| a.load(Relaxed)).collect(),
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            inserts: self.inserts.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            rejections: self.rejections.load(Relaxed),
            fast_tier_bytes,
            host_tier_bytes,
            lock,
        }
    }

    pub(crate) fn lookups(&self, hits: u64, n: usize) {
        self.hits.fetch_add(hits, Relaxed);
        self.misses.fetch_add(n as u64 - hits, Relaxed);
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

impl CpuTable {
    /// A table on the system clock.
    pub fn new(config: TableConfig) -> Result<CpuTable> {
        Self::with_clock(config, Arc::new(SystemClock::default()))
    }

    /// A table reading Lru / EpochLru time from `clock`.
    pub fn with_clock(config: TableConfig, clock: Arc<dyn Clock>) -> Result<CpuTable> {
        config.validate()?;
        let storage = Storage::new(config.buckets(), config.dim)?;
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
        Scorer {
            policy: self.config.policy,
            now_ns: self.clock.now_ns(),
            epoch: self.epoch.load(Relaxed),
            lfu_ties: self.config.lfu_ties,
        }
    }

    /// The candidate buckets of a key: `(b1, b2)`, `b2 == b1` in single mode.
    #[inline]
    fn buckets_of(&self, st: &Storage, key: u64) -> (usize, usize, u8) {
        let (b1, d) = st.div.locate(key);
        let b2 = if self.dual() { st.div.bucket2(key, b1) } else { b1 };
        (b1 as usize, b2 as usize, d)
    }

    /// Where a present key sits, without locks (reader group, or under the
    /// candidate buckets' mutexes).
    #[inline]
    fn locate_entry(&self, st: &Storage, key: u64) -> Option<(usize, usize)> {
        let (b1, b2, d) = self.buckets_of(st, key);
        if let Some(s) = st.buckets[b1].find(key, d) {
            return Some((b1, s));
        }
        if b2 != b1 {
            return st.buckets[b2].find(key, d).map(|s| (b2, s));
        }
        None
    }

    /// Looks up `keys` with the pipeline described in the module docs and
    /// calls `f(j, Some((bucket, slot)))` or `f(j, None)` for each, in order;
    /// `rows`: also fetch the value rows of the keys found (for `f` to read).
    #[inline]
    fn lookup_pipelined(
        &self,
        st: &Storage,
        keys: &[u64],
        rows: bool,
        mut f: impl FnMut(usize, Option<(usize, usize)>),
    ) {
        let dual = self.dual();
        let ngroups = keys.len().div_ceil(PIPE);
        let group = |g: usize| &keys[g * PIPE..((g + 1) * PIPE).min(keys.len())];
        // Per group in flight (three at a time, by group index mod 3): each
        // key's buckets and digest, and its first digest match.
        let mut loc = [[(0usize, 0usize, 0u8); PIPE]; 3];
        let mut cand = [[usize::MAX; PIPE]; 3];
        // Stage 1 of group g: every key's buckets, then every digest line
        // (both 64-byte halves) prefetched, back to back.
        let stage1 = |g: usize, loc: &mut [(usize, usize, u8); PIPE]| {
            for (i, &k) in group(g).iter().enumerate() {
                let (b1, d) = st.div.locate(k);
                let b2 = if dual { st.div.bucket2(k, b1) as usize } else { b1 as usize };
                loc[i] = (b1 as usize, b2, d);
            }
            for &(b1, b2, _) in &loc[..group(g).len()] {
                let bk = &st.buckets[b1];
                prefetch(&bk.digests[0]);
                prefetch(&bk.digests[S / 16]);
                if dual {
                    let bk = &st.buckets[b2];
                    prefetch(&bk.digests[0]);
                    prefetch(&bk.digests[S / 16]);
                }
            }
        };
        // Stage 2 of group g: each key's first digest match (its digest
        // lines were prefetched a group earlier), then the candidates' keys
        // and value rows (every 64-byte line) prefetched, back to back.
        let stage2 = |g: usize, loc: &[(usize, usize, u8); PIPE], cand: &mut [usize; PIPE]| {
            let n = group(g).len();
            for (i, &(b1, _, d)) in loc[..n].iter().enumerate() {
                cand[i] = st.buckets[b1].scan(d, Some).unwrap_or(usize::MAX);
            }
            for (i, &(b1, _, _)) in loc[..n].iter().enumerate() {
                let s = cand[i];
                if s != usize::MAX {
                    prefetch(&st.buckets[b1].keys[s]);
                    if rows {
                        prefetch_row(st.row(b1, s));
                    }
                }
            }
        };
        // Group g's lookups run while group g + 1's rows and group g + 2's
        // digest lines are on their way.
        for g in 0..ngroups.min(2) {
            stage1(g, &mut loc[g % 3]);
        }
        if ngroups > 0 {
            stage2(0, &loc[0], &mut cand[0]);
        }
        for g in 0..ngroups {
            if g + 2 < ngroups {
                stage1(g + 2, &mut loc[(g + 2) % 3]);
            }
            if g + 1 < ngroups {
                let (l, c) = (&loc[(g + 1) % 3], &mut cand[(g + 1) % 3]);
                stage2(g + 1, l, c);
            }
            // Stage 3: the lookups proper, on lines already fetched; the
            // candidate is checked first (a hit needs no second scan).
            let (loc, cand) = (&loc[g % 3], &cand[g % 3]);
            for (i, &k) in group(g).iter().enumerate() {
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

    /// [`Shard::find_at`] into `rows`: batches of up to `grain` keys on
    /// this thread, larger ones halved on the rayon pool (as `at`
    /// increases, the two halves write disjoint row ranges).
    fn find_rows(&self, st: &Storage, keys: &[u64], at: &[u32], rows: Rows<'_>, grain: usize) -> u64 {
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
    fn touch(&self, st: &Storage, keys: &[u64]) {
        for &k in keys {
            let (b1, _) = st.div.locate(k);
            let bk = &st.buckets[b1 as usize];
            prefetch(&bk.digests[0]);
            prefetch(&bk.digests[S / 16]);
            prefetch(&bk.occupied[0]);
        }
    }

    /// Runs `f` on a present key's slot with its candidate buckets locked.
    #[inline]
    fn with_entry_mut<R>(&self, st: &Storage, key: u64, f: impl FnOnce(usize, usize) -> R) -> Option<R> {
        let (b1, b2, _) = self.buckets_of(st, key);
        let _w = Self::lock_pair(st, b1, b2);
        self.locate_entry(st, key).map(|(b, s)| f(b, s))
    }

    /// Locks one or two buckets, lower index first so that parallel tasks
    /// never deadlock.
    #[inline]
    fn lock_pair(
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
    fn upsert(
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
        bk.put_meta(s, key, d, score);
        st.write_row(b, s, value);
        Outcome::Evicted
    }

    /// Dual mode, both candidates `b1`, `b2` full (and locked): frees a slot
    /// in one of them (b1 first) by moving a resident to its other bucket,
    /// or a resident of that bucket on to its own other bucket (two steps
    /// at most); returns the slot freed.
    fn relocate_one(&self, st: &Storage, b1: usize, b2: usize) -> Option<(usize, usize)> {
        [b1, b2].into_iter().find_map(|b| self.make_room(st, b, 2, &mut vec![b1, b2]).map(|s| (b, s)))
    }

    /// Frees a slot of the full, locked bucket `b`: the first resident
    /// (lowest slot first) whose other bucket has room, else (with `depth`
    /// left) for which that bucket can make room the same way. Buckets in
    /// `path` are not used. Other buckets are only try-locked, so two
    /// writers never wait on each other.
    fn make_room(&self, st: &Storage, b: usize, depth: u32, path: &mut Vec<usize>) -> Option<usize> {
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

    /// Doubles the buckets while `incoming` more keys would pass the max load
    /// factor and the max capacity allows. Caller holds the inserter group.
    fn grow_for(&self, incoming: usize) {
        let max_buckets = self.config.max_buckets();
        loop {
            let nb = self.storage.read().nbuckets();
            let cap = (nb * S as u64) as f64;
            let want = (self.size.load(Relaxed) + incoming as u64) as f64;
            if want <= self.config.max_load_factor * cap || nb * 2 > max_buckets {
                return;
            }
            // Without memory for the larger storage the table stays as it
            // is and keeps working as a cache: inserts evict instead.
            if self.rehash(nb * 2).is_err() {
                return;
            }
        }
    }

    /// Rebuilds the table with `nbuckets` buckets: entries are re-inserted in
    /// descending score order (key order on ties), so that if two-choice
    /// placement ever overflows, the lowest scores are the ones that go. In
    /// single mode doubling never overflows: `(h mod 2B) mod B = h mod B`, so
    /// bucket b's entries move to b or b + B only.
    fn rehash(&self, nbuckets: u64) -> Result<()> {
        let mut st = self.storage.write();
        let new = Storage::new(nbuckets, self.config.dim)?;
        let mut entries: Vec<(u64, u64, usize, usize)> = Vec::new();
        entries
            .try_reserve_exact(self.size.load(Relaxed) as usize)
            .map_err(|_| Error::OutOfMemory("the entry list of a table's growth".into()))?;
        for (b, bk) in st.buckets.iter().enumerate() {
            bk.each(|s| entries.push((bk.score(s), bk.key(s), b, s)));
        }
        entries.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let scorer = self.scorer();
        let mut summary = Summary::default();
        let mut row = vec![0.0; self.config.dim];
        for &(score, key, b, s) in &entries {
            st.read_row(b, s, &mut row);
            summary.add(self.upsert(&new, key, &row, Some(score), Scoring::Verbatim, &scorer, None, |_, _| {}));
        }
        // A two-choice overflow loses entries (an eviction swaps one for
        // another, a rejection drops the newcomer): size is what was placed.
        self.size.store(summary.inserted, Relaxed);
        self.counters.evictions.fetch_add(summary.evicted + summary.rejected, Relaxed);
        *st = new;
        Ok(())
    }

    fn finish_insert(&self, acc: &Acc) {
        self.size.fetch_add(acc.summary.inserted, Relaxed);
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
        // Verbatim scores (load) are checked by the caller, not against the policy.
        let policy = matches!(scoring, Scoring::Policy);
        let policy_scores = if policy { scores } else { None };
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            policy_scores,
            policy,
            outcomes.as_ref().map(|o| o.len()),
        )?;
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
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let input = scores.map(|s| s[i]);
                let v = &values[i * dim..(i + 1) * dim];
                let o = self.upsert(&st, keys[i], v, input, scoring, &scorer, lost.as_mut(), |b, s| {
                    st.write_row(b, s, v);
                    let bk = &st.buckets[b];
                    bk.set_score(
                        s,
                        match scoring {
                            Scoring::Verbatim => input.unwrap_or(0),
                            Scoring::Policy => scorer.on_upsert(bk.score(s), input),
                        },
                    );
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

    /// An update-only batch (assign, assign_scores): `f(i, bucket, slot)` on
    /// every present key under its bucket's mutex.
    fn update_batch(
        &self,
        op: Op,
        keys: &[u64],
        outcomes: Option<&mut [Outcome]>,
        f: &(dyn Fn(&Storage, usize, usize, usize) + Sync),
    ) -> Result<Summary> {
        let n = keys.len();
        let _g = self.lock.acquire(Group::Updater);
        self.counters.op(op, n);
        let st = self.storage.read();
        let acc = run_batch(
            n,
            Outs { outcomes, ..Outs::default() },
            self.config.dim,
            &|r: Range<usize>, mut outs: Outs<'_>| {
                let mut acc = Acc::default();
                for (j, i) in r.clone().enumerate() {
                    if j % PIPE == 0 {
                        self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                    }
                    let o = match self.with_entry_mut(&st, keys[i], |b, s| f(&st, i, b, s)) {
                        Some(()) => Outcome::Updated,
                        None => Outcome::Absent,
                    };
                    acc.summary.add(o);
                    outs.outcome(j, o);
                }
                acc
            },
        );
        Ok(acc.summary)
    }
}

impl Shard for CpuTable {
    fn config(&self) -> &TableConfig {
        &self.config
    }

    fn capacity(&self) -> u64 {
        self.storage.read().nbuckets() * S as u64
    }

    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }

    fn set_global_epoch(&self, epoch: u32) {
        self.epoch.store(epoch, Relaxed);
    }

    fn find(&self, keys: &[u64], values: &mut [f32], found: &mut [bool], scores: Option<&mut [u64]>) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, Some(values.len()), found.len(), scores.as_ref().map(|s| s.len()))?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Find, n);
        let st = self.storage.read();
        let dim = self.config.dim;
        let outs = Outs { values: Some(values), found: Some(found), scores, outcomes: None };
        let acc = run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            self.lookup_pipelined(&st, &keys[r], outs.values.is_some(), |j, hit| {
                if let Some((b, s)) = hit {
                    if let Some(v) = outs.values.as_deref_mut() {
                        st.read_row(b, s, &mut v[j * dim..(j + 1) * dim]);
                    }
                    if let Some(sc) = outs.scores.as_deref_mut() {
                        sc[j] = st.buckets[b].score(s);
                    }
                    acc.hits += 1;
                }
                outs.found(j, hit.is_some());
            });
            acc
        });
        self.counters.lookups(acc.hits, n);
        Ok(acc.hits as usize)
    }

    fn find_at(&self, keys: &[u64], at: &[u32], values: &mut [f32], found: &mut [u8]) -> Result<usize> {
        let n = keys.len();
        check::keys(keys)?;
        check::rows_at(&self.config, n, at, values.len(), found.len())?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Find, n);
        let st = self.storage.read();
        let hits = self.find_rows(&st, keys, at, Rows { base: 0, values, found }, grain(n));
        self.counters.lookups(hits, n);
        Ok(hits as usize)
    }

    fn contains(&self, keys: &[u64], found: &mut [bool]) -> Result<usize> {
        let n = keys.len();
        check::lookup(&self.config, keys, None, found.len(), None)?;
        let _g = self.lock.acquire(Group::Reader);
        self.counters.op(Op::Contains, n);
        let st = self.storage.read();
        let outs = Outs { found: Some(found), ..Outs::default() };
        let acc = run_batch(n, outs, self.config.dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            self.lookup_pipelined(&st, &keys[r], false, |j, hit| {
                outs.found(j, hit.is_some());
                acc.hits += hit.is_some() as u64;
            });
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
        check::len("scores", scores.len(), n, || format!("{n} keys"))?;
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
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
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
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let input = scores.map(|s| s[i]);
                let row = &mut outs.values.as_deref_mut().expect("values given")[j * dim..(j + 1) * dim];
                input_row.copy_from_slice(row);
                let o = self.upsert(&st, keys[i], &input_row, input, Scoring::Policy, &scorer, None, |b, s| {
                    st.read_row(b, s, row);
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_upsert(bk.score(s), input));
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
        check::write(
            &self.config,
            keys,
            Some(("values", values.len())),
            scores,
            false,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let scorer = self.scorer();
        let dim = self.config.dim;
        self.update_batch(Op::Assign, keys, outcomes, &|st, i, b, s| {
            st.write_row(b, s, &values[i * dim..(i + 1) * dim]);
            let bk = &st.buckets[b];
            bk.set_score(s, scorer.on_update(bk.score(s), scores.map(|x| x[i])));
        })
    }

    fn assign_scores(&self, keys: &[u64], scores: Option<&[u64]>, outcomes: Option<&mut [Outcome]>) -> Result<Summary> {
        check::write(&self.config, keys, None, scores, false, outcomes.as_ref().map(|o| o.len()))?;
        let scorer = self.scorer();
        self.update_batch(Op::AssignScores, keys, outcomes, &|st, i, b, s| {
            let bk = &st.buckets[b];
            bk.set_score(s, scorer.on_update(bk.score(s), scores.map(|x| x[i])));
        })
    }

    fn accum_or_assign(
        &self,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
        mut outcomes: Option<&mut [Outcome]>,
    ) -> Result<Summary> {
        let n = keys.len();
        check::write(
            &self.config,
            keys,
            Some(("deltas", deltas.len())),
            scores,
            true,
            outcomes.as_ref().map(|o| o.len()),
        )?;
        let dim = self.config.dim;
        let delta = |i: usize| &deltas[i * dim..(i + 1) * dim];
        // Phase 1, updater group: accumulate into present keys.
        let mut first = {
            let _g = self.lock.acquire(Group::Updater);
            self.counters.op(Op::AccumOrAssign, n);
            let st = self.storage.read();
            let scorer = self.scorer();
            let outs = Outs { outcomes: outcomes.as_deref_mut(), ..Outs::default() };
            run_batch(n, outs, dim, &|r: Range<usize>, mut outs: Outs<'_>| {
                let mut acc = Acc::default();
                for (j, i) in r.clone().enumerate() {
                    if j % PIPE == 0 {
                        self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                    }
                    let input = scores.map(|s| s[i]);
                    let hit = self.with_entry_mut(&st, keys[i], |b, s| {
                        st.add_row(b, s, delta(i));
                        let bk = &st.buckets[b];
                        bk.set_score(s, scorer.on_upsert(bk.score(s), input));
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
                let o = self.upsert(&st, keys[i], delta(i), input, Scoring::Policy, &scorer, None, |b, s| {
                    st.add_row(b, s, delta(i));
                    let bk = &st.buckets[b];
                    bk.set_score(s, scorer.on_upsert(bk.score(s), input));
                });
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
        check::erase(keys, erased.as_ref().map(|e| e.len()))?;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Erase, n);
        let st = self.storage.read();
        let outs = Outs { found: erased, ..Outs::default() };
        let acc = run_batch(n, outs, self.config.dim, &|r: Range<usize>, mut outs: Outs<'_>| {
            let mut acc = Acc::default();
            for (j, i) in r.clone().enumerate() {
                if j % PIPE == 0 {
                    self.touch(&st, &keys[i..r.end.min(i + PIPE)]);
                }
                let hit = self.with_entry_mut(&st, keys[i], |b, s| st.buckets[b].remove(s)).is_some();
                outs.found(j, hit);
                acc.hits += hit as u64;
            }
            acc
        });
        self.size.fetch_sub(acc.hits, Relaxed);
        Ok(acc.hits as usize)
    }

    fn erase_if(&self, filter: &Filter) -> Result<u64> {
        use rayon::prelude::*;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::EraseIf, 0);
        let st = self.storage.read();
        // One task per bucket range: no two tasks touch a bucket.
        let removed: u64 = st
            .buckets
            .par_iter()
            .map(|bk| {
                let mut removed = 0;
                bk.each(|s| {
                    if filter.matches(bk.key(s), bk.score(s)) {
                        bk.remove(s);
                        removed += 1;
                    }
                });
                removed
            })
            .sum();
        self.size.fetch_sub(removed, Relaxed);
        Ok(removed)
    }

    fn clear(&self) -> Result<()> {
        use rayon::prelude::*;
        let _g = self.lock.acquire(Group::Inserter);
        self.counters.op(Op::Clear, 0);
        let st = self.storage.read();
        st.buckets.par_iter().for_each(|bk| bk.each(|s| bk.remove(s)));
        self.size.store(0, Relaxed);
        Ok(())
    }

    fn export_batch_if(&self, offset: u64, n: u64, filter: &Filter) -> Result<Export> {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let cap = st.nbuckets() * S as u64;
        let end = offset.saturating_add(n).min(cap);
        let mut out = Export::default();
        if offset >= end {
            self.counters.op(Op::Export, 0);
            return Ok(out);
        }
        let (first, last) = (offset / S as u64, (end - 1) / S as u64);
        for b in first..=last {
            let bk = &st.buckets[b as usize];
            let lo = if b == first { (offset % S as u64) as usize } else { 0 };
            let hi = if b == last { ((end - 1) % S as u64) as usize + 1 } else { S };
            bk.each(|s| {
                if s >= lo && s < hi && filter.matches(bk.key(s), bk.score(s)) {
                    out.keys.push(bk.key(s));
                    out.scores.push(bk.score(s));
                    st.push_row(b as usize, s, &mut out.values);
                }
            });
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
            let nb = self.storage.read().nbuckets();
            if nb * S as u64 >= capacity || nb * 2 > self.config.max_buckets() {
                return Ok(());
            }
            self.rehash(nb * 2)?;
        }
    }

    fn resume_after(&self, max_score: u64) {
        crate::score::resume_after(self.config.policy, self.config.lfu_ties, max_score, &*self.clock, &self.epoch);
    }

    fn clock_score(&self) -> u64 {
        self.scorer().clock_floor()
    }

    fn stats(&self) -> ShardStats {
        let capacity = self.capacity();
        // Host memory holds every value.
        self.counters.stats(self.size(), capacity, 0, capacity * self.config.dim as u64 * 4, self.lock.state())
    }
}

/// One occupied slot: `(bucket, slot, key, digest, score)`.
pub type RawSlot = (u64, usize, u64, u8, u64);

/// Test support: the raw bucket contents, for invariant checks.
impl CpuTable {
    /// Every occupied slot, and the bucket count. Takes the reader group.
    pub fn dump_slots(&self) -> (u64, Vec<RawSlot>) {
        let _g = self.lock.acquire(Group::Reader);
        let st = self.storage.read();
        let mut out = Vec::new();
        for (b, bk) in st.buckets.iter().enumerate() {
            bk.each(|s| out.push((b as u64, s, bk.key(s), bk.digest(s), bk.score(s))));
        }
        (st.nbuckets(), out)
    }
}

/// Starts fetching every 64-byte line of a row of 4-byte values (rows may
/// start mid-line: the last element's line too).
#[inline(always)]
fn prefetch_row<T>(row: &[T]) {
    for x in row.iter().step_by(LINE_FLOATS).chain(row.last()) {
        prefetch(x);
    }
}

/// Starts fetching the cache line that holds `x` into every cache level.
#[inline(always)]
fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it reads nothing architecturally and
    // never faults (and `x` is a live reference). The intrinsic is unsafe
    // only as a target-feature function; SSE is in x86-64's baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x as *const T as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[cfg(test)]
mod tests {
    use super::Storage;

    /// Rows of 16 and 32 floats start on 64-byte boundaries, whatever the
    /// allocation's own alignment, and every position maps inside `values`.
    #[test]
    fn rows_start_on_cache_lines() {
        for dim in [16, 32] {
            for nbuckets in [1, 3, 64] {
                let st = Storage::new(nbuckets, dim).unwrap();
                for (b, s) in [(0, 0), (0, 1), (nbuckets as usize - 1, 127)] {
                    let row = st.row(b, s);
                    assert_eq!(row.as_ptr() as usize % 64, 0, "dim {dim}, bucket {b}, slot {s}");
                    assert_eq!(row.len(), dim);
                }
            }
        }
    }

    /// A size no host can hold is an error, not an abort (the number may
    /// come from a client's create_table).
    #[test]
    fn storage_too_large_for_the_host_is_an_error() {
        assert!(Storage::new(1 << 40, 4).is_err());
        assert!(Storage::new(u64::MAX / 2, 65536).is_err());
    }
}
