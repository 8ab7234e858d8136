//! Finding devices without ever panicking, opening one (its kernels
//! compiled by NVRTC, or loaded from the on-disk cache) once per process.

use super::*;

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

pub(super) fn driver_present() -> bool {
    // SAFETY: only tries to load the driver library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub(super) fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the NVRTC library; no NVRTC call is made.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub(super) fn driver_version() -> Result<i32> {
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
pub(super) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// NVRTC wants a `&'static str` architecture: the supported ones.
pub(super) fn arch_name(cc: (i32, i32)) -> Result<&'static str> {
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
    /// Its context (bound to the threads that use it), with cudarc's event
    /// tracking off: whoever allocates on it orders its own streams (see
    /// [`Device::open`]).
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
        // Event tracking is a flag of this `CudaContext`, which every user
        // of the device shares (`shared_device`: each table, the GPU group's
        // nodes, the feature hasher, a device batch), so it is switched off
        // here, once, before any of them allocates, and this argument
        // covers them all.
        // SAFETY: cudarc asks that no buffer be freed before a use on
        // another stream finishes, used on another stream before its
        // allocation finishes, or written by two streams at once. Tracking
        // never ordered a kernel of this crate anyway: kernels get raw
        // device addresses (`table::ptr`, `DevPtr::of`), whose tracking
        // guard is dropped before the launch. Instead each user orders its
        // streams itself: a table uses each buffer on one lane's stream at
        // a time (or, for a large find_or_insert's miss flags, on the
        // stream of the device batch that holds the lane, `Pending`) and
        // synchronises a batch's stream before its lane returns to the
        // pool or a buffer is regrown, and replaces its storage only
        // under the inserter group, every lane idle; a group node allocates
        // on its main stream, its serve stream waits for an event of the
        // main stream before it touches those buffers and is joined back
        // before the batch ends and is synchronised; a group's batch
        // buffers are synchronised once allocated, before the feature
        // hasher's stream writes keys into them (and the hasher waits for
        // its writes); the hasher and a device batch otherwise use one
        // stream of their own; `hash_locate` uses the default stream with
        // blocking copies.
        unsafe { ctx.disable_event_tracking() };
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

pub(super) static CACHE_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sets the kernel cache directory of this process's shared devices
/// ([`shared_device`]); without it every start compiles. Binaries pass
/// [`default_kernel_cache_dir`]. Only the first call counts.
pub fn set_cache_dir(dir: PathBuf) {
    let _ = CACHE_DIR.set(dir);
}

/// The kernel cache directory a binary should give [`set_cache_dir`]:
/// `$HKV_KERNEL_CACHE`, else `preferred` (the daemon's state directory),
/// else `$XDG_CACHE_HOME/hkvd/kernels`, else `$HOME/.cache/hkvd/kernels`,
/// the variables read through `var` (a binary passes
/// `|k| std::env::var_os(k)`): the library reads no environment.
pub fn default_kernel_cache_dir(
    preferred: Option<PathBuf>,
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    if let Some(d) = var("HKV_KERNEL_CACHE") {
        return Some(d.into());
    }
    if preferred.is_some() {
        return preferred;
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Some(Path::new(&d).join("hkvd").join("kernels"));
    }
    var("HOME").map(|h| Path::new(&h).join(".cache").join("hkvd").join("kernels"))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC's log of `src`, compiled for its default architecture, if it
    /// refuses it.
    fn nvrtc(src: &str) -> std::result::Result<(), String> {
        match cudarc::nvrtc::compile_ptx_with_opts(src, CompileOptions::default()) {
            Ok(_) => Ok(()),
            Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(log.to_string_lossy().into_owned()),
            Err(e) => panic!("NVRTC failed before compiling: {e:?}"),
        }
    }

    /// Every kernel module compiles for the H200's architecture (sm_90), as
    /// a device opens. Needs only NVRTC, not a GPU: a machine without one
    /// runs it with the library of the `nvidia-cuda-nvrtc` wheel on
    /// `LD_LIBRARY_PATH` (docs/developing.md, "Kernels without a GPU").
    #[test]
    #[ignore = "needs NVRTC (libnvrtc.so, a CUDA host)"]
    fn every_module_compiles_with_nvrtc() {
        assert!(nvrtc_present(), "no libnvrtc.so");
        // With `HKV_PTXAS` (a ptxas, e.g. the `nvidia-cuda-nvcc` wheel's):
        // each kernel's registers and spills for sm_90 are printed too
        // (docs/developing.md), before any device time is spent.
        let ptxas = std::env::var_os("HKV_PTXAS");
        for id in KernelId::ALL {
            let opts = CompileOptions { arch: Some("sm_90"), ..Default::default() };
            match cudarc::nvrtc::compile_ptx_with_opts(id.source(), opts) {
                Ok(ptx) => {
                    if let Some(p) = &ptxas {
                        print!("{}", ptxas_report(p, id.name(), &ptx.to_src()));
                    }
                }
                Err(e) => {
                    let log = match e {
                        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                        e => format!("{e:?}"),
                    };
                    panic!("{}.cu does not compile:\n{log}", id.name());
                }
            }
        }
    }

    /// `ptxas -v` of one module's PTX: a line per kernel with its
    /// registers, and its spills where it has any.
    fn ptxas_report(ptxas: &std::ffi::OsStr, module: &str, ptx: &str) -> String {
        let dir = std::env::temp_dir().join(format!("hkv-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let file = dir.join(format!("{module}.ptx"));
        std::fs::write(&file, ptx).expect("writing the PTX");
        let out = std::process::Command::new(ptxas)
            .args(["-arch=sm_90", "-v", "-o"])
            .arg(dir.join(format!("{module}.cubin")))
            .arg(&file)
            .output()
            .expect("running ptxas");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(out.status.success(), "ptxas refused {module}: {}", String::from_utf8_lossy(&out.stderr));
        let (mut report, mut kernel) = (String::new(), String::new());
        for line in String::from_utf8_lossy(&out.stderr).lines() {
            if let Some(k) = line.split("entry function '").nth(1) {
                kernel = k.trim_end_matches('\'').to_string();
            } else if let Some(k) = line.split("Function properties for ").nth(1) {
                kernel = k.trim().to_string();
            } else if line.contains("spill") && !line.contains(" 0 bytes spill stores") {
                report += &format!("{module} {kernel}: {}\n", line.trim());
            } else if let Some(r) = line.split("Used ").nth(1) {
                report += &format!("{module} {kernel}: {}\n", r.split(',').next().unwrap_or(r).trim());
            }
        }
        report
    }

    // The CUDA side of the ABI check where it runs: NVRTC itself refuses a
    // module whose struct differs from the list (kernels/abi.h), as a device
    // opens. kernels/tests/abi.rs shows the same with the host compiler on
    // every list entry; this shows that NVRTC evaluates the asserts (and
    // their offsetof) at all.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc.so, a CUDA host)"]
    fn nvrtc_refuses_a_struct_that_differs_from_the_list() {
        assert!(nvrtc_present(), "no libnvrtc.so");
        let src = KernelId::Hash.source();
        nvrtc(&src).expect("the hash module compiles with the ABI asserts");
        let field = src.replacen("    u32 epoch;\n", "    u32 epoch;\n    u32 added;\n", 1);
        let log = nvrtc(&field).expect_err("HkvScoring with a field added compiles");
        assert!(log.contains("sizeof(HkvScoring) is not the 48"), "{log}");
        let entry = src.replacen("SIZE(HkvFilter, 32)", "SIZE(HkvFilter, 40)", 1);
        let log = nvrtc(&entry).expect_err("a list with HkvFilter's size altered compiles");
        assert!(log.contains("sizeof(HkvFilter) is not the 40"), "{log}");
    }
}
