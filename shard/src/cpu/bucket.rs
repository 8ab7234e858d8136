//! One bucket: digests, keys, scores and the CPU's occupancy bits and
//! writer mutex, with the SWAR digest scan.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use super::S;
use crate::hash::EMPTY_DIGEST;
use crate::EMPTY_KEY;

const LO7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const ONES: u64 = 0x0101_0101_0101_0101;

/// One bucket in the paper's layout: the 128 digests first (the struct is
/// 128-byte aligned, so they are exactly one cache line), then keys and
/// scores, then what the CPU adds: an occupancy bitmap (a free slot without
/// scanning keys) and the writers' mutex.
#[repr(C, align(128))]
pub(super) struct Bucket {
    /// Digest of slot `s` is byte `s % 8` (little-endian) of word `s / 8`.
    pub(super) digests: [AtomicU64; S / 8],
    pub(super) keys: [AtomicU64; S],
    pub(super) scores: [AtomicU64; S],
    pub(super) occupied: [AtomicU64; 2],
    pub(super) writer: Mutex<()>,
}

impl Bucket {
    pub(super) fn new() -> Bucket {
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
    pub(super) fn occupied(&self) -> u128 {
        self.occupied[0].load(Relaxed) as u128 | (self.occupied[1].load(Relaxed) as u128) << 64
    }

    #[inline]
    pub(super) fn set_occupied(&self, bits: u128) {
        self.occupied[0].store(bits as u64, Relaxed);
        self.occupied[1].store((bits >> 64) as u64, Relaxed);
    }

    #[inline]
    pub(super) fn len(&self) -> u32 {
        self.occupied().count_ones()
    }

    #[inline]
    pub(super) fn key(&self, s: usize) -> u64 {
        self.keys[s].load(Relaxed)
    }

    #[inline]
    pub(super) fn score(&self, s: usize) -> u64 {
        self.scores[s].load(Relaxed)
    }

    #[inline]
    pub(super) fn set_score(&self, s: usize, score: u64) {
        self.scores[s].store(score, Relaxed);
    }

    #[inline]
    pub(super) fn digest(&self, s: usize) -> u8 {
        (self.digests[s / 8].load(Relaxed) >> (8 * (s % 8))) as u8
    }

    /// Writers only (the bucket mutex held): no other thread writes the word.
    #[inline]
    pub(super) fn set_digest(&self, s: usize, d: u8) {
        let w = &self.digests[s / 8];
        let sh = 8 * (s % 8);
        w.store((w.load(Relaxed) & !(0xff << sh)) | (d as u64) << sh, Relaxed);
    }

    /// Slots whose digest equals `d`, 8 at a time (SWAR): one bit per match,
    /// bit 7 of byte `i` of word `w` for slot `8w + i`, visited by `f` until it
    /// returns `Some`.
    #[inline]
    pub(super) fn scan<R>(&self, d: u8, mut f: impl FnMut(usize) -> Option<R>) -> Option<R> {
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
    pub(super) fn find(&self, key: u64, d: u8) -> Option<usize> {
        self.scan(d, |s| (self.key(s) == key).then_some(s))
    }

    #[inline]
    pub(super) fn free_slot(&self) -> Option<usize> {
        let free = !self.occupied();
        (free != 0).then(|| free.trailing_zeros() as usize)
    }

    /// The minimum-score slot of a full bucket (lowest slot on ties).
    #[inline]
    pub(super) fn min_slot(&self) -> (usize, u64) {
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
    pub(super) fn put_meta(&self, s: usize, key: u64, d: u8, score: u64) {
        self.keys[s].store(key, Relaxed);
        self.set_digest(s, d);
        self.set_score(s, score);
        self.set_occupied(self.occupied() | 1u128 << s);
    }

    #[inline]
    pub(super) fn remove(&self, s: usize) {
        self.keys[s].store(EMPTY_KEY, Relaxed);
        self.set_digest(s, EMPTY_DIGEST);
        self.set_score(s, 0);
        self.set_occupied(self.occupied() & !(1u128 << s));
    }

    /// The occupied slots, lowest first.
    #[inline]
    pub(super) fn slots(&self) -> impl Iterator<Item = usize> {
        let mut occ = self.occupied();
        std::iter::from_fn(move || {
            (occ != 0).then(|| {
                let s = occ.trailing_zeros() as usize;
                occ &= occ - 1;
                s
            })
        })
    }

    /// Calls `f` for every occupied slot.
    #[inline]
    pub(super) fn each(&self, mut f: impl FnMut(usize)) {
        let mut occ = self.occupied();
        while occ != 0 {
            f(occ.trailing_zeros() as usize);
            occ &= occ - 1;
        }
    }
}
