//! Chunks: the exported entries of one table shard, checksummed.
//!
//! Layout (little-endian): `"HKVC"`, u32 format, u32 dim, u64 n, n u64 keys,
//! n u64 scores, n × dim f32 values, u64 xxh3-64 of every preceding byte.

use crate::{Error, Result, FORMAT_VERSION};

const MAGIC: &[u8; 4] = b"HKVC";
const HEAD: usize = 4 + 4 + 4 + 8;

/// Entries of one chunk.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// f32 per value.
    pub dim: usize,
    /// Keys.
    pub keys: Vec<u64>,
    /// Scores.
    pub scores: Vec<u64>,
    /// Values, dim per key.
    pub values: Vec<f32>,
}

/// Encodes a chunk; returns the bytes and their checksum.
pub fn encode(dim: usize, keys: &[u64], scores: &[u64], values: &[f32]) -> (Vec<u8>, u64) {
    let mut b = vec![0u8; encoded_len(keys.len(), values.len())];
    let sum = encode_into(&mut b, dim, keys, scores, values);
    (b, sum)
}

/// The bytes of a chunk of `n` entries and `values` floats.
pub fn encoded_len(n: usize, values: usize) -> usize {
    HEAD + n * 16 + values * 4 + 8
}

/// Encodes a chunk into `b`, exactly [`encoded_len`] bytes long (a buffer
/// the caller reuses, aligned as it needs); returns the checksum.
pub fn encode_into(b: &mut [u8], dim: usize, keys: &[u64], scores: &[u64], values: &[f32]) -> u64 {
    let n = keys.len();
    let body = HEAD + n * 16 + values.len() * 4;
    assert_eq!(b.len(), body + 8, "encode_into: a buffer of encoded_len bytes");
    // Filled in place: a fixed-width copy per element into its own slot
    // compiles to a plain copy on little-endian hosts, where pushing
    // element by element did not (10 % of a checkpoint's CPU).
    b[..4].copy_from_slice(MAGIC);
    b[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&(dim as u32).to_le_bytes());
    b[12..20].copy_from_slice(&(n as u64).to_le_bytes());
    let (k_at, s_at, v_at) = (HEAD, HEAD + 8 * n, HEAD + 16 * n);
    for (d, k) in b[k_at..s_at].chunks_exact_mut(8).zip(keys) {
        d.copy_from_slice(&k.to_le_bytes());
    }
    for (d, s) in b[s_at..v_at].chunks_exact_mut(8).zip(scores) {
        d.copy_from_slice(&s.to_le_bytes());
    }
    for (d, v) in b[v_at..body].chunks_exact_mut(4).zip(values) {
        d.copy_from_slice(&v.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&b[..body]);
    b[body..].copy_from_slice(&sum.to_le_bytes());
    sum
}

/// Why a file of `len` bytes is not the `need` bytes its header's `what`
/// (and the checksum after it) take.
fn size_mismatch(len: usize, need: usize, what: &str) -> String {
    if len < need {
        format!("truncated: {len} bytes, where its header's {what} and the checksum take {need}")
    } else {
        format!("{len} bytes, {} more than its header's {what} and the checksum take ({need})", len - need)
    }
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// A verified chunk, read in place: its entries are decoded only as they
/// are taken ([`View::split`]), straight into the arrays they go to.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// f32 per value.
    pub dim: usize,
    /// Entries.
    pub n: usize,
    /// Every byte before the checksum.
    body: &'a [u8],
}

/// Verifies a chunk (checksum, version, length) without decoding it;
/// `expected` is the checksum the manifest recorded. Errors name checkpoint
/// `id` and chunk `key`.
pub fn verify<'a>(id: u64, key: &str, b: &'a [u8], expected: u64) -> Result<View<'a>> {
    let corrupt = |why: String| Error::CorruptChunk { id, chunk: key.to_string(), why };
    if b.len() < HEAD + 8 || &b[..4] != MAGIC {
        return Err(corrupt(format!("{} bytes, no chunk header", b.len())));
    }
    // The length first: a cut chunk's last 8 bytes are not its checksum
    // (a tester was shown a "checksum" read from the middle of the values).
    let dim = u32_at(b, 8) as usize;
    let n = u64_at(b, 12) as usize;
    let need = n.checked_mul(16 + 4 * dim).and_then(|x| x.checked_add(HEAD + 8)).unwrap_or(usize::MAX);
    if need != b.len() {
        return Err(corrupt(size_mismatch(b.len(), need, &format!("{n} entries of dim {dim}"))));
    }
    let body = &b[..b.len() - 8];
    let stored = u64_at(b, b.len() - 8);
    let actual = xxhash_rust::xxh3::xxh3_64(body);
    if actual != stored || stored != expected {
        return Err(corrupt(format!(
            "checksum {actual:016x}, chunk says {stored:016x}, manifest says {expected:016x}"
        )));
    }
    let version = u32_at(b, 4);
    if version != FORMAT_VERSION {
        return Err(corrupt(format!("format version {version}, this build reads {FORMAT_VERSION}")));
    }
    Ok(View { dim, n, body })
}

