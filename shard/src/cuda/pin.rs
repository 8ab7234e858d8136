//! Page-locking memory this process did not allocate: a client's memfd that
//! the daemon maps (`hkv_region::Mapping`, a registered region). Registered
//! with `cuMemHostRegister(PORTABLE | DEVICEMAP)`, it is what a
//! [`crate::cuda::HostFrame`] is to the table: rows in it are handed to a
//! find as [`Rows::Pinned`] ([`HostPin::rows`]), so the device copies them
//! there in one transfer (`find_into`), or the lookup kernel writes them
//! there over PCIe (`find_at`), with no staging copy in between.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use hkv_region::Mapping;

use super::{device_address_of_host, PinnedRows};
use crate::error::{Error, Result};
use crate::Rows;

/// A [`Mapping`] page-locked for every context; unregistered on drop,
/// before the mapping it keeps alive can be unmapped.
pub struct HostPin {
    ctx: Arc<CudaContext>,
    map: Arc<Mapping>,
    /// The mapping's address for kernels, asked of the driver once at
    /// registration; None where it gave none (rows then go through staging).
    device: Option<u64>,
}

impl HostPin {
    /// Page-locks the whole of `map` in device `ordinal`'s context (mapped
    /// for every device: `PORTABLE | DEVICEMAP`).
    pub fn new(ordinal: usize, map: Arc<Mapping>) -> Result<HostPin> {
        let dev = crate::cuda::shared_device(ordinal)?;
        dev.ctx.bind_to_thread().map_err(crate::cuda::dev_err("binding the device's context"))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the range is the whole of `map`, a live mapping that this
        // pin keeps alive (its Arc) until `drop` has unregistered the range;
        // the driver only pins its pages and records its device address.
        let r = unsafe { sys::cuMemHostRegister_v2(map.addr() as *mut std::ffi::c_void, map.len(), flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Device(format!(
                "cuMemHostRegister of a {}-byte region failed ({r:?}); the region works unpinned",
                map.len()
            )));
        }
        let device = device_address_of_host(map.addr() as *const u8, map.len());
        Ok(HostPin { ctx: dev.ctx.clone(), map, device })
    }

    /// `values` as a find's destination: [`Rows::Pinned`] when they lie
    /// within this pinned mapping and the driver gave it a device address,
    /// else [`Rows::Host`].
    pub fn rows<'a>(&self, values: &'a mut [f32]) -> Rows<'a> {
        let start = values.as_ptr() as usize;
        let base = self.map.addr();
        let inside = start >= base
            && start.is_multiple_of(4)
            && std::mem::size_of_val(values).checked_add(start - base).is_some_and(|end| end <= self.map.len());
        match self.device {
            Some(d) if inside => {
                let device = d + (start - base) as u64;
                // SAFETY: `values` lies within the mapping this pin has
                // page-locked and device-mapped (checked just above) and
                // keeps registered while the pin lives, which the caller's
                // borrow of the mapped memory outlasts (the pin is dropped
                // only with the region, after its requests); `device` is
                // that range's address for kernels (the mapping's, offset).
                Rows::Pinned(unsafe { PinnedRows::registered(values, device) })
            }
            _ => Rows::Host(values),
        }
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the range registered in `new`, unregistered once, while
        // `self.map` still holds it mapped.
        let _ = unsafe { sys::cuMemHostUnregister(self.map.addr() as *mut std::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows inside a pinned region go to finds as pinned rows; memory
    /// outside it as ordinary rows.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn rows_inside_a_pinned_region_are_pinned() {
        let fd = hkv_region::create_memfd("hkv-pin-test", 1 << 16).unwrap();
        let map = Mapping::map(&fd, 1 << 16).unwrap();
        let pin = HostPin::new(0, map.clone()).unwrap();
        let mut claim = map.claim_mut::<f32>(4096, 1024).unwrap();
        assert!(matches!(pin.rows(claim.as_mut_slice()), Rows::Pinned(_)));
        let mut other = vec![0f32; 16];
        assert!(matches!(pin.rows(&mut other), Rows::Host(_)));
    }
}
