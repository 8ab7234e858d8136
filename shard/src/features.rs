//! Feature hashing: raw categorical features to table keys, bit-identical to
//! TensorFlow's string hashing ops, on the CPU (this file) and on the GPU
//! (`kernels/features.cu`, launched by [`crate::cuda::FeatureHasher`]).
//!
//! - [`HashKind::Fingerprint64`]: FarmHash Fingerprint64 (farmhashna
//!   `Hash64`), what `tf.strings.to_hash_bucket_fast` uses.
//! - [`HashKind::Strong`]: SipHash-2-4 with a 128-bit key, what
//!   `tf.strings.to_hash_bucket_strong` uses.
//!
//! A key is `hash(bytes) % num_buckets`, computed in u64. int64 features are
//! hashed as their `%lld` decimal text (TF's `as_string`), formatted into a
//! 20-byte scratch per feature. String features come as one byte buffer plus
//! `n + 1` offsets (Arrow layout): feature `i` is `bytes[offsets[i]..offsets[i+1]]`.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Which hash turns feature bytes into a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashKind {
    /// FarmHash Fingerprint64: `tf.strings.to_hash_bucket_fast`.
    Fingerprint64,
    /// SipHash-2-4 keyed by `(k0, k1)`: `tf.strings.to_hash_bucket_strong`.
    Strong {
        /// First key word.
        k0: u64,
        /// Second key word.
        k1: u64,
    },
}

impl HashKind {
    /// The wire code: 0 fingerprint64, 1 strong.
    pub fn code(self) -> u8 {
        match self {
            HashKind::Fingerprint64 => 0,
            HashKind::Strong { .. } => 1,
        }
    }
}

/// A batch of raw features.
#[derive(Debug, Clone, Copy)]
pub enum Features<'a> {
    /// int64 features, hashed as `%lld` decimal text.
    Int64(&'a [i64]),
    /// Strings: feature `i` is `bytes[offsets[i] .. offsets[i + 1]]`.
    Strings {
        /// Every feature's bytes, back to back.
        bytes: &'a [u8],
        /// `n + 1` offsets into `bytes`, non-decreasing.
        offsets: &'a [u32],
    },
}

impl Features<'_> {
    /// Number of features.
    pub fn len(&self) -> usize {
        match self {
            Features::Int64(v) => v.len(),
            Features::Strings { offsets, .. } => offsets.len().saturating_sub(1),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the offsets: `n + 1` of them (none for an empty batch),
    /// non-decreasing, the last within the buffer.
    pub fn validate(&self) -> Result<()> {
        let Features::Strings { bytes, offsets } = self else { return Ok(()) };
        if offsets.is_empty() {
            return Ok(());
        }
        if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(Error::Features(format!(
                "string offsets must not decrease: offsets[{}] = {} < offsets[{i}] = {}",
                i + 1,
                offsets[i + 1],
                offsets[i]
            )));
        }
        let last = *offsets.last().expect("not empty") as usize;
        if last > bytes.len() {
            return Err(Error::Features(format!(
                "string offsets reach byte {last}, past the {}-byte buffer",
                bytes.len()
            )));
        }
        Ok(())
    }
}

/// Checks a bucket count: 1 ..= [`crate::RESERVED_KEY_MIN`], so that no key
/// is ever a reserved marker.
pub fn check_buckets(num_buckets: u64) -> Result<()> {
    if num_buckets == 0 {
        return Err(Error::Features("num_buckets must be at least 1".into()));
    }
    if num_buckets > crate::RESERVED_KEY_MIN {
        return Err(Error::Features(format!(
            "num_buckets {num_buckets} is above {}: such keys would collide with reserved markers",
            crate::RESERVED_KEY_MIN
        )));
    }
    Ok(())
}

const K0: u64 = 0xc3a5_c85c_97cb_3127;
const K1: u64 = 0xb492_b66f_be98_f273;
const K2: u64 = 0x9ae1_6a3b_2f90_404f;

