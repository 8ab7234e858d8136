//! # hkv-region: memory shared by hkvd and a client process
//!
//! A client registers a sealed memfd on its connection (`proto/PROTOCOL.md`,
//! "Registered regions"); both sides map it shared, read-write. This crate
//! is the one place with the `unsafe` that such a mapping needs, so that the
//! daemon and the client crates keep `#![forbid(unsafe_code)]`.
//!
//! The memory is written by another process at any time: every access here
//! treats it as plain bytes (any bit pattern is a valid `u8`, `u32`, `u64`
//! or `f32`), so a client racing its own region can garble its own
//! answers, never the daemon. Views that Rust code holds as slices are
//! *claims*: a range of the mapping checked out for one request, which no
//! other claim in this process overlaps while it lives (shared claims may
//! overlap each other), so no two slices this process holds alias.
//!
//! # Layout
//! - this file: [`Mapping`] (mmap / munmap, bytes copied in and out), the
//!   claims [`Claim`] and [`ClaimMut`], [`create_memfd`] for clients.
//! - [`cuda`]: the client's side of CUDA IPC: [`cuda::export_memory`] (the
//!   allocation holding a device pointer, as register_cuda sends it),
//!   [`cuda::IpcEvent`], [`cuda::DeviceAlloc`] (exportable device memory).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cuda;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// A shared read-write mapping of a whole file (a memfd), unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// Byte ranges claimed now: (start, end, exclusive).
    claims: Mutex<Vec<(usize, usize, bool)>>,
}

// SAFETY: the mapping is plain shared memory; every access goes through
// byte copies or claims whose ranges are tracked under the mutex, so
// sharing the pointer between threads creates no aliasing `&mut`.
unsafe impl Send for Mapping {}
// SAFETY: as for Send.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

