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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};
use hkv_kernels::KernelId;

use crate::config::CudaTuning;
use crate::error::{Error, Result};
use crate::features::{Features, HashKind};

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Driver version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
}

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

fn driver_present() -> bool {
    // SAFETY: only tries to load the driver library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the NVRTC library; no NVRTC call is made.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn driver_version() -> Result<i32> {
    let mut v = 0i32;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer; the
    // driver library is present (checked by the caller).
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Device(format!("cuDriverGetVersion: {r:?}")));
    }
    Ok(v)
}

/// The CUDA devices of this host, or a clear error saying why there are none
/// (no driver library, no device, a driver error). Never panics.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    if !driver_present() {
        return Err(Error::Unavailable("no CUDA driver library (libcuda.so) on this host".into()));
    }
    let n = CudaContext::device_count().map_err(dev_err("cuDeviceGetCount"))?;
    if n <= 0 {
        return Err(Error::Unavailable("the CUDA driver is present but reports no device".into()));
    }
    let driver_version = driver_version()?;
    (0..n as usize)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal).map_err(dev_err("creating a context"))?;
            Ok(DeviceInfo {
                ordinal,
                name: ctx.name().map_err(dev_err("cuDeviceGetName"))?,
                compute_capability: ctx.compute_capability().map_err(dev_err("compute capability"))?,
                driver_version,
            })
        })
        .collect()
}

/// FNV-1a, 64-bit: a hash of the kernel source that is the same in every
/// build (the cache key must not change with the Rust version).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// NVRTC wants a `&'static str` architecture: the supported ones.
fn arch_name(cc: (i32, i32)) -> Result<&'static str> {
    Ok(match cc {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (a, b) => return Err(Error::Unavailable(format!("compute capability {a}.{b} is not supported"))),
    })
}

/// A device with every kernel module loaded.
pub struct Device {
    /// What it is.
    pub info: DeviceInfo,
    /// Its context (bound to the threads that use it).
    pub ctx: Arc<CudaContext>,
    modules: Vec<(KernelId, Arc<CudaModule>)>,
    /// Modules NVRTC compiled when this device was opened (0 with a warm cache).
    pub nvrtc_compiles: usize,
}

impl Device {
    /// Opens device `ordinal` and loads every kernel module, compiling with
    /// NVRTC what `cache_dir` (if any) does not hold yet.
    pub fn open(ordinal: usize, cache_dir: Option<&Path>) -> Result<Device> {
        let info = probe()?
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| Error::Unavailable(format!("no CUDA device {ordinal}")))?;
        let ctx = CudaContext::new(ordinal).map_err(dev_err("creating a context"))?;
        let arch = arch_name(info.compute_capability)?;
        let mut modules = vec![];
        let mut nvrtc_compiles = 0;
        for id in KernelId::ALL {
            let src = id.source();
            let cached: Option<PathBuf> = cache_dir
                .map(|d| d.join(format!("{}-{arch}-drv{}-{:016x}.ptx", id.name(), info.driver_version, fnv1a(&src))));
            let ptx = match cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
                Some(text) => Ptx::from_src(text),
                None => {
                    if !nvrtc_present() {
                        return Err(Error::Unavailable("no NVRTC library (libnvrtc.so) to compile the kernels".into()));
                    }
                    let opts = CompileOptions { arch: Some(arch), ..Default::default() };
                    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| {
                        Error::Device(format!("NVRTC could not compile {}.cu for {arch}: {e:?}", id.name()))
                    })?;
                    nvrtc_compiles += 1;
                    if let Some(p) = &cached {
                        // A cache that cannot be written only costs a compile next time.
                        let _ = std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")));
                        let tmp = p.with_extension("tmp");
                        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
                            let _ = std::fs::rename(&tmp, p);
                        }
                    }
                    ptx
                }
            };
            let m = ctx.load_module(ptx).map_err(dev_err("loading a kernel module"))?;
            modules.push((id, m));
        }
        Ok(Device { info, ctx, modules, nvrtc_compiles })
    }

    pub(crate) fn module(&self, id: KernelId) -> &Arc<CudaModule> {
        &self.modules.iter().find(|(m, _)| *m == id).expect("every module is loaded").1
    }

    /// Bucket (single mode) and digest of every key, computed by the
    /// `hash_locate` kernel: must equal [`crate::hash::locate`].
    pub fn hash_locate(&self, keys: &[u64], buckets: u64) -> Result<(Vec<u64>, Vec<u8>)> {
        if keys.is_empty() {
            return Ok((vec![], vec![]));
        }
        if buckets == 0 {
            return Err(Error::Config("buckets must be at least 1".into()));
        }
        let n = keys.len();
        let stream = self.ctx.default_stream();
        let d_keys = stream.clone_htod(keys).map_err(dev_err("copying keys"))?;
        let mut d_buckets = stream.alloc_zeros::<u64>(n).map_err(dev_err("allocating"))?;
        let mut d_digests = stream.alloc_zeros::<u8>(n).map_err(dev_err("allocating"))?;
        let f = self.module(KernelId::Hash).load_function("hash_locate").map_err(dev_err("hash_locate"))?;
        let (n64, b64) = (n as u64, buckets);
        let mut launch = stream.launch_builder(&f);
        launch.arg(&d_keys).arg(&n64).arg(&b64).arg(&mut d_buckets).arg(&mut d_digests);
        // SAFETY: hash_locate(keys, n, buckets, bucket_out, digest_out) reads
        // keys[0..n] and writes bucket_out[0..n] and digest_out[0..n]; each
        // buffer holds exactly n elements of the kernel's element type, and
        // threads with an index >= n return before touching memory.
        unsafe { launch.launch(grid(n64, 1024)?) }.map_err(dev_err("launching hash_locate"))?;
        let b = stream.clone_dtoh(&d_buckets).map_err(dev_err("copying buckets"))?;
        let d = stream.clone_dtoh(&d_digests).map_err(dev_err("copying digests"))?;
        Ok((b, d))
    }
}

