//! The CUDA module: finding devices without ever panicking, compiling the
//! kernels of `hkv-kernels` with NVRTC for the device's architecture (with
//! an on-disk cache keyed by source hash, architecture and driver version),
//! and typed wrappers around kernel launches.
//!
//! The table itself is [`crate::cuda::table::CudaTable`]; [`shared_device`]
//! opens each device once per process for every table on it.
//!
//! cudarc is loaded dynamically: without a driver library, its first call
//! would panic, so [`probe`] asks `is_culib_present` first and reports a
//! clear error instead.

pub mod group;
pub(crate) mod staging;
pub mod table;

mod device;
mod hasher;
mod host_frame;
pub mod ipc;
pub mod pin;
mod ptr;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};
use hkv_kernels::KernelId;

use crate::error::{Error, Result};
use crate::features::{Features, HashKind};
pub use device::*;
pub use hasher::*;
pub use host_frame::*;
pub(crate) use ptr::{arg, DevPtr};

/// A one-dimensional launch of `threads` threads in blocks of `block`;
/// refused when the grid would pass CUDA's limit of 2^31 − 1 blocks.
pub(crate) fn grid(threads: u64, block: u32) -> Result<LaunchConfig> {
    let blocks = threads.div_ceil(u64::from(block)).max(1);
    match u32::try_from(blocks) {
        Ok(x) if x <= i32::MAX as u32 => {
            Ok(LaunchConfig { grid_dim: (x, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 })
        }
        _ => Err(Error::Config(format!(
            "a launch of {threads} threads needs {blocks} blocks of {block}, above CUDA's 2^31 - 1: use smaller batches or tables"
        ))),
    }
}

pub(crate) fn dev_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e:?}"))
}

/// [`dev_err`] for an allocation: the device (or the pinned host memory it
/// maps) out of memory is [`Error::OutOfMemory`], which a client is told
/// as a lack of resources, not as a failure of the device.
pub(crate) fn alloc_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| match e.0 {
        cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory(format!("{what}: {e:?}")),
        _ => Error::Device(format!("{what}: {e:?}")),
    }
}

/// Grows a reusable device buffer to at least `n` elements (never empty).
pub(crate) fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<()> {
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        *buf = None;
        *buf = Some(stream.alloc_zeros::<T>(n.max(1).next_power_of_two()).map_err(dev_err("allocating"))?);
    }
    Ok(())
}

#[cfg(test)]
mod launch_tests {
    use super::grid;

    // Launch sizes used to be cast with `as u32`, so a launch past 2^32
    // blocks wrapped around to a small grid that covered only part of the
    // keys. Now a grid CUDA cannot take is refused with an error.
    #[test]
    fn a_grid_past_cudas_limit_is_refused_not_wrapped() {
        assert_eq!(grid(0, 256).unwrap().grid_dim, (1, 1, 1));
        assert_eq!(grid(257, 256).unwrap().grid_dim, (2, 1, 1));
        let most = i32::MAX as u64 * 256;
        assert_eq!(grid(most, 256).unwrap().grid_dim, (i32::MAX as u32, 1, 1));
        for too_many in [most + 1, (1u64 << 32) * 256 + 1, u64::MAX] {
            let e = grid(too_many, 256).unwrap_err();
            assert!(matches!(e, crate::Error::Config(_)), "{e}");
        }
    }
}