/// A chunk read into a buffer and verified ([`crate::Catalog::read_chunk_in`]):
/// its [`View`], and the buffer back for the next read.
#[derive(Debug)]
pub struct Read {
    buf: Vec<u8>,
    body: std::ops::Range<usize>,
    dim: usize,
    n: usize,
}

impl Read {
    /// Verifies the chunk at `at` in `buf` ([`verify`]) and keeps both.
    pub fn verify(id: u64, key: &str, buf: Vec<u8>, at: std::ops::Range<usize>, expected: u64) -> Result<Read> {
        let (dim, n) = {
            let v = verify(id, key, &buf[at.clone()], expected)?;
            (v.dim, v.n)
        };
        Ok(Read { buf, body: at.start..at.end - 8, dim, n })
    }

    /// The verified entries.
    pub fn view(&self) -> View<'_> {
        View { dim: self.dim, n: self.n, body: &self.buf[self.body.clone()] }
    }

    /// The buffer, for the next read.
    pub fn into_buf(self) -> Vec<u8> {
        self.buf
    }
}

impl View<'_> {
    /// The key of entry `i`.
    pub fn key(&self, i: usize) -> u64 {
        u64_at(self.body, HEAD + 8 * i)
    }

    /// Decodes the entries `keep` accepts (given each key, in chunk order)
    /// into `parts` chunks, each entry into the one `part` names (below
    /// `parts`): one pass and one copy of each entry, from the file's bytes
    /// to the arrays a table shard takes.
    pub fn split(&self, parts: usize, part: impl Fn(u64) -> usize, mut keep: impl FnMut(u64) -> bool) -> Vec<Chunk> {
        let (n, dim) = (self.n, self.dim);
        let guess = n / parts.max(1) + n / (8 * parts.max(1)) + 16;
        let mut out: Vec<Chunk> = (0..parts)
            .map(|_| Chunk {
                dim,
                keys: Vec::with_capacity(guess),
                scores: Vec::with_capacity(guess),
                values: Vec::with_capacity(guess * dim),
            })
            .collect();
        let keys = &self.body[HEAD..HEAD + 8 * n];
        let scores = &self.body[HEAD + 8 * n..HEAD + 16 * n];
        let values = &self.body[HEAD + 16 * n..];
        let rows = values.chunks_exact(4 * dim.max(1));
        for ((k, s), row) in keys.chunks_exact(8).zip(scores.chunks_exact(8)).zip(rows) {
            let k = u64::from_le_bytes(k.try_into().expect("8"));
            if !keep(k) {
                continue;
            }
            let c = &mut out[part(k)];
            c.keys.push(k);
            c.scores.push(u64::from_le_bytes(s.try_into().expect("8")));
            c.values.extend(row.chunks_exact(4).map(|v| f32::from_le_bytes(v.try_into().expect("4"))));
        }
        if dim == 0 {
            // No rows to zip with: the keys and scores alone.
            for (k, s) in keys.chunks_exact(8).zip(scores.chunks_exact(8)) {
                let k = u64::from_le_bytes(k.try_into().expect("8"));
                if keep(k) {
                    let c = &mut out[part(k)];
                    c.keys.push(k);
                    c.scores.push(u64::from_le_bytes(s.try_into().expect("8")));
                }
            }
        }
        out
    }
}

/// Verifies and decodes a chunk; `expected` is the checksum the manifest
/// recorded. Errors name checkpoint `id` and chunk `key`.
pub fn decode(id: u64, key: &str, b: &[u8], expected: u64) -> Result<Chunk> {
    let v = verify(id, key, b, expected)?;
    Ok(v.split(1, |_| 0, |_| true).pop().expect("one part"))
}

const KEYS_MAGIC: &[u8; 4] = b"HKVK";
const KEYS_HEAD: usize = 4 + 4 + 8;

