//! Typed device addresses: what a kernel argument points at, and how many
//! elements are there.

use std::marker::PhantomData;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::error::{Error, Result};

/// `len` elements of `T` at a device address: a view into a device buffer,
/// or into host memory mapped for the device. Only an address and a length:
/// the buffer it views must outlive every kernel given it.
pub(crate) struct DevPtr<T> {
    addr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevPtr<T> {}

impl<T> std::fmt::Debug for DevPtr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevPtr({:#x}, {})", self.addr, self.len)
    }
}

impl<T> DevPtr<T> {
    /// The whole of `s` (event tracking is off for the tables' contexts:
    /// every user synchronises its own stream).
    pub(crate) fn of(s: &CudaSlice<T>, stream: &CudaStream) -> Self {
        DevPtr { addr: s.device_ptr(stream).0, len: s.len(), _t: PhantomData }
    }

    /// The whole of `s`, when there is one.
    pub(crate) fn of_opt(s: &Option<CudaSlice<T>>, stream: &CudaStream) -> Option<Self> {
        s.as_ref().map(|s| Self::of(s, stream))
    }

    /// `len` elements at `addr` (device memory, or host memory mapped for
    /// the device, that the caller vouches for).
    pub(crate) fn from_raw(addr: u64, len: usize) -> Self {
        DevPtr { addr, len, _t: PhantomData }
    }

    /// Elements.
    pub(crate) fn len(self) -> usize {
        self.len
    }

    /// The address.
    pub(crate) fn addr(self) -> u64 {
        self.addr
    }

    /// The elements from `i` on.
    ///
    /// # Panics
    /// When `i` is past the end: a caller's bug, never an input's.
    pub(crate) fn skip(self, i: usize) -> Self {
        assert!(i <= self.len, "skipping {i} of {} elements", self.len);
        DevPtr { addr: self.addr + (i * std::mem::size_of::<T>()) as u64, len: self.len - i, _t: PhantomData }
    }

    /// The first `n` elements.
    ///
    /// # Panics
    /// When `n` is past the end.
    pub(crate) fn take(self, n: usize) -> Self {
        assert!(n <= self.len, "taking {n} of {} elements", self.len);
        DevPtr { len: n, ..self }
    }
}

/// The kernel argument for an optional buffer that must hold at least
/// `need` elements: its address, or 0 (null) when there is none; a buffer
/// too short is refused, so a kernel never runs past it.
pub(crate) fn arg<T>(what: &str, p: Option<DevPtr<T>>, need: usize) -> Result<u64> {
    match p {
        None => Ok(0),
        Some(p) if p.len >= need => Ok(p.addr),
        Some(p) => Err(Error::Config(format!("{what}: a device buffer of {} elements for {need}", p.len))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_keep_their_type_and_length_and_short_buffers_are_refused() {
        let p = DevPtr::<u64>::from_raw(0x1000, 10);
        let q = p.skip(4);
        assert_eq!((q.addr(), q.len), (0x1000 + 32, 6));
        assert_eq!(q.take(2).len, 2);
        assert_eq!(arg("keys", Some(q), 6).unwrap(), 0x1020);
        assert_eq!(arg::<u8>("flags", None, 100).unwrap(), 0);
        let e = arg("keys", Some(q), 7).unwrap_err();
        assert!(matches!(&e, crate::Error::Config(m) if m.starts_with("keys:")), "{e}");
    }

    #[test]
    #[should_panic(expected = "skipping 11 of 10")]
    fn a_view_past_the_end_is_a_bug() {
        DevPtr::<f32>::from_raw(0, 10).skip(11);
    }
}