#[inline(always)]
fn fetch64(s: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(s[i..i + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn fetch32(s: &[u8], i: usize) -> u64 {
    u32::from_le_bytes(s[i..i + 4].try_into().expect("4 bytes")) as u64
}

#[inline(always)]
fn shift_mix(v: u64) -> u64 {
    v ^ (v >> 47)
}

#[inline(always)]
fn len16(u: u64, v: u64, mul: u64) -> u64 {
    let a = shift_mix((u ^ v).wrapping_mul(mul));
    let b = shift_mix((v ^ a).wrapping_mul(mul));
    b.wrapping_mul(mul)
}

fn len0to16(s: &[u8]) -> u64 {
    let n = s.len();
    if n >= 8 {
        let mul = K2.wrapping_add(n as u64 * 2);
        let a = fetch64(s, 0).wrapping_add(K2);
        let b = fetch64(s, n - 8);
        let c = b.rotate_right(37).wrapping_mul(mul).wrapping_add(a);
        let d = a.rotate_right(25).wrapping_add(b).wrapping_mul(mul);
        return len16(c, d, mul);
    }
    if n >= 4 {
        let mul = K2.wrapping_add(n as u64 * 2);
        let a = fetch32(s, 0);
        return len16((n as u64).wrapping_add(a << 3), fetch32(s, n - 4), mul);
    }
    if n > 0 {
        let (a, b, c) = (s[0] as u32, s[n >> 1] as u32, s[n - 1] as u32);
        let y = a.wrapping_add(b << 8);
        let z = (n as u32).wrapping_add(c << 2);
        return shift_mix((y as u64).wrapping_mul(K2) ^ (z as u64).wrapping_mul(K0)).wrapping_mul(K2);
    }
    K2
}

fn len17to32(s: &[u8]) -> u64 {
    let n = s.len();
    let mul = K2.wrapping_add(n as u64 * 2);
    let a = fetch64(s, 0).wrapping_mul(K1);
    let b = fetch64(s, 8);
    let c = fetch64(s, n - 8).wrapping_mul(mul);
    let d = fetch64(s, n - 16).wrapping_mul(K2);
    len16(
        a.wrapping_add(b).rotate_right(43).wrapping_add(c.rotate_right(30)).wrapping_add(d),
        a.wrapping_add(b.wrapping_add(K2).rotate_right(18)).wrapping_add(c),
        mul,
    )
}

fn len33to64(s: &[u8]) -> u64 {
    let n = s.len();
    let mul = K2.wrapping_add(n as u64 * 2);
    let a = fetch64(s, 0).wrapping_mul(K2);
    let b = fetch64(s, 8);
    let c = fetch64(s, n - 8).wrapping_mul(mul);
    let d = fetch64(s, n - 16).wrapping_mul(K2);
    let y = a.wrapping_add(b).rotate_right(43).wrapping_add(c.rotate_right(30)).wrapping_add(d);
    let z = len16(y, a.wrapping_add(b.wrapping_add(K2).rotate_right(18)).wrapping_add(c), mul);
    let e = fetch64(s, 16).wrapping_mul(mul);
    let f = fetch64(s, 24);
    let g = y.wrapping_add(fetch64(s, n - 32)).wrapping_mul(mul);
    let h = z.wrapping_add(fetch64(s, n - 24)).wrapping_mul(mul);
    len16(
        e.wrapping_add(f).rotate_right(43).wrapping_add(g.rotate_right(30)).wrapping_add(h),
        e.wrapping_add(f.wrapping_add(a).rotate_right(18)).wrapping_add(g),
        mul,
    )
}

#[inline(always)]
fn weak32(s: &[u8], i: usize, mut a: u64, mut b: u64) -> (u64, u64) {
    let (w, x, y, z) = (fetch64(s, i), fetch64(s, i + 8), fetch64(s, i + 16), fetch64(s, i + 24));
    a = a.wrapping_add(w);
    b = b.wrapping_add(a).wrapping_add(z).rotate_right(21);
    let c = a;
    a = a.wrapping_add(x).wrapping_add(y);
    b = b.wrapping_add(a.rotate_right(44));
    (a.wrapping_add(z), b.wrapping_add(c))
}

/// FarmHash Fingerprint64 (farmhashna `Hash64`) of `s`.
pub fn fingerprint64(s: &[u8]) -> u64 {
    let n = s.len();
    if n <= 16 {
        return len0to16(s);
    }
    if n <= 32 {
        return len17to32(s);
    }
    if n <= 64 {
        return len33to64(s);
    }
    const SEED: u64 = 81;
    let mut x = SEED;
    let mut y = SEED.wrapping_mul(K1).wrapping_add(113);
    let mut z = shift_mix(y.wrapping_mul(K2).wrapping_add(113)).wrapping_mul(K2);
    let (mut v, mut w) = ((0u64, 0u64), (0u64, 0u64));
    x = x.wrapping_mul(K2).wrapping_add(fetch64(s, 0));
    let end = ((n - 1) / 64) * 64;
    let last64 = end + ((n - 1) & 63) - 63;
    let mut p = 0;
    loop {
        x = x.wrapping_add(y).wrapping_add(v.0).wrapping_add(fetch64(s, p + 8)).rotate_right(37).wrapping_mul(K1);
        y = y.wrapping_add(v.1).wrapping_add(fetch64(s, p + 48)).rotate_right(42).wrapping_mul(K1);
        x ^= w.1;
        y = y.wrapping_add(v.0).wrapping_add(fetch64(s, p + 40));
        z = z.wrapping_add(w.0).rotate_right(33).wrapping_mul(K1);
        v = weak32(s, p, v.1.wrapping_mul(K1), x.wrapping_add(w.0));
        w = weak32(s, p + 32, z.wrapping_add(w.1), y.wrapping_add(fetch64(s, p + 16)));
        std::mem::swap(&mut z, &mut x);
        p += 64;
        if p == end {
            break;
        }
    }
    let mul = K1.wrapping_add((z & 0xff) << 1);
    let p = last64;
    w.0 = w.0.wrapping_add(((n - 1) & 63) as u64);
    v.0 = v.0.wrapping_add(w.0);
    w.0 = w.0.wrapping_add(v.0);
    x = x.wrapping_add(y).wrapping_add(v.0).wrapping_add(fetch64(s, p + 8)).rotate_right(37).wrapping_mul(mul);
    y = y.wrapping_add(v.1).wrapping_add(fetch64(s, p + 48)).rotate_right(42).wrapping_mul(mul);
    x ^= w.1.wrapping_mul(9);
    y = y.wrapping_add(v.0.wrapping_mul(9)).wrapping_add(fetch64(s, p + 40));
    z = z.wrapping_add(w.0).rotate_right(33).wrapping_mul(mul);
    v = weak32(s, p, v.1.wrapping_mul(mul), x.wrapping_add(w.0));
    w = weak32(s, p + 32, z.wrapping_add(w.1), y.wrapping_add(fetch64(s, p + 16)));
    std::mem::swap(&mut z, &mut x);
    len16(
        len16(v.0, w.0, mul).wrapping_add(shift_mix(y).wrapping_mul(K0)).wrapping_add(z),
        len16(v.1, w.1, mul).wrapping_add(x),
        mul,
    )
}

/// SipHash-2-4 of `s` keyed by `(k0, k1)`.
pub fn siphash24(k0: u64, k1: u64, s: &[u8]) -> u64 {
    #[inline(always)]
    fn round(v: &mut [u64; 4]) {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let full = s.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        let m = fetch64(s, i);
        v[3] ^= m;
        round(&mut v);
        round(&mut v);
        v[0] ^= m;
    }
    let mut last = (s.len() as u64) << 56;
    for (j, &b) in s[full..].iter().enumerate() {
        last |= (b as u64) << (8 * j);
    }
    v[3] ^= last;
    round(&mut v);
    round(&mut v);
    v[0] ^= last;
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// Writes `x` as `%lld` decimal text into `buf`; returns the length (1 to 20).
pub fn format_i64(x: i64, buf: &mut [u8; 20]) -> usize {
    let mut u = x.unsigned_abs();
    let mut tmp = [0u8; 20];
    let mut n = 0;
    loop {
        tmp[n] = b'0' + (u % 10) as u8;
        n += 1;
        u /= 10;
        if u == 0 {
            break;
        }
    }
    let mut len = 0;
    if x < 0 {
        buf[0] = b'-';
        len = 1;
    }
    for j in (0..n).rev() {
        buf[len] = tmp[j];
        len += 1;
    }
    len
}

/// The hash of one byte string.
#[inline]
pub fn hash_bytes(kind: HashKind, s: &[u8]) -> u64 {
    match kind {
        HashKind::Fingerprint64 => fingerprint64(s),
        HashKind::Strong { k0, k1 } => siphash24(k0, k1, s),
    }
}

/// The key of one int64 feature.
#[inline]
pub fn key_of_i64(kind: HashKind, x: i64, num_buckets: u64) -> u64 {
    let mut buf = [0u8; 20];
    let n = format_i64(x, &mut buf);
    hash_bytes(kind, &buf[..n]) % num_buckets
}

/// Features per rayon task when hashing on the CPU.
const CPU_CHUNK: usize = 16 * 1024;

/// Hashes a batch on the CPU into `out` (one key per feature), on every core
/// when `parallel` (else on the calling thread). Checks the input first.
pub fn hash_features_cpu(
    features: Features<'_>,
    kind: HashKind,
    num_buckets: u64,
    out: &mut [u64],
    parallel: bool,
) -> Result<()> {
    check_buckets(num_buckets)?;
    features.validate()?;
    if out.len() != features.len() {
        return Err(Error::Length {
            what: "keys",
            expected: features.len(),
            got: out.len(),
            detail: "one key per feature".into(),
        });
    }
    let one = |base: usize, chunk: &mut [u64]| match features {
        Features::Int64(v) => {
            for (o, &x) in chunk.iter_mut().zip(&v[base..]) {
                *o = key_of_i64(kind, x, num_buckets);
            }
        }
        Features::Strings { bytes, offsets } => {
            for (j, o) in chunk.iter_mut().enumerate() {
                let i = base + j;
                *o = hash_bytes(kind, &bytes[offsets[i] as usize..offsets[i + 1] as usize]) % num_buckets;
            }
        }
    };
    if parallel && out.len() > CPU_CHUNK {
        out.par_chunks_mut(CPU_CHUNK).enumerate().for_each(|(c, chunk)| one(c * CPU_CHUNK, chunk));
    } else {
        one(0, out);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensorflow_vectors() {
        let want = [12917804110809363939u64, 11795596070477164822, 11430444447143000872, 4470636696479570465];
        for (s, w) in ["a", "b", "c", "d"].iter().zip(want) {
            assert_eq!(fingerprint64(s.as_bytes()), w, "{s}");
        }
    }

    #[test]
    fn siphash_reference_vector() {
        // The SipHash paper's vector: key 00..0f, message 00..0e.
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let m: Vec<u8> = (0..15).collect();
        assert_eq!(siphash24(k0, k1, &m), 0xa129_ca61_49be_45e5);
        #[allow(deprecated)]
        for len in 0..40 {
            use std::hash::Hasher;
            let m: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37)).collect();
            let mut h = std::hash::SipHasher::new_with_keys(7, 99);
            h.write(&m);
            assert_eq!(siphash24(7, 99, &m), h.finish(), "len {len}");
        }
    }

    #[test]
    fn int64_text_is_printf_lld() {
        let mut b = [0u8; 20];
        for x in [0i64, -1, 1, 9, 10, -10, 99, 100, 123456789, -987654321012, i64::MIN, i64::MAX] {
            let n = format_i64(x, &mut b);
            assert_eq!(std::str::from_utf8(&b[..n]).unwrap(), x.to_string());
        }
        assert_eq!(format_i64(i64::MIN, &mut b), 20);
    }

    #[test]
    fn bad_input_is_refused() {
        let mut out = [0u64; 2];
        let bytes = b"abcdef";
        let f = |offsets| Features::Strings { bytes, offsets };
        assert!(hash_features_cpu(f(&[0, 3, 2]), HashKind::Fingerprint64, 10, &mut out, false).is_err());
        assert!(hash_features_cpu(f(&[0, 3, 7]), HashKind::Fingerprint64, 10, &mut out, false).is_err());
        assert!(hash_features_cpu(f(&[0, 3, 6]), HashKind::Fingerprint64, 0, &mut out, false).is_err());
        assert!(hash_features_cpu(f(&[0, 3, 6]), HashKind::Fingerprint64, u64::MAX, &mut out, false).is_err());
        hash_features_cpu(f(&[0, 3, 6]), HashKind::Fingerprint64, 1000, &mut out, false).unwrap();
        assert_eq!(out, [fingerprint64(b"abc") % 1000, fingerprint64(b"def") % 1000]);
    }
}