/// Hashes raw features on one device (`features.cu`), reusing its device
/// buffers from batch to batch: each input array goes to the device in one
/// copy, the keys come back in one.
pub struct FeatureHasher {
    stream: Arc<CudaStream>,
    f_int64: CudaFunction,
    f_strings: CudaFunction,
    ints: Option<CudaSlice<i64>>,
    bytes: Option<CudaSlice<u8>>,
    offsets: Option<CudaSlice<u32>>,
    keys: Option<CudaSlice<u64>>,
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

impl FeatureHasher {
    /// A hasher on `device`'s own stream.
    pub fn new(device: &Device) -> Result<FeatureHasher> {
        let stream = device.ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let m = device.module(KernelId::Features);
        Ok(FeatureHasher {
            stream,
            f_int64: m.load_function("features_int64").map_err(dev_err("features_int64"))?,
            f_strings: m.load_function("features_strings").map_err(dev_err("features_strings"))?,
            ints: None,
            bytes: None,
            offsets: None,
            keys: None,
        })
    }

    /// Hashes `features` into `out` (one key per feature), exactly as
    /// [`crate::features::hash_features_cpu`]. Returns the kernel's time in
    /// milliseconds (CUDA events around the launch).
    pub fn hash(&mut self, features: Features<'_>, kind: HashKind, num_buckets: u64, out: &mut [u64]) -> Result<f32> {
        let n = features.len();
        if out.len() != n {
            return Err(Error::Length {
                what: "keys",
                expected: n,
                got: out.len(),
                detail: "one key per feature".into(),
            });
        }
        let Some((start, end)) = self.launch(features, kind, num_buckets, None)? else {
            return Ok(0.0);
        };
        let s = self.stream.clone();
        let keys = self.keys.as_ref().expect("ensured");
        s.memcpy_dtoh(&keys.slice(..n), out).map_err(dev_err("copying keys"))?;
        s.synchronize().map_err(dev_err("synchronizing"))?;
        start.elapsed_ms(&end).map_err(dev_err("reading events"))
    }

    /// Hashes `features` into the first keys of `out`, a buffer on this
    /// hasher's device, where they stay (the device-resident path of a GPU
    /// group). Returns when the keys are written.
    pub fn hash_on_device(
        &mut self,
        features: Features<'_>,
        kind: HashKind,
        num_buckets: u64,
        out: &mut CudaSlice<u64>,
    ) -> Result<()> {
        let n = features.len();
        if out.len() < n {
            return Err(Error::Length {
                what: "keys",
                expected: n,
                got: out.len(),
                detail: "a device buffer of one key per feature or more".into(),
            });
        }
        let (dst, _) = cudarc::driver::DevicePtrMut::device_ptr_mut(out, &self.stream);
        self.launch(features, kind, num_buckets, Some(dst))?;
        self.stream.synchronize().map_err(dev_err("synchronizing"))
    }