/// Why a claim was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    /// The range is not inside the mapping (or its end overflows).
    OutOfBounds,
    /// The offset is not a multiple of the element's alignment.
    Misaligned,
    /// Another claim in use overlaps it (a write claim overlaps anything).
    Busy,
}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared, read-write. `len` must be
    /// above 0 and within the file: the caller checks the size and that the
    /// file cannot shrink (a memfd sealed with `F_SEAL_SHRINK`), since a
    /// page past the end of the file faults with SIGBUS.
    pub fn map(fd: impl AsFd, len: usize) -> std::io::Result<Arc<Mapping>> {
        use rustix::mm::{MapFlags, ProtFlags};
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "cannot map 0 bytes"));
        }
        // SAFETY: a fresh mapping at an address the kernel picks: it aliases
        // no Rust object. The file's size was checked by the caller and it
        // cannot shrink (sealed), so every page of [ptr, ptr + len) stays
        // backed for the mapping's life.
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0)?
        };
        Ok(Arc::new(Mapping { ptr: ptr.cast(), len, claims: Mutex::new(Vec::new()) }))
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: [`Mapping::map`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte (for page-locking it, or telling it apart).
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// The byte range `[off, off + count * size_of::<T>())`, checked.
    fn range<T>(&self, off: u64, count: u64) -> Result<(usize, usize), ClaimError> {
        let size = std::mem::size_of::<T>() as u64;
        let bytes = count.checked_mul(size).ok_or(ClaimError::OutOfBounds)?;
        let end = off.checked_add(bytes).ok_or(ClaimError::OutOfBounds)?;
        if end > self.len as u64 {
            return Err(ClaimError::OutOfBounds);
        }
        if !off.is_multiple_of(std::mem::align_of::<T>() as u64) {
            return Err(ClaimError::Misaligned);
        }
        Ok((off as usize, end as usize))
    }

    /// Checks that `count` elements of `T` at byte `off` lie in the mapping,
    /// aligned, without claiming them.
    pub fn check<T>(&self, off: u64, count: u64) -> Result<(), ClaimError> {
        self.range::<T>(off, count).map(|_| ())
    }

    fn claim_range(self: &Arc<Self>, start: usize, end: usize, exclusive: bool) -> Result<(), ClaimError> {
        let mut c = self.claims.lock();
        let overlaps = |&(s, e, x): &(usize, usize, bool)| s < end && start < e && (x || exclusive);
        if start < end && c.iter().any(overlaps) {
            return Err(ClaimError::Busy);
        }
        c.push((start, end, exclusive));
        Ok(())
    }

    fn release(&self, start: usize, end: usize, exclusive: bool) {
        let mut c = self.claims.lock();
        if let Some(i) = c.iter().position(|&r| r == (start, end, exclusive)) {
            c.swap_remove(i);
        }
    }

    /// Claims `count` elements of `T` at byte `off` for writing: no other
    /// claim may overlap them while the returned one lives.
    pub fn claim_mut<T>(self: &Arc<Self>, off: u64, count: u64) -> Result<ClaimMut<T>, ClaimError> {
        let (start, end) = self.range::<T>(off, count)?;
        self.claim_range(start, end, true)?;
        Ok(ClaimMut { map: self.clone(), start, end, _t: std::marker::PhantomData })
    }

    /// Claims `count` elements of `T` at byte `off` for reading: write claims
    /// may not overlap them while the returned one lives.
    pub fn claim<T>(self: &Arc<Self>, off: u64, count: u64) -> Result<Claim<T>, ClaimError> {
        let (start, end) = self.range::<T>(off, count)?;
        self.claim_range(start, end, false)?;
        Ok(Claim { map: self.clone(), start, end, _t: std::marker::PhantomData })
    }

    /// Copies `dst.len()` elements from byte `off` into `dst`.
    pub fn read<T: FromBytes + IntoBytes>(&self, off: u64, dst: &mut [T]) -> Result<(), ClaimError> {
        let (start, end) = self.range::<u8>(off, std::mem::size_of_val(dst) as u64)?;
        let claims = self.claims.lock();
        if claims.iter().any(|&(s, e, x)| x && s < end && start < e) {
            return Err(ClaimError::Busy);
        }
        let out = dst.as_mut_bytes();
        // SAFETY: [start, end) lies in the mapping (checked) and no write
        // claim overlaps it while the lock is held; `out` is this
        // process's own memory, not inside the mapping (a Rust allocation
        // never overlaps an mmap this crate made). Another process may write
        // the source meanwhile: the bytes copied are then some mix of old
        // and new, valid for any `FromBytes` type.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(start), out.as_mut_ptr(), end - start) };
        Ok(())
    }

    /// Copies `src` to byte `off`.
    pub fn write<T: IntoBytes + Immutable>(&self, off: u64, src: &[T]) -> Result<(), ClaimError> {
        let bytes = src.as_bytes();
        let (start, end) = self.range::<u8>(off, bytes.len() as u64)?;
        let claims = self.claims.lock();
        if claims.iter().any(|&(s, e, _)| s < end && start < e) {
            return Err(ClaimError::Busy);
        }
        // SAFETY: [start, end) lies in the mapping and no claim (no slice
        // this process holds) overlaps it while the lock is held; `bytes` is
        // not inside the mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(start), end - start) };
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no claim
        // outlives it (each holds an Arc of it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// A range of a [`Mapping`] claimed for writing (see [`Mapping::claim_mut`]).
pub struct ClaimMut<T> {
    map: Arc<Mapping>,
    start: usize,
    end: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: FromBytes + IntoBytes> ClaimMut<T> {
    /// The claimed elements.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        let n = (self.end - self.start) / std::mem::size_of::<T>().max(1);
        // SAFETY: [start, end) lies in the mapping, aligned for T (checked
        // at claim time; the mapping starts on a page), and no other claim
        // overlaps it while this one lives, so this is the only slice over
        // those bytes in this process. Any bit pattern is a valid T
        // (FromBytes), so a client writing them meanwhile cannot make the
        // slice hold an invalid value.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.add(self.start).cast::<T>(), n) }
    }
}

impl<T> Drop for ClaimMut<T> {
    fn drop(&mut self) {
        self.map.release(self.start, self.end, true);
    }
}

/// A range of a [`Mapping`] claimed for reading (see [`Mapping::claim`]).
pub struct Claim<T> {
    map: Arc<Mapping>,
    start: usize,
    end: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: FromBytes + Immutable> Claim<T> {
    /// The claimed elements.
    pub fn as_slice(&self) -> &[T] {
        let n = (self.end - self.start) / std::mem::size_of::<T>().max(1);
        // SAFETY: as in `ClaimMut::as_mut_slice`; only shared claims may
        // overlap this one, so no `&mut` of this process aliases it.
        unsafe { std::slice::from_raw_parts(self.map.ptr.add(self.start).cast::<T>(), n) }
    }
}

impl<T> Drop for Claim<T> {
    fn drop(&mut self) {
        self.map.release(self.start, self.end, false);
    }
}

/// A memfd of `len` bytes sealed against shrinking and growing (what hkvd
/// requires of a registered region), close-on-exec.
pub fn create_memfd(name: &str, len: u64) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_check_bounds_alignment_and_overlap() {
        let fd = create_memfd("t", 4096).unwrap();
        let m = Mapping::map(&fd, 4096).unwrap();
        assert_eq!(m.claim_mut::<u64>(4, 1).err(), Some(ClaimError::Misaligned));
        assert_eq!(m.claim_mut::<u64>(4096, 1).err(), Some(ClaimError::OutOfBounds));
        assert_eq!(m.claim_mut::<u64>(8, u64::MAX).err(), Some(ClaimError::OutOfBounds));
        assert_eq!(m.claim::<u8>(u64::MAX, 2).err(), Some(ClaimError::OutOfBounds));
        let mut a = m.claim_mut::<f32>(0, 16).unwrap();
        assert_eq!(m.claim::<u8>(60, 8).err(), Some(ClaimError::Busy));
        let r1 = m.claim::<u8>(64, 8).unwrap();
        let r2 = m.claim::<u8>(64, 8).unwrap();
        assert_eq!(m.claim_mut::<u8>(70, 1).err(), Some(ClaimError::Busy));
        a.as_mut_slice()[15] = 2.5;
        drop(a);
        let mut back = [0f32; 1];
        m.read(60, &mut back).unwrap();
        assert_eq!(back[0], 2.5);
        assert_eq!(m.write(64, &[1u8]).err(), Some(ClaimError::Busy));
        drop((r1, r2));
        m.write(64, &[7u64]).unwrap();
        assert_eq!(m.claim::<u64>(64, 1).unwrap().as_slice(), &[7]);
        // A second mapping of the same file sees the same bytes.
        let m2 = Mapping::map(&fd, 4096).unwrap();
        let mut v = [0u64];
        m2.read(64, &mut v).unwrap();
        assert_eq!(v[0], 7);
        assert!(rustix::fs::ftruncate(&fd, 100).is_err(), "sealed against shrinking");
    }
}
