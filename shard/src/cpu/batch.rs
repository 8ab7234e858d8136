//! Splitting a batch over the cores: the caller's output arrays, what each
//! piece accumulates, and the recursive halving on the rayon pool.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use super::GRAIN;
use crate::{Evictions, Outcome, Summary, SEQUENTIAL_BATCH};

/// Everything a parallel batch accumulates.
#[derive(Default)]
pub(super) struct Acc {
    pub(super) summary: Summary,
    pub(super) hits: u64,
    pub(super) lost: Evictions,
    /// Indices of keys absent in accum_or_assign's first phase.
    pub(super) absent: Vec<usize>,
    /// (index, outcome) of keys placed in accum_or_assign's second phase.
    pub(super) placed: Vec<(usize, Outcome)>,
}

impl Acc {
    pub(super) fn merge(mut self, o: Acc) -> Acc {
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
pub(super) struct Outs<'a> {
    pub(super) values: Option<&'a mut [f32]>,
    pub(super) found: Option<&'a mut [bool]>,
    pub(super) scores: Option<&'a mut [u64]>,
    pub(super) outcomes: Option<&'a mut [Outcome]>,
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
    pub(super) fn split(self, mid: usize, dim: usize) -> (Outs<'a>, Outs<'a>) {
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
    pub(super) fn outcome(&mut self, j: usize, o: Outcome) {
        if let Some(out) = self.outcomes.as_deref_mut() {
            out[j] = o;
        }
    }

    #[inline]
    pub(super) fn found(&mut self, j: usize, f: bool) {
        if let Some(out) = self.found.as_deref_mut() {
            out[j] = f;
        }
    }
}

/// Rows of a [`Shard::find_at`](crate::Shard::find_at) answer from row `base` on: `dim` values
/// and one found byte each.
pub(super) struct Rows<'a> {
    pub(super) base: usize,
    pub(super) values: &'a mut [f32],
    pub(super) found: &'a mut [u8],
}

impl<'a> Rows<'a> {
    /// The rows before answer row `row` and those from it on.
    pub(super) fn split(self, row: usize, dim: usize) -> (Rows<'a>, Rows<'a>) {
        let at = row - self.base;
        let (vl, vh) = self.values.split_at_mut(at * dim);
        let (fl, fh) = self.found.split_at_mut(at);
        (Rows { base: self.base, values: vl, found: fl }, Rows { base: row, values: vh, found: fh })
    }
}

/// Whether batches above [`SEQUENTIAL_BATCH`] keys are halved on the rayon
/// pool ([`super::set_parallel_batches`]).
static PARALLEL: AtomicBool = AtomicBool::new(true);

pub(super) fn set_parallel(on: bool) {
    PARALLEL.store(on, Relaxed);
}

/// The most keys a batch of `n` runs in one piece on the calling thread:
/// all of a small batch (or of any batch, parallel batches off), else
/// [`GRAIN`] (larger ones are halved on the rayon pool).
pub(super) fn grain(n: usize) -> usize {
    if n <= SEQUENTIAL_BATCH || !PARALLEL.load(Relaxed) {
        n
    } else {
        GRAIN
    }
}

/// Runs `f` over `0..n`: in index order for small batches, else split in
/// halves down to [`grain`] keys and run on the rayon pool.
pub(super) fn run_batch<F>(n: usize, outs: Outs<'_>, dim: usize, f: &F) -> Acc
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
pub(super) enum Scoring {
    /// The policy's insert-like rules.
    Policy,
    /// Scores verbatim (load / restore).
    Verbatim,
}