    /// Copies the features in and launches the kernel writing keys to `dst`
    /// (a device address of at least `n` keys) or to the hasher's own
    /// buffer; returns the events around the launch (None: no features).
    fn launch(
        &mut self,
        features: Features<'_>,
        kind: HashKind,
        num_buckets: u64,
        dst: Option<u64>,
    ) -> Result<Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>> {
        crate::features::check_buckets(num_buckets)?;
        features.validate()?;
        let n = features.len();
        if n == 0 {
            return Ok(None);
        }
        let (k0, k1) = match kind {
            HashKind::Fingerprint64 => (0u64, 0u64),
            HashKind::Strong { k0, k1 } => (k0, k1),
        };
        let code = kind.code() as i32;
        let (s, n64) = (self.stream.clone(), n as u64);
        let out = match dst {
            Some(d) => d,
            None => {
                ensure(&s, &mut self.keys, n)?;
                let (p, _) = cudarc::driver::DevicePtr::device_ptr(self.keys.as_ref().expect("ensured"), &s);
                p
            }
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start;
        match features {
            Features::Int64(v) => {
                ensure(&s, &mut self.ints, n)?;
                let ints = self.ints.as_mut().expect("ensured");
                s.memcpy_htod(v, &mut ints.slice_mut(..n)).map_err(dev_err("copying features"))?;
                let mut launch = s.launch_builder(&self.f_int64);
                launch.arg(&*ints).arg(&n64).arg(&code).arg(&k0).arg(&k1).arg(&num_buckets).arg(&out);
                start = s.record_event(timing).map_err(dev_err("recording an event"))?;
                // SAFETY: features_int64(x, n, kind, k0, k1, num_buckets, out)
                // reads x[0..n] and writes out[0..n]; x holds at least n i64,
                // `out` at least n u64 (the hasher's buffer, ensured above, or
                // the caller's, checked by hash_on_device), threads with an
                // index >= n return at once, and num_buckets >= 1 was checked.
                unsafe { launch.launch(grid(n64, 1024)?) }.map_err(dev_err("launching features_int64"))?;
            }
            Features::Strings { bytes, offsets } => {
                ensure(&s, &mut self.bytes, bytes.len())?;
                ensure(&s, &mut self.offsets, n + 1)?;
                let (db, dofs) = (self.bytes.as_mut().expect("ensured"), self.offsets.as_mut().expect("ensured"));
                if !bytes.is_empty() {
                    s.memcpy_htod(bytes, &mut db.slice_mut(..bytes.len())).map_err(dev_err("copying bytes"))?;
                }
                s.memcpy_htod(offsets, &mut dofs.slice_mut(..n + 1)).map_err(dev_err("copying offsets"))?;
                let mut launch = s.launch_builder(&self.f_strings);
                launch.arg(&*db).arg(&*dofs).arg(&n64).arg(&code).arg(&k0).arg(&k1).arg(&num_buckets).arg(&out);
                start = s.record_event(timing).map_err(dev_err("recording an event"))?;
                // SAFETY: features_strings(bytes, offsets, n, kind, k0, k1,
                // num_buckets, out) reads offsets[0..=n], bytes in
                // [offsets[i], offsets[i+1]) and writes out[0..n]. validate()
                // checked that the offsets are non-decreasing and end within
                // `bytes`, which was copied whole into a buffer at least that
                // long; offsets holds n + 1 and `out` n elements; num_buckets >= 1.
                unsafe { launch.launch(grid(n64, 1024)?) }.map_err(dev_err("launching features_strings"))?;
            }
        }
        let end = s.record_event(timing).map_err(dev_err("recording an event"))?;
        Ok(Some((start, end)))
    }
}

static CACHE_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sets the kernel cache directory of this process's shared devices
/// ([`shared_device`]); without it every start compiles. Binaries pass
/// [`default_kernel_cache_dir`]. Only the first call counts.
pub fn set_cache_dir(dir: PathBuf) {
    let _ = CACHE_DIR.set(dir);
}

/// The kernel cache directory a binary should give [`set_cache_dir`]:
/// `$HKV_KERNEL_CACHE`, else `preferred` (the daemon's state directory),
/// else `$XDG_CACHE_HOME/hkvd/kernels`, else `$HOME/.cache/hkvd/kernels`.
/// The one function of the library that reads the environment; only
/// binaries (and tests) call it.
pub fn default_kernel_cache_dir(preferred: Option<PathBuf>) -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("HKV_KERNEL_CACHE") {
        return Some(d.into());
    }
    if preferred.is_some() {
        return preferred;
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(Path::new(&d).join("hkvd").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache").join("hkvd").join("kernels"))
}

static TUNING: std::sync::OnceLock<CudaTuning> = std::sync::OnceLock::new();

/// Sets the kernel tuning of the CUDA tables this process opens from now
/// on (a binary's way in for `HKV_*` variables, [`CudaTuning::from_vars`]).
/// Only the first call counts.
pub fn set_tuning(t: CudaTuning) {
    let _ = TUNING.set(t);
}

/// The process's kernel tuning ([`set_tuning`], else the default).
pub fn tuning() -> CudaTuning {
    TUNING.get().copied().unwrap_or_default()
}

/// Device `ordinal`, opened (and its kernels loaded) once per process.
pub fn shared_device(ordinal: usize) -> Result<Arc<Device>> {
    type Opened = parking_lot::Mutex<Vec<(usize, Arc<Device>)>>;
    static DEVICES: std::sync::OnceLock<Opened> = std::sync::OnceLock::new();
    let mut devs = DEVICES.get_or_init(Default::default).lock();
    if let Some((_, d)) = devs.iter().find(|(o, _)| *o == ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(Device::open(ordinal, CACHE_DIR.get().map(PathBuf::as_path))?);
    devs.push((ordinal, d.clone()));
    Ok(d)
}

/// Free and total memory of device `ordinal`, in bytes (binds its
/// context to the calling thread).
pub fn memory(ordinal: usize) -> Result<(u64, u64)> {
    let d = shared_device(ordinal)?;
    let (free, total) = d.ctx.mem_get_info().map_err(dev_err("cuMemGetInfo"))?;
    Ok((free as u64, total as u64))
}

/// Page-locked host memory for a response frame that the GPU writes rows
/// into directly: a find of a CUDA table whose values array lies in such
/// memory copies the rows there from the device in one transfer, without
/// the lane's staging memory in between, and `CudaTable::find_at` has the
/// lookup kernel write rows into it over PCIe. Pinned and mapped for every
/// context (`CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`); zeroed
/// when allocated; freed on drop.
pub struct HostFrame {
    mem: cudarc::driver::PinnedHostSlice<u8>,
    /// `mem`'s address (fixed for its life).
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by `mem` (itself Send + Sync) and reached
// only through &self / &mut self, so the usual borrow rules serialise it.
unsafe impl Send for HostFrame {}
// SAFETY: as above; &self gives read access only.
unsafe impl Sync for HostFrame {}

impl HostFrame {
    /// `bytes` zeroed bytes of pinned memory, allocated in device
    /// `ordinal`'s context.
    pub fn new(ordinal: usize, bytes: usize) -> Result<HostFrame> {
        let dev = shared_device(ordinal)?;
        let flags = cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE | cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: the memory is zeroed below before anything reads it.
        let mut mem = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), flags) }
            .map_err(dev_err("allocating a pinned frame"))?;
        let ptr = mem.as_mut_ptr().map_err(dev_err("a pinned frame"))?;
        // SAFETY: ptr points to at least `bytes` bytes just allocated, owned by `mem`.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(HostFrame { mem, ptr, len: bytes })
    }

    /// The frame's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr` are allocated (len <= capacity) and
        // initialised (zeroed at allocation, written only through &mut).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The frame's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.mem.len()
    }

