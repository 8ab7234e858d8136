//! The storage of one table size: the buckets and the value array
//! addressed by position.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::bucket::Bucket;
use super::{LINE_FLOATS, S};
use crate::error::{Error, Result};
use crate::hash::Buckets;

pub(super) struct Storage {
    pub(super) buckets: Vec<Bucket>,
    /// `nbuckets * 128 * dim` floats (as bits), addressed by position,
    /// from element `skew` on.
    pub(super) values: Vec<AtomicU32>,
    /// The first element of row 0, at a 64-byte boundary of `values`: a
    /// row of 16 or 32 floats then spans one or two cache lines, not two
    /// or three (large allocations start 16 bytes past a page boundary),
    /// and the lookup pipeline's touches reach every line of it.
    pub(super) skew: usize,
    /// The bucket count with its reciprocal, for the bucket of a key.
    pub(super) div: Buckets,
    pub(super) dim: usize,
}

/// Bytes of one bucket in host memory (digests, keys, scores, bitmap,
/// mutex), which the config's footprint counts.
pub use crate::config::CPU_BUCKET_BYTES as BUCKET_BYTES;
const _: () =
    assert!(std::mem::size_of::<Bucket>() as u64 == BUCKET_BYTES, "config::CPU_BUCKET_BYTES is a bucket's size");

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

/// Value arrays up to this size are faulted in when the table is made
/// ([`commit`]); larger ones on first touch. On the 2-core development
/// machine (a virtual machine) faulting in 2.4 GB took 5.9 s, too long for
/// a create-table answered at once; a table of 2 × 25.6 MB was made in
/// 0.13 s.
const COMMIT_MAX: usize = 128 << 20;

/// Faults in the pages of a value array of at most [`COMMIT_MAX`] bytes
/// now, in one call, so that the table's memory is taken when the table
/// is made: a host short of memory refuses the table (`out_of_memory`)
/// instead of the daemon failing at some later insert, and the first
/// batches into a fresh table do not pay a page fault per 4 KiB of rows
/// (on a virtual machine that hands freed pages back to its host, each
/// such fault is also one on the host). Kernels before 5.14 lack the call:
/// their pages are faulted in on first touch, as larger arrays' are.
#[allow(unsafe_code)]
fn commit(values: &[AtomicU32]) -> Result<()> {
    const PAGE: usize = 4096;
    let (start, len) = (values.as_ptr() as usize, std::mem::size_of_val(values));
    if len > COMMIT_MAX {
        return Ok(());
    }
    let first = start.next_multiple_of(PAGE);
    let end = (start + len) / PAGE * PAGE;
    if end <= first {
        return Ok(());
    }
    // SAFETY: the range lies inside `values`' allocation, which this
    // process owns; populating pages changes no byte of it (fresh pages
    // read zero, and pages already present are left as they are).
    let r = unsafe { rustix::mm::madvise(first as *mut _, end - first, rustix::mm::Advice::LinuxPopulateWrite) };
    match r {
        Err(rustix::io::Errno::NOMEM) => {
            Err(Error::OutOfMemory(format!("table values: {len} bytes could not be taken from this host's memory")))
        }
        _ => Ok(()),
    }
}

impl Storage {
    pub(super) fn new(nbuckets: u64, dim: usize) -> Result<Storage> {
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
        commit(&values)?;
        let skew = (values.as_ptr() as usize).wrapping_neg() % 64 / 4;
        let buckets = try_vec(n, "table buckets", Bucket::new)?;
        Ok(Storage { buckets, values, skew, div: Buckets::new(nbuckets), dim })
    }

    pub(super) fn nbuckets(&self) -> u64 {
        self.div.count()
    }

    #[inline]
    pub(super) fn row(&self, b: usize, s: usize) -> &[AtomicU32] {
        let o = self.skew + (b * S + s) * self.dim;
        &self.values[o..o + self.dim]
    }

    #[inline]
    pub(super) fn read_row(&self, b: usize, s: usize, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.row(b, s)) {
            *o = f32::from_bits(v.load(Relaxed));
        }
    }

    #[inline]
    pub(super) fn write_row(&self, b: usize, s: usize, src: &[f32]) {
        for (v, x) in self.row(b, s).iter().zip(src) {
            v.store(x.to_bits(), Relaxed);
        }
    }

    #[inline]
    pub(super) fn add_row(&self, b: usize, s: usize, delta: &[f32]) {
        for (v, x) in self.row(b, s).iter().zip(delta) {
            v.store((f32::from_bits(v.load(Relaxed)) + x).to_bits(), Relaxed);
        }
    }

    pub(super) fn push_row(&self, b: usize, s: usize, out: &mut Vec<f32>) {
        out.extend(self.row(b, s).iter().map(|v| f32::from_bits(v.load(Relaxed))));
    }
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