/// Encodes a key list (the live keys of one shard, recorded by incremental
/// checkpoints): `"HKVK"`, u32 format, u64 n, n u64 keys, u64 xxh3-64 of
/// every preceding byte. Returns the bytes and their checksum.
pub fn encode_keys(keys: &[u64]) -> (Vec<u8>, u64) {
    let mut b = Vec::with_capacity(KEYS_HEAD + keys.len() * 8 + 8);
    b.extend_from_slice(KEYS_MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        b.extend_from_slice(&k.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    (b, sum)
}

/// Verifies and decodes a key list; errors name checkpoint `id` and `key`.
pub fn decode_keys(id: u64, key: &str, b: &[u8], expected: u64) -> Result<Vec<u64>> {
    let corrupt = |why: String| Error::CorruptChunk { id, chunk: key.to_string(), why };
    if b.len() < KEYS_HEAD + 8 || &b[..4] != KEYS_MAGIC {
        return Err(corrupt(format!("{} bytes, no key-list header", b.len())));
    }
    let n = u64_at(b, 8) as usize;
    let need = n.checked_mul(8).and_then(|x| x.checked_add(KEYS_HEAD + 8)).unwrap_or(usize::MAX);
    if need != b.len() {
        return Err(corrupt(size_mismatch(b.len(), need, &format!("a list of {n} keys"))));
    }
    let body = &b[..b.len() - 8];
    let stored = u64_at(b, b.len() - 8);
    let actual = xxhash_rust::xxh3::xxh3_64(body);
    if actual != stored || stored != expected {
        return Err(corrupt(format!(
            "checksum {actual:016x}, key list says {stored:016x}, manifest says {expected:016x}"
        )));
    }
    let version = u32_at(b, 4);
    if version != FORMAT_VERSION {
        return Err(corrupt(format!("format version {version}, this build reads {FORMAT_VERSION}")));
    }
    Ok(body[KEYS_HEAD..].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_flipped_byte_is_caught() {
        let (b, sum) = encode(2, &[1, 2], &[10, 20], &[0.5, 1.5, -2.0, f32::NAN]);
        let c = decode(7, "k", &b, sum).unwrap();
        assert_eq!((c.dim, c.keys.clone(), c.scores.clone()), (2, vec![1, 2], vec![10, 20]));
        assert_eq!(c.values[..3], [0.5, 1.5, -2.0]);
        assert!(c.values[3].is_nan());
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            let e = decode(7, "k", &bad, sum).unwrap_err();
            assert!(e.to_string().contains("chunk k"), "{e}");
        }
        assert!(decode(7, "k", &b[..b.len() - 1], sum).is_err());
        // A cut chunk says it was cut, and how much is missing.
        let e = decode(7, "k", &b[..b.len() - 5], sum).unwrap_err().to_string();
        assert!(e.contains(&format!("truncated: {} bytes", b.len() - 5)) && !e.contains("chunk says"), "{e}");
        let mut long = b.clone();
        long.push(0);
        let e = decode(7, "k", &long, sum).unwrap_err().to_string();
        assert!(e.contains("1 more than its header's 2 entries of dim 2"), "{e}");
        let (k, ksum) = encode_keys(&[1, 2, 3]);
        let e = decode_keys(7, "k", &k[..k.len() - 3], ksum).unwrap_err().to_string();
        assert!(e.contains("truncated") && e.contains("a list of 3 keys"), "{e}");
    }

    /// A view split by key parity, one key left out: each entry whole in
    /// its part, in chunk order.
    #[test]
    fn a_view_splits_entries_whole_into_parts() {
        let keys: Vec<u64> = (0..9).collect();
        let scores: Vec<u64> = keys.iter().map(|k| 100 + k).collect();
        let values: Vec<f32> = (0..27).map(|v| v as f32 * 0.5).collect();
        let (b, sum) = encode(3, &keys, &scores, &values);
        let v = verify(1, "k", &b, sum).unwrap();
        assert_eq!((v.n, v.dim, v.key(4)), (9, 3, 4));
        let parts = v.split(2, |k| (k % 2) as usize, |k| k != 5);
        assert_eq!(parts[0].keys, [0, 2, 4, 6, 8]);
        assert_eq!(parts[1].keys, [1, 3, 7]);
        for p in &parts {
            for (i, &k) in p.keys.iter().enumerate() {
                assert_eq!(p.scores[i], 100 + k);
                assert_eq!(p.values[i * 3..i * 3 + 3], values[k as usize * 3..k as usize * 3 + 3]);
            }
        }
        let (b, sum) = encode(0, &[4, 2], &[1, 2], &[]);
        let parts = verify(1, "k", &b, sum).unwrap().split(1, |_| 0, |_| true);
        assert_eq!((parts[0].keys.clone(), parts[0].scores.clone()), (vec![4, 2], vec![1, 2]));
    }

    #[test]
    fn key_lists_round_trip_and_every_flipped_byte_is_caught() {
        let (b, sum) = encode_keys(&[3, 1, u64::MAX - 9]);
        assert_eq!(decode_keys(7, "k", &b, sum).unwrap(), [3, 1, u64::MAX - 9]);
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x02;
            assert!(decode_keys(7, "k", &bad, sum).is_err(), "byte {i}");
        }
        assert!(decode_keys(7, "k", &b[..b.len() - 1], sum).is_err());
    }
}