    /// Makes the frame `len` bytes, at most [`HostFrame::capacity`]; bytes
    /// that come into it keep what they held.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "a pinned frame of {} bytes cannot hold {len}", self.capacity());
        self.len = len;
    }
}

impl Drop for HostFrame {
    /// The memory is freed through its context, which the dropping thread
    /// (a daemon's connection writer, say) may not have bound.
    fn drop(&mut self) {
        let _ = self.mem.context().bind_to_thread();
    }
}

/// Whether `bytes` bytes at `p` lie in page-locked host memory that CUDA
/// copies can reach directly (allocated or registered with the driver):
/// the first and the last byte are (a Rust slice lies in one allocation).
pub fn is_pinned_host(p: *const u8, bytes: usize) -> bool {
    use cudarc::driver::sys::{CUmemorytype, CUpointer_attribute};
    let pinned = |a: u64| {
        pointer_attribute::<u32>(a, CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
            == Some(CUmemorytype::CU_MEMORYTYPE_HOST as u32)
    };
    bytes > 0 && pinned(p as u64) && pinned(p as u64 + bytes as u64 - 1)
}

/// The address through which kernels of the thread's current context reach
/// the `bytes` bytes at `p`, when they lie in page-locked host memory mapped
/// for the device (as a [`HostFrame`] is); else `None`.
pub(crate) fn device_address_of_host(p: *const u8, bytes: usize) -> Option<u64> {
    use cudarc::driver::sys::CUpointer_attribute;
    if !is_pinned_host(p, bytes) {
        return None;
    }
    pointer_attribute::<u64>(p as u64, CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER).filter(|&a| a != 0)
}

/// The driver's answer to a pointer attribute query about address `a`
/// (`T`: the attribute's type, u32 or u64), or None where it has none.
fn pointer_attribute<T: Copy + Default>(a: u64, attr: cudarc::driver::sys::CUpointer_attribute) -> Option<T> {
    use cudarc::driver::sys;
    let mut v = T::default();
    // SAFETY: the call writes one value of the attribute's type, which the
    // callers give as `T`, into `v`; it only looks the address up, never
    // dereferences it.
    let r =
        unsafe { sys::cuPointerGetAttribute(&mut v as *mut T as *mut std::ffi::c_void, attr, a as sys::CUdeviceptr) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
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
            let e = grid(too_many, 256).unwrap_err().to_string();
            assert!(e.contains("blocks"), "{e}");
        }
    }
}
