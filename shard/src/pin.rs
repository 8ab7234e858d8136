//! Page-locking memory this process did not allocate: a client's memfd that
//! the daemon maps (`hkv_region::Mapping`, a registered region). Registered
//! with `cuMemHostRegister(PORTABLE | DEVICEMAP)`, it is what a
//! [`crate::cuda::HostFrame`] is to the table: a find whose values lie in it
//! gets its rows copied there by the device in one transfer
//! (`CudaTable::find`), or written there over PCIe by the lookup kernel
//! (`CudaTable::find_at`), with no staging copy in between.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use hkv_region::Mapping;

use crate::error::{Error, Result};

/// A [`Mapping`] page-locked for every context; unregistered on drop,
/// before the mapping it keeps alive can be unmapped.
pub struct HostPin {
    ctx: Arc<CudaContext>,
    map: Arc<Mapping>,
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
        Ok(HostPin { ctx: dev.ctx.clone(), map })
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
