//! Hashing: the bucket(s) and digest of a key.
//!
//! Single mode: `h1 = fmix64(key)` (the Murmur3 64-bit finalizer);
//! bucket = `(h1 & LOW56) % buckets`; digest = `h1 >> 56`, bits the bucket
//! index never reads, so digest collisions inside a bucket stay near 1/256.
//! The digest of a free slot, [`EMPTY_DIGEST`], is never a key's: a key
//! whose top byte equals it takes that byte with its low bit flipped, so a
//! slot's digest alone says whether the slot is free.
//! Dual mode adds `h2 = fmix64(key ^ DUAL_SEED)`, an independent mix, for the
//! second bucket; the digest stays the one of `h1` in both buckets.
//! Shard choice (the daemon's router) uses [`shard_of`], a third mix.

/// Murmur3's 64-bit finalizer: full avalanche, cheap on CPU and GPU.
#[inline(always)]
pub const fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

const LOW56: u64 = (1 << 56) - 1;
/// XORed into the key before the second bucket's mix.
pub const DUAL_SEED: u64 = 0x9e37_79b9_7f4a_7c15;
/// XORed into the key before the shard mix.
pub const SHARD_SEED: u64 = 0xd6e8_feb8_6659_fd93;

/// The digest of a free slot: the top byte of `fmix64(EMPTY_KEY)`.
pub const EMPTY_DIGEST: u8 = (fmix64(crate::EMPTY_KEY) >> 56) as u8;

/// A key's digest from its hash: the top byte, never [`EMPTY_DIGEST`].
#[inline(always)]
const fn key_digest(h: u64) -> u8 {
    let d = (h >> 56) as u8;
    if d == EMPTY_DIGEST {
        d ^ 1
    } else {
        d
    }
}

/// Bucket (single mode) and digest of a key from one hash.
#[inline(always)]
pub fn locate(key: u64, buckets: u64) -> (u64, u8) {
    let h = fmix64(key);
    ((h & LOW56) % buckets, key_digest(h))
}

/// A bucket count with its reciprocal: `x % n` in two multiplications
/// instead of a 64-bit division, which on the x86 cores we run on takes
/// tens of cycles and is not pipelined (the CPU table's lookups ran 2-3×
/// slower with it). Same results as `%`, so the CPU and GPU tables agree.
#[derive(Clone, Copy, Debug)]
pub struct Buckets {
    n: u64,
    /// floor((2^64 - 1) / n).
    m: u64,
}

impl Buckets {
    /// `n` buckets (at least 1).
    pub fn new(n: u64) -> Buckets {
        assert!(n > 0, "a table has at least one bucket");
        Buckets { n, m: u64::MAX / n }
    }

    /// The bucket count.
    #[inline(always)]
    pub fn count(self) -> u64 {
        self.n
    }

    /// `x % n`. The estimate `q = x·m / 2^64` is floor(x / n) or one less
    /// (x < 2^64), so one correction makes the remainder exact.
    #[inline(always)]
    pub fn reduce(self, x: u64) -> u64 {
        let q = ((x as u128 * self.m as u128) >> 64) as u64;
        let r = x - q * self.n;
        if r >= self.n {
            r - self.n
        } else {
            r
        }
    }

    /// [`locate`] with this bucket count.
    #[inline(always)]
    pub fn locate(self, key: u64) -> (u64, u8) {
        let h = fmix64(key);
        (self.reduce(h & LOW56), key_digest(h))
    }

    /// [`bucket2`] with this bucket count, given the first bucket `b1`.
    #[inline(always)]
    pub fn bucket2(self, key: u64, b1: u64) -> u64 {
        let b2 = self.reduce(fmix64(key ^ DUAL_SEED) & LOW56);
        if b2 == b1 && self.n > 1 {
            self.reduce(b2 + 1)
        } else {
            b2
        }
    }
}

/// The digest byte of a key: the top byte of `fmix64(key)`, its low bit
/// flipped where it would equal [`EMPTY_DIGEST`].
#[inline(always)]
pub fn digest(key: u64) -> u8 {
    key_digest(fmix64(key))
}

/// The first (single-mode) bucket of a key.
#[inline(always)]
pub fn bucket1(key: u64, buckets: u64) -> u64 {
    (fmix64(key) & LOW56) % buckets
}

/// The second bucket of a key in dual mode; differs from the first whenever
/// there are at least two buckets.
#[inline(always)]
pub fn bucket2(key: u64, buckets: u64) -> u64 {
    let b1 = bucket1(key, buckets);
    let b2 = (fmix64(key ^ DUAL_SEED) & LOW56) % buckets;
    if b2 == b1 && buckets > 1 {
        (b2 + 1) % buckets
    } else {
        b2
    }
}

/// The shard (of `shards`) that owns a key, independent of both bucket hashes.
#[inline(always)]
pub fn shard_of(key: u64, shards: u64) -> u64 {
    // Multiply-shift range reduction of a third independent mix.
    ((fmix64(key ^ SHARD_SEED) as u128 * shards as u128) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fmix64_matches_murmur3_reference_values() {
        // Murmur3 fmix64 of 0 is 0; of 1 it is this well-known constant.
        assert_eq!(fmix64(0), 0);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    #[test]
    fn no_key_has_the_free_slot_digest() {
        let mut flipped = 0;
        for k in 0..1_000_000u64 {
            let raw = (fmix64(k) >> 56) as u8;
            assert_ne!(digest(k), EMPTY_DIGEST);
            assert_eq!(locate(k, 1000).1, digest(k));
            if raw == EMPTY_DIGEST {
                assert_eq!(digest(k), EMPTY_DIGEST ^ 1);
                flipped += 1;
            } else {
                assert_eq!(digest(k), raw);
            }
        }
        // About 1 key in 256 has the free-slot byte.
        assert!((3_000..5_000).contains(&flipped), "{flipped}");
    }

    #[test]
    fn reciprocal_reduction_equals_the_remainder() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let counts = [1, 2, 3, 7, 8, 1000, 8192, 8191, 1 << 20, (1 << 40) + 3, LOW56, u64::MAX / 3, u64::MAX];
        for &n in &counts {
            let b = Buckets::new(n);
            for edge in [0, 1, n - 1, n, n.wrapping_add(1), u64::MAX, u64::MAX - 1, LOW56] {
                assert_eq!(b.reduce(edge), edge % n, "{edge} % {n}");
            }
            for _ in 0..100_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                assert_eq!(b.reduce(x), x % n, "{x} % {n}");
                assert_eq!(b.locate(x), locate(x, n));
                assert_eq!(b.bucket2(x, b.locate(x).0), bucket2(x, n));
            }
        }
    }

    #[test]
    fn dual_buckets_differ() {
        for k in 0..10_000u64 {
            assert_ne!(bucket1(k, 7), bucket2(k, 7));
            assert_eq!(bucket2(k, 1), 0);
        }
    }

    #[test]
    fn shard_spread_is_even() {
        let mut counts = [0u32; 8];
        for k in 0..80_000u64 {
            counts[shard_of(k, 8) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }
}
